"""Streaming wake-word detection: audio arrives in chunks of any size; every hop the latest
window is scored, posteriors are smoothed by a moving average, and a detection fires when
the smoothed posterior reaches the threshold outside the refractory period after the
previous one (the rule: detection_rule.py). Window ends lie on a fixed grid of sample indices (window, window + hop, ...),
so the events do not depend on how the stream was chunked."""

from __future__ import annotations

import logging
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
    metadata, or at 0.5 when it carries none (logged); `threshold_source` says which."""

    def __init__(
        self,
        scorer: WindowScorer,
        hop_s: float = DEFAULT_HOP_S,
        threshold: float | None = None,
        smoothing: int = DEFAULT_SMOOTHING,
        refractory_s: float = DEFAULT_REFRACTORY_S,
        max_batch: int = 16,
    ) -> None:
        self.scorer = scorer
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
        self.reset()

    def reset(self) -> None:
        """Forgets the stream: buffered audio, posterior history and the refractory state."""
        self._buf = np.zeros(0, dtype=np.float32)  # stream samples [_buf_start, _total)
        self._buf_start = 0
        self._total = 0
        self._next_end = self.window_samples
        self._rule = FiringState(self.threshold, self.smoothing, self.refractory_hops)
        if self._frames is not None:
            self._frames.reset()

    @property
    def samples_seen(self) -> int:
        return self._total

    def push(self, chunk: np.ndarray) -> list[Detection]:
        """Feeds a chunk (int16 or float32, any length); returns the detections it caused."""
        return self.feed(chunk)[1]

    def _score(self, ends: list[int]) -> np.ndarray:
        """Posteriors of the windows ending at `ends` (stream samples)."""
        windows = [
            self._buf[e - self.window_samples - self._buf_start : e - self._buf_start] for e in ends
        ]
        if self._frames is None:
            return self.scorer.score(np.stack(windows))
        index = [(e - self.window_samples) // self.hop_samples for e in ends]
        feats = np.stack([self._frames.window(w, k) for w, k in zip(windows, index, strict=True)])
        return self.scorer.score_features(feats)  # type: ignore[attr-defined]

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
        posteriors: list[tuple[float, float, float]] = []
        events: list[Detection] = []
        for i in range(0, len(ends), self.max_batch):
            batch = ends[i : i + self.max_batch]
            raw = np.asarray(self._score(batch), dtype=np.float64).reshape(-1)
            if raw.shape[0] != len(batch):
                raise ConfigError(f"scorer returned {raw.shape[0]} scores for {len(batch)} windows")
            for end, r in zip(batch, raw, strict=True):
                if not np.isfinite(r):
                    raise AudioError(f"non-finite posterior at {end / self.sample_rate:.2f} s")
                s, fired = self._rule.step(float(r))
                t = end / self.sample_rate
                posteriors.append((t, float(r), s))
                if fired:
                    events.append(Detection(time_s=t, score=s))
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
) -> DetectionResult:
    """Posteriors and events over a whole array at the scorer's sample rate. Audio shorter
    than one window is left-padded with silence so it is scored once. `threshold` as in
    `StreamingDetector`; the result's `extra` holds the threshold used and its source."""
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
        extra={"threshold": det.threshold, "threshold_source": det.threshold_source},
    )


def detect_file(scorer: WindowScorer, path: Path | str, **kwargs) -> DetectionResult:
    """`detect_audio` over a WAV file, decoded and resampled to the scorer's rate."""
    return detect_audio(scorer, load_audio(path, scorer.sample_rate), **kwargs)
