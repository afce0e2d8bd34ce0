"""Score manifest clips with a wake-word model given as an ONNX file (through onnxruntime,
exactly as on a device) or a safetensors checkpoint (through torch), behind one scorer
interface: `.sample_rate`, `.window_samples`, `.score(windows[B, T]) -> np.ndarray[B]`.

Models compared against each other must hear the same audio: `check_same_frontend` refuses
a candidate whose frontend (sample rate, window, log-mel parameters) differs from the
baseline's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

from wakefl.edge_runtime.detection_rule import DEFAULT_HOP_S, event_indices, smoothed
from wakefl.errors import AudioError, ConfigError, NonFiniteError
from wakefl.progress_bars import bar_disabled
from wakefl.sdk.manifest import ManifestRow

# The ModelConfig fields that decide what the network hears; `width` is not among them.
FRONTEND_FIELDS = (
    "sample_rate",
    "window_samples",
    "n_mels",
    "win_ms",
    "hop_ms",
    "n_fft",
    "f_min",
    "f_max",
)


class Scorer(Protocol):
    sample_rate: int
    window_samples: int

    def score(self, windows: np.ndarray) -> np.ndarray: ...


class TorchScorer:
    """A safetensors checkpoint behind the scorer interface (CPU, no gradients)."""

    def __init__(self, path: str | Path) -> None:
        from wakefl.models.kws_cnn import load_model

        self.path = Path(path)
        self.model = load_model(self.path)
        self.cfg = self.model.cfg
        self.sample_rate = int(self.cfg.sample_rate)
        self.window_samples = int(self.cfg.window_samples)
        self.frontend = frontend_from_config(self.cfg.to_dict())

    def score(self, windows: np.ndarray) -> np.ndarray:
        import torch

        x = np.ascontiguousarray(windows, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.window_samples:
            raise AudioError(f"expected windows of shape [B, {self.window_samples}], got {x.shape}")
        with torch.no_grad():
            return self.model.predict_proba(torch.from_numpy(x)).numpy().astype(np.float64)


def frontend_from_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The frontend fields of a ModelConfig dict; `window_samples` is derived if absent."""
    out = {k: cfg.get(k) for k in FRONTEND_FIELDS if k != "window_samples"}
    if "window_samples" in cfg:
        out["window_samples"] = int(cfg["window_samples"])
    elif cfg.get("window_s") is not None and cfg.get("sample_rate") is not None:
        out["window_samples"] = int(round(float(cfg["window_s"]) * int(cfg["sample_rate"])))
    return out


def _onnx_frontend(meta: dict[str, str], path: Path) -> dict[str, Any]:
    """Frontend fields from an exported model's metadata: the full `model_config` JSON when
    present, else the individual keys."""
    cfg: dict[str, Any] = {}
    if "model_config" in meta:
        try:
            loaded = json.loads(meta["model_config"])
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: metadata 'model_config' is not valid JSON: {exc}") from exc
        if isinstance(loaded, dict):
            cfg.update(loaded)
    for key in FRONTEND_FIELDS:
        if key not in cfg and key in meta:
            try:
                cfg[key] = json.loads(meta[key])
            except json.JSONDecodeError:
                cfg[key] = meta[key]
    return frontend_from_config(cfg)


class OnnxModelScorer:
    """An ONNX file through the edge runtime's `OnnxScorer`, with its frontend fields."""

    def __init__(self, path: str | Path, threads: int = 1) -> None:
        from wakefl.edge_runtime import OnnxScorer

        self.path = Path(path)
        self.inner = OnnxScorer(str(self.path), threads=threads)
        self.sample_rate = int(self.inner.sample_rate)
        self.window_samples = int(self.inner.window_samples)
        self.frontend = _onnx_frontend(dict(getattr(self.inner, "metadata", {})), self.path)
        # The runtime's own view of rate and window is what the device uses: it wins.
        self.frontend["sample_rate"] = self.sample_rate
        self.frontend["window_samples"] = self.window_samples

    def score(self, windows: np.ndarray) -> np.ndarray:
        return np.asarray(self.inner.score(np.asarray(windows, dtype=np.float32)), dtype=np.float64)


def load_scorer(path: str | Path) -> OnnxModelScorer | TorchScorer:
    """A scorer for `path`: `.onnx` through onnxruntime, `.safetensors` through torch."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"model file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".onnx":
        return OnnxModelScorer(path)
    if suffix == ".safetensors":
        return TorchScorer(path)
    raise ConfigError(f"{path}: unknown model format {suffix!r}; give a .onnx or .safetensors file")


def check_same_frontend(baseline: Any, candidate: Any, name: str = "candidate") -> None:
    """Refuse a candidate that does not hear the same audio features as the baseline.

    Fields missing from an ONNX file's metadata are compared only where both models have
    them; sample rate and window length are always known.
    """
    fb, fc = baseline.frontend, candidate.frontend
    diffs = []
    for key in FRONTEND_FIELDS:
        vb, vc = fb.get(key), fc.get(key)
        if key in ("sample_rate", "window_samples") or (vb is not None and vc is not None):
            same = vb == vc or (
                isinstance(vb, (int, float)) and isinstance(vc, (int, float)) and np.isclose(vb, vc)
            )
            if not same:
                diffs.append(f"{key}: baseline {vb!r}, {name} {vc!r}")
    if diffs:
        raise ConfigError(
            f"{name} has a different frontend from the baseline ({'; '.join(diffs)}); "
            "models can only be compared on the same audio features"
        )


def load_clip_windows(
    rows: Sequence[ManifestRow],
    manifest_dir: str | Path,
    sample_rate: int,
    window_samples: int,
    progress: bool = True,
) -> np.ndarray:
    """Decode clip rows into a [N, window_samples] float32 array (one window per clip).

    A clip may differ from the window by a rounding sample or two (trimmed or zero-padded
    at the end); a larger difference is an AudioError naming the file.
    """
    from wakefl.edge_runtime import load_audio

    out = np.zeros((len(rows), window_samples), dtype=np.float32)
    tolerance = max(2, window_samples // 1000)
    for i, row in enumerate(
        tqdm(rows, desc="load clips", unit="clip", disable=bar_disabled(progress))
    ):
        path = Path(manifest_dir) / row.path
        if not path.is_file():
            raise AudioError(f"clip listed in the manifest not found: {path}")
        wave = load_audio(str(path), sample_rate=sample_rate)
        if abs(wave.size - window_samples) > tolerance:
            raise AudioError(
                f"{path}: {wave.size} samples, but the model window is {window_samples} "
                f"({window_samples / sample_rate:.3f} s)"
            )
        n = min(wave.size, window_samples)
        out[i, :n] = wave[:n]
    return out


def score_windows(
    scorer: Scorer, windows: np.ndarray, batch: int = 64, desc: str = "score", progress: bool = True
) -> np.ndarray:
    """Scores of `windows` [N, T] in batches; a non-finite score is a NonFiniteError."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    scores = np.empty(len(windows), dtype=np.float64)
    starts = range(0, len(windows), batch)
    for s in tqdm(starts, desc=desc, unit="batch", disable=bar_disabled(progress)):
        scores[s : s + batch] = scorer.score(windows[s : s + batch])
    if not np.all(np.isfinite(scores)):
        raise NonFiniteError(f"{desc}: the model produced non-finite scores")
    return scores


def score_clips(
    scorer: Scorer,
    rows: Sequence[ManifestRow],
    manifest_dir: str | Path,
    batch: int = 64,
    progress: bool = True,
) -> np.ndarray:
    """Scores of the clip rows, in row order."""
    windows = load_clip_windows(
        rows, manifest_dir, scorer.sample_rate, scorer.window_samples, progress
    )
    return score_windows(scorer, windows, batch, progress=progress)


@dataclass(frozen=True)
class StreamPosteriors:
    """Every hop's raw and smoothed posterior over a whole stream, with the detector rules
    (`refractory_samples`, the hop grid) needed to turn them into events at any threshold.
    Scoring is the costly part; the events at several thresholds then cost next to nothing."""

    ends: np.ndarray  # window end of every hop, in samples of the (padded) stream
    raw: np.ndarray
    smoothed: np.ndarray
    sample_rate: int
    hop_samples: int
    refractory_samples: int
    refractory_hops: int
    pad: int  # silence put before audio shorter than one window, as `detect_audio` does

    @property
    def times_s(self) -> np.ndarray:
        return self.ends / self.sample_rate - self.pad / self.sample_rate


def stream_posteriors(
    scorer: Scorer,
    audio: np.ndarray,
    hop_s: float = DEFAULT_HOP_S,
    smoothing: int | None = None,
    refractory_s: float | None = None,
    batch: int = 64,
) -> StreamPosteriors:
    """What `wakefl.edge_runtime.detect_audio` computes, bit for bit, with the windows cut
    from the whole stream at once and scored in batches of `batch`: a device's detector
    scores a few windows per push, which offline is pure overhead. `smoothing` and
    `refractory_s` None take the detector's defaults."""
    from numpy.lib.stride_tricks import sliding_window_view

    from wakefl.edge_runtime import StreamingDetector, to_float32

    kwargs: dict[str, Any] = {"hop_s": hop_s, "threshold": 0.5}
    if smoothing is not None:
        kwargs["smoothing"] = smoothing
    if refractory_s is not None:
        kwargs["refractory_s"] = refractory_s
    # The detector validates the settings and rounds them to samples: one set of rules.
    det = StreamingDetector(scorer, **kwargs)
    x = to_float32(audio)
    if x.size == 0:
        raise AudioError("no audio samples to score")
    pad = max(0, det.window_samples - x.size)
    if pad:
        x = np.concatenate([np.zeros(pad, dtype=np.float32), x])
    windows = sliding_window_view(x, det.window_samples)[:: det.hop_samples]
    raw = np.empty(len(windows), dtype=np.float64)
    for s in range(0, len(windows), batch):
        raw[s : s + batch] = np.asarray(
            scorer.score(np.ascontiguousarray(windows[s : s + batch])), dtype=np.float64
        ).reshape(-1)
    if not np.all(np.isfinite(raw)):
        i = int(np.flatnonzero(~np.isfinite(raw))[0])
        raise AudioError(
            f"non-finite posterior at {(det.window_samples + i * det.hop_samples) / det.sample_rate:.2f} s"
        )
    ends = det.window_samples + det.hop_samples * np.arange(raw.size, dtype=np.int64)
    return StreamPosteriors(
        ends,
        raw,
        smoothed(raw, det.smoothing),
        det.sample_rate,
        det.hop_samples,
        det.refractory_samples,
        det.refractory_hops,
        pad,
    )


def detection_times(post: StreamPosteriors, threshold: float) -> list[float]:
    """Times (s) of the events the streaming detector raises at `threshold`: the smoothed
    posterior reaches it, at least one refractory period after the previous event."""
    if threshold > 1.0:  # above every probability: the model never fires
        return []
    times = post.times_s
    return [float(times[i]) for i in event_indices(post.smoothed, threshold, post.refractory_hops)]
