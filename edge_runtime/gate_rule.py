"""The two-stage detector's rule: a cheap model (the gate, `small`) scores every window, and
the main model (`full`) scores a window only near where the gate passed, so a device pays
for the main model only on the few windows that might hold the wake phrase.

With the main model's posteriors smoothed over `smoothing` windows:
- the gate passes at hop u when its raw posterior is at least `gate_threshold`;
- the gate is open at hop t when it passed at some hop in [t - hold, t];
- the main model scores hop t when the gate is open at some hop in [t, t + smoothing - 1],
  so every posterior in an open hop's moving average is the main model's own (a device
  scores the few windows before the gate opened when it opens, from features it kept);
  a window it does not score counts as posterior 0;
- the detector fires only at open hops, by the firing rule (detection_rule.py).

At an open hop the smoothed posterior is the one-stage detector's, exactly, so the
two-stage detector fires on a subset of the moments the main model alone would, never
more often (its refractory periods start from its own events, and each of its events maps
to a different event of the main model alone). What it costs in missed phrases is where
the gate stayed shut while the main model would have fired: the detection benchmark reads
that (tools/bench/detection.py, `--gate-pretrained small`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from wakefl.errors import ConfigError

# Hops the gate stays open after it passed: the shipped detector's moving average spans
# three windows, so a gate that passes on any of them lets the main model decide.
GATE_HOLD = 2
# The gate's posterior that opens it, for `small` gating `full`: the highest of 0.01-0.5 at
# which the two-stage detector missed no validation phrase that `full` alone detected; there
# `full` scored 5.1 % of the validation streams' windows (MODEL_CARD.md, "The two-stage
# detector").
DEFAULT_GATE_THRESHOLD = 0.05
# Where a closed hop's smoothed posterior is put so that no threshold in [0, 1] fires on it.
SHUT = -1.0


def gate_open(gate_raw: np.ndarray, gate_threshold: float, hold: int) -> np.ndarray:
    """bool [T]: the gate passed at some hop in [t - hold, t]."""
    passed = np.asarray(gate_raw, dtype=np.float64) >= gate_threshold
    out = passed.copy()
    for lag in range(1, hold + 1):
        out[lag:] |= passed[:-lag]
    return out


def main_scored(open_: np.ndarray, smoothing: int) -> np.ndarray:
    """bool [T]: the main model scores hop t (the gate is open at a hop in
    [t, t + smoothing - 1])."""
    open_ = np.asarray(open_, dtype=bool)
    out = open_.copy()
    for lead in range(1, smoothing):
        out[:-lead] |= open_[lead:]
    return out


def gated_raw(raw: np.ndarray, scored: np.ndarray) -> np.ndarray:
    """The main model's posteriors where it scores, 0 where it does not."""
    return np.where(np.asarray(scored, dtype=bool), np.asarray(raw, dtype=np.float64), 0.0)


def shut_closed(smoothed_scores: np.ndarray, open_: np.ndarray) -> np.ndarray:
    """Smoothed posteriors with closed hops set to `SHUT`: what the firing rule reads."""
    return np.where(np.asarray(open_, dtype=bool), smoothed_scores, SHUT)


@dataclass(frozen=True)
class Gate:
    """A gate for `StreamingDetector`: `scorer` scores every window; the detector's own
    model scores only where it opened. `hold` in hops."""

    scorer: object
    threshold: float
    hold: int = GATE_HOLD

    def __post_init__(self) -> None:
        if not (0.0 <= self.threshold <= 1.0):  # NaN fails this too
            raise ConfigError(f"gate threshold must be in [0, 1], got {self.threshold}")
        if self.hold < 0:
            raise ConfigError(f"gate hold must be >= 0 hops, got {self.hold}")


@dataclass
class GateState:
    """The gate applied one window at a time: `step(gate_raw)` says whether the hop is open
    and which earlier hops (as counts back from this one, 1 = the previous) the main model
    must now score that it skipped."""

    threshold: float
    hold: int
    smoothing: int
    _hop: int = field(init=False, default=0)
    _last_pass: int | None = field(init=False, default=None)
    # The hop up to which (exclusive) the main model has scored every hop it needs.
    _scored_to: int = field(init=False, default=0)
    scored: int = field(init=False, default=0)  # windows the main model scored

    @property
    def hops(self) -> int:
        """Windows the gate has scored."""
        return self._hop

    def step(self, gate_raw: float) -> tuple[bool, list[int]]:
        """(open, back): `back` lists the earlier hops to score now, oldest first, as
        counts back from this hop; when open, this hop is scored too."""
        t = self._hop
        if gate_raw >= self.threshold:
            self._last_pass = t
        is_open = self._last_pass is not None and t - self._last_pass <= self.hold
        back: list[int] = []
        if is_open:
            first = max(self._scored_to, t - (self.smoothing - 1))
            back = [t - h for h in range(first, t)]
            self._scored_to = t + 1
            self.scored += len(back) + 1
        self._hop += 1
        return is_open, back
