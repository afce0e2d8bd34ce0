"""Streaming wake-word detection: audio arrives in chunks of any size; every hop the latest
window is scored, posteriors are smoothed by a moving average, and a detection fires when
the smoothed posterior reaches the threshold outside the refractory period after the
previous one (the rule: detection_rule.py). Window ends lie on a fixed grid of sample indices (window, window + hop, ...),
so the events do not depend on how the stream was chunked."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from wakefl.errors import AudioError, ConfigError

from .audio_input import load_audio, to_float32
from .detection_rule import (
    DEFAULT_HOP_S,
    DEFAULT_REFRACTORY_S,
    DEFAULT_SMOOTHING,
    FiringState,
    hop_samples,
    refractory_hops,
)
from .gate_rule import Gate, GateState
from .log_mel import StreamingLogMel

log = logging.getLogger("wakefl.edge")

# The threshold of a model that carries none (a model exported before thresholds travelled
# with it, or one never tuned): not an operating point, only a midpoint.
FALLBACK_THRESHOLD = 0.5


def resolve_threshold(scorer: object, threshold: float | None) -> tuple[float, str]:
    """The threshold a detector runs at and where it comes from, in words: `threshold`
    when given, else the model's shipped threshold (`scorer.shipped_threshold`, from the
    ONNX metadata), else `FALLBACK_THRESHOLD`."""
    if threshold is not None:
        return float(threshold), "given"
    shipped = getattr(scorer, "shipped_threshold", None)
    if shipped is not None:
        source = getattr(scorer, "threshold_source", "") or "its metadata"
        return float(shipped), f"the model's shipped threshold ({source})"
    return FALLBACK_THRESHOLD, (
        f"{FALLBACK_THRESHOLD}, a fallback: the model carries no shipped threshold"
    )


class WindowScorer(Protocol):
    """Anything that scores [B, window_samples] float32 windows (onnxruntime or torch)."""

    sample_rate: int
    window_samples: int

    def score(self, windows: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class Detection:
    """A wake-word event: `time_s` is the end of the triggering window in stream time,
    `score` its smoothed posterior."""

    time_s: float
    score: float


@dataclass
class DetectionResult:
    """Posteriors at every hop and the events of a whole file or array."""

    times_s: np.ndarray
    raw_scores: np.ndarray
    scores: np.ndarray  # smoothed
    events: list[Detection]
    duration_s: float
    sample_rate: int
    extra: dict = field(default_factory=dict)


class StreamingDetector:
    """`threshold` None (the default) runs at the model's shipped threshold, from its ONNX
    metadata, or at 0.5 when it carries none (logged); `threshold_source` says which.
    With a `gate` (gate_rule.py), the gate's model scores every window and `scorer` only
    those near where the gate passed: `main_windows` of `windows` so far."""

    def __init__(
        self,
        scorer: WindowScorer,
        hop_s: float = DEFAULT_HOP_S,
        threshold: float | None = None,
        smoothing: int = DEFAULT_SMOOTHING,
        refractory_s: float = DEFAULT_REFRACTORY_S,
        max_batch: int = 16,
        gate: Gate | None = None,
    ) -> None:
        self.scorer = scorer
        self.gate = gate
        self.sample_rate = int(scorer.sample_rate)
        self.window_samples = int(scorer.window_samples)
        self.hop_samples = hop_samples(hop_s, self.sample_rate)
        if self.hop_samples < 1:
            raise ConfigError(f"hop of {hop_s} s is shorter than one sample")
        if self.hop_samples > self.window_samples:
            raise ConfigError(
                f"hop of {hop_s} s exceeds the model window "
                f"({self.window_samples / self.sample_rate} s)"
            )
        threshold, self.threshold_source = resolve_threshold(scorer, threshold)
        if self.threshold_source != "given":
            log.info("detection threshold %.4f: %s", threshold, self.threshold_source)
        if not (0.0 <= threshold <= 1.0):
            raise ConfigError(f"threshold must be in [0, 1], got {threshold}")
        if smoothing < 1:
            raise ConfigError(f"smoothing must be at least 1 posterior, got {smoothing}")
        if refractory_s < 0:
            raise ConfigError(f"refractory period must be >= 0, got {refractory_s}")
        self.hop_s = self.hop_samples / self.sample_rate
        self.threshold = float(threshold)
        self.smoothing = int(smoothing)
        self.refractory_samples = int(round(refractory_s * self.sample_rate))
        self.refractory_hops = refractory_hops(refractory_s, hop_s, self.sample_rate)
        self.max_batch = max(1, int(max_batch))
        # A log-mel-input scorer: compute each window's shared frames once.
        log_mel = getattr(scorer, "log_mel", None)
        self._frames = (
            StreamingLogMel(log_mel, self.hop_samples)
            if log_mel is not None and self.hop_samples % log_mel.spec.hop_length == 0
            else None
        )
        if gate is not None:
            self._check_gate(gate)
        self.reset()

    def _check_gate(self, gate: Gate) -> None:
        g = gate.scorer
        if (getattr(g, "sample_rate", None), getattr(g, "window_samples", None)) != (
            self.sample_rate,
            self.window_samples,
        ):
            raise ConfigError("the gate's model must take the same windows as the main model")
        if self._frames is not None:
            spec = getattr(getattr(g, "log_mel", None), "spec", None)
            if spec != self._frames.log_mel.spec:
                raise ConfigError("the gate's model must take the main model's log-mel input")

    def reset(self) -> None:
        """Forgets the stream: buffered audio, posterior history and the refractory state."""
        self._buf = np.zeros(0, dtype=np.float32)  # stream samples [_buf_start, _total)
        self._buf_start = 0
        self._total = 0
        self._next_end = self.window_samples
        self._rule = FiringState(self.threshold, self.smoothing, self.refractory_hops)
        # (window end, posterior, smoothed, fired) of the windows stepped in this `feed`.
        self._stepped: list[tuple[int, float, float, bool]] = []
        if self._frames is not None:
            self._frames.reset()
        if self.gate is not None:
            self._gate = GateState(self.gate.threshold, self.gate.hold, self.smoothing)
            # The inputs of the windows the main model may still have to score.
            self._kept: deque[np.ndarray] = deque(maxlen=self.smoothing - 1)

    @property
    def windows(self) -> int:
        """Windows scored so far (by the gate's model, with a gate)."""
        return self._rule.hops

    @property
    def main_windows(self) -> int:
        """Windows the main model scored so far: all of them without a gate."""
        return self._gate.scored if self.gate is not None else self._rule.hops

    @property
    def samples_seen(self) -> int:
        return self._total

    def push(self, chunk: np.ndarray) -> list[Detection]:
        """Feeds a chunk (int16 or float32, any length); returns the detections it caused."""
        return self.feed(chunk)[1]

    def _inputs(self, ends: list[int]) -> np.ndarray:
        """The model inputs of the windows ending at `ends` (stream samples): log-mel
        features for a log-mel-input model, else the audio windows (copied)."""
        windows = [
            self._buf[e - self.window_samples - self._buf_start : e - self._buf_start] for e in ends
        ]
        if self._frames is None:
            return np.stack(windows)
        index = [(e - self.window_samples) // self.hop_samples for e in ends]
        return np.stack([self._frames.window(w, k) for w, k in zip(windows, index, strict=True)])

    def _run(self, scorer: object, inputs: np.ndarray) -> np.ndarray:
        """Posteriors of `inputs`, checked: one finite score each."""
        method = "score" if self._frames is None else "score_features"
        raw = np.asarray(getattr(scorer, method)(inputs), dtype=np.float64).reshape(-1)
        if raw.shape[0] != len(inputs):
            raise ConfigError(f"scorer returned {raw.shape[0]} scores for {len(inputs)} windows")
        if not np.all(np.isfinite(raw)):
            raise AudioError(f"non-finite posterior at {self._total / self.sample_rate:.2f} s")
        return raw

    def _score(self, ends: list[int]) -> np.ndarray:
        """Posteriors of the windows ending at `ends` (stream samples)."""
        return self._run(self.scorer, self._inputs(ends))

    def _gated(self, ends: list[int]) -> None:
        """Steps each window, the main model scored where the gate opened and the skipped
        windows it now needs restated in the firing rule. Each window is stepped before the
        next is looked at: a later window's gate may restate it."""
        inputs = self._inputs(ends)
        gate = self._run(self.gate.scorer, inputs)  # type: ignore[union-attr]
        for k, end in enumerate(ends):
            is_open, back = self._gate.step(float(gate[k]))
            raw = 0.0
            if is_open:
                kept = [self._kept[len(self._kept) - b] for b in back]
                scores = self._run(self.scorer, np.stack([*kept, inputs[k]]))
                for b, r in zip(back, scores[:-1], strict=True):
                    self._rule.restate(b, float(r))
                raw = float(scores[-1])
            self._kept.append(inputs[k])
            self._fire(end, raw, is_open)

    def _fire(self, end: int, raw: float, may_fire: bool) -> None:
        s, fired = self._rule.step(raw, may_fire)
        self._stepped.append((end, raw, s, fired))

    def feed(self, chunk: np.ndarray) -> tuple[list[tuple[float, float, float]], list[Detection]]:
        """Like `push`, also returning (time_s, raw, smoothed) for every scored window."""
        x = to_float32(chunk)
        if x.size:
            self._buf = np.concatenate([self._buf, x]) if self._buf.size else x.copy()
            self._total += x.size
        ends = []
        while self._next_end <= self._total:
            ends.append(self._next_end)
            self._next_end += self.hop_samples
        self._stepped = []
        for i in range(0, len(ends), self.max_batch):
            batch = ends[i : i + self.max_batch]
            if self.gate is not None:
                self._gated(batch)
                continue
            for end, r in zip(batch, self._score(batch), strict=True):
                self._fire(end, float(r), True)
        posteriors = [(end / self.sample_rate, r, s) for end, r, s, _ in self._stepped]
        events = [
            Detection(time_s=end / self.sample_rate, score=s)
            for end, _, s, fired in self._stepped
            if fired
        ]
        # Keep only what the next window needs.
        drop = self._next_end - self.window_samples - self._buf_start
        if drop > 0:
            self._buf = self._buf[drop:]
            self._buf_start += drop
        return posteriors, events


def detect_audio(
    scorer: WindowScorer,
    audio: np.ndarray,
    hop_s: float = DEFAULT_HOP_S,
    threshold: float | None = None,
    smoothing: int = DEFAULT_SMOOTHING,
    refractory_s: float = DEFAULT_REFRACTORY_S,
    max_batch: int = 16,
    gate: Gate | None = None,
) -> DetectionResult:
    """Posteriors and events over a whole array at the scorer's sample rate. Audio shorter
    than one window is left-padded with silence so it is scored once. `threshold` and
    `gate` as in `StreamingDetector`; the result's `extra` holds the threshold used, its
    source and how many windows the main model scored."""
    x = to_float32(audio)
    if x.size == 0:
        raise AudioError("no audio samples to score")
    det = StreamingDetector(
        scorer,
        hop_s=hop_s,
        threshold=threshold,
        smoothing=smoothing,
        refractory_s=refractory_s,
        max_batch=max_batch,
        gate=gate,
    )
    pad = max(0, det.window_samples - x.size)
    if pad:
        x = np.concatenate([np.zeros(pad, dtype=np.float32), x])
    posteriors, events = det.feed(x)
    arr = np.asarray(posteriors, dtype=np.float64).reshape(-1, 3)
    # Times are reported on the original (unpadded) audio's clock.
    times = arr[:, 0] - pad / det.sample_rate
    events = [Detection(time_s=e.time_s - pad / det.sample_rate, score=e.score) for e in events]
    return DetectionResult(
        times_s=times,
        raw_scores=arr[:, 1],
        scores=arr[:, 2],
        events=events,
        duration_s=(x.size - pad) / det.sample_rate,
        sample_rate=det.sample_rate,
        extra={
            "threshold": det.threshold,
            "threshold_source": det.threshold_source,
            "main_windows": det.main_windows,
        },
    )


def detect_file(scorer: WindowScorer, path: Path | str, **kwargs) -> DetectionResult:
    """`detect_audio` over a WAV file, decoded and resampled to the scorer's rate."""
    return detect_audio(scorer, load_audio(path, scorer.sample_rate), **kwargs)
