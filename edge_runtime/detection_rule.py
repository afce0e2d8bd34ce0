"""The streaming detector's firing rule, in one place: which windows are scored (their ends
on a grid of hops), how posteriors are smoothed (a moving average, fewer terms at the
stream's start), and when a smoothed posterior fires (at or above the threshold, at least
a refractory period after the previous event, counted in whole hops).

The streaming detector applies it one posterior at a time (`FiringState`); offline scoring,
training validation and the benchmarks apply it to whole arrays (`smoothed`,
`event_indices`, `count_events`). Both give the same events, bit for bit."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

# The shipped detector's settings are defined once, with the operating point's format.
from wakefl.operating_point import DEFAULT_HOP_S, DEFAULT_REFRACTORY_S, DEFAULT_SMOOTHING

__all__ = [
    "DEFAULT_HOP_S",
    "DEFAULT_REFRACTORY_S",
    "DEFAULT_SMOOTHING",
    "FiringState",
    "count_events",
    "event_indices",
    "hop_samples",
    "refractory_hops",
    "smoothed",
    "smoothed_posterior",
    "stream_windows",
]


def hop_samples(hop_s: float, sample_rate: int) -> int:
    """The hop in whole samples: window ends lie on this grid."""
    return int(round(hop_s * sample_rate))


def refractory_hops(refractory_s: float, hop_s: float, sample_rate: int) -> int:
    """The refractory period as a whole number of hops that covers it: the detector
    compares window ends in samples, and they lie a whole number of hops apart."""
    refractory = int(round(refractory_s * sample_rate))
    return math.ceil(refractory / max(1, hop_samples(hop_s, sample_rate)))


def stream_windows(wave: np.ndarray, window: int, hop: int) -> np.ndarray:
    """Every window the streaming detector scores (a view): ends at window, window + hop, ..."""
    n = 1 + (wave.size - window) // hop
    return np.lib.stride_tricks.sliding_window_view(wave, window)[::hop][:n]


def smoothed_posterior(recent: deque[float]) -> float:
    """Moving average over the most recent posteriors (fewer at the stream's start)."""
    return float(sum(recent) / len(recent))


def smoothed(raw: np.ndarray, smoothing: int) -> np.ndarray:
    """`smoothed_posterior` at every hop of a whole stream, with its float rounding: the
    recent posteriors summed oldest first from 0, divided by how many there are."""
    raw = np.asarray(raw, dtype=np.float64)
    acc = np.zeros(raw.size, dtype=np.float64)
    for lag in range(smoothing - 1, -1, -1):  # oldest first, as `sum` adds them
        acc[lag:] += raw[: raw.size - lag]
    return acc / np.minimum(np.arange(1, raw.size + 1), smoothing)


def event_indices(scores: np.ndarray, threshold: float, refractory: int) -> list[int]:
    """Hops (indices into the smoothed `scores`) where the detector fires at `threshold`,
    each at least `refractory` hops after the previous one."""
    out: list[int] = []
    for i in np.flatnonzero(np.asarray(scores) >= threshold):
        if not out or int(i) - out[-1] >= refractory:
            out.append(int(i))
    return out


def count_events(scores: np.ndarray, threshold: float, refractory: int) -> int:
    """How many times the detector fires on smoothed `scores` at `threshold`."""
    return len(event_indices(scores, threshold, refractory))


@dataclass
class FiringState:
    """The rule applied one raw posterior at a time, as a stream arrives."""

    threshold: float
    smoothing: int
    refractory: int  # hops
    _recent: deque[float] = field(init=False)
    _hop: int = field(init=False, default=0)
    _last: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._recent = deque(maxlen=self.smoothing)

    def step(self, raw: float, may_fire: bool = True) -> tuple[float, bool]:
        """The smoothed posterior of this hop, and whether the detector fires on it
        (never where `may_fire` is false: a two-stage detector's closed hops, gate_rule.py)."""
        self._recent.append(float(raw))
        s = smoothed_posterior(self._recent)
        fired = (
            may_fire
            and s >= self.threshold
            and (self._last is None or self._hop - self._last >= self.refractory)
        )
        if fired:
            self._last = self._hop
        self._hop += 1
        return s, fired

    @property
    def hops(self) -> int:
        """Posteriors stepped so far."""
        return self._hop

    def restate(self, back: int, raw: float) -> None:
        """Replaces the posterior `back` hops before the next one (1 = the latest) that was
        taken as 0 when it was stepped: a two-stage detector scores a skipped window once
        its gate opens. Hops already stepped do not fire again."""
        if not 1 <= back <= len(self._recent):
            raise IndexError(f"no posterior {back} hops back (holding {len(self._recent)})")
        self._recent[len(self._recent) - back] = float(raw)
