"""Scores fixed-length audio windows with an exported wake-word model in onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from wakefl.errors import AudioError, ConfigError
from wakefl.operating_point import SOURCE_KEY, metadata_threshold

from .log_mel import LogMel, LogMelSpec


class OnnxScorer:
    """`score(windows [B, window_samples]) -> [B]` wake probabilities. The sample rate and
    window length come from the model's ONNX metadata; for a log-mel-input model (the
    default export) so do the frontend's settings, and `log_mel` computes its input.
    `shipped_threshold` is the threshold the model ships with (None when its metadata
    holds none), `threshold_source` says where it comes from."""

    def __init__(self, path: Path | str, threads: int = 1) -> None:
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"ONNX model {path} not found")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = max(1, int(threads))
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        try:
            # QDQ propagation moves an int8 model's quantize step in front of MaxPool,
            # which then runs onnxruntime's uint8 kernel: 1.4 ms of a 3.8 ms window on one
            # core, against 0.25 ms for the float kernel it replaces. Max-pooling commutes
            # with the (monotonic) quantization, so the scores do not change.
            self._session = ort.InferenceSession(
                str(path),
                opts,
                providers=["CPUExecutionProvider"],
                disabled_optimizers=["QDQPropagationTransformer"],
            )
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise ConfigError(f"{path}: not a loadable ONNX model ({exc})") from exc
        meta = self._session.get_modelmeta().custom_metadata_map
        try:
            self.sample_rate = int(meta["sample_rate"])
            self.window_samples = int(meta["window_samples"])
        except (KeyError, ValueError) as exc:
            raise ConfigError(
                f"{path}: ONNX metadata lacks sample_rate/window_samples; export "
                f"it with `wakefl model export`"
            ) from exc
        self.metadata = dict(meta)
        self.path = path
        self.shipped_threshold = metadata_threshold(meta, str(path))
        # Where the shipped threshold comes from, in words ("" when there is none).
        self.threshold_source = str(meta.get(SOURCE_KEY, ""))
        self._input = self._session.get_inputs()[0].name
        # A log-mel-input model: the frontend runs here, in numpy (edge_runtime.log_mel).
        self.log_mel: LogMel | None = None
        if meta.get("input", "wave") == "log_mel":
            spec = LogMelSpec.from_metadata(meta)
            if spec.window_samples != self.window_samples:
                raise ConfigError(f"{path}: inconsistent window length in the metadata")
            self.log_mel = LogMel(spec)

    def score(self, windows: np.ndarray) -> np.ndarray:
        w = np.asarray(windows, dtype=np.float32)
        if w.ndim == 1:
            w = w[None, :]
        if w.ndim != 2 or w.shape[1] != self.window_samples:
            raise AudioError(f"windows must be [B, {self.window_samples}], got {w.shape}")
        if w.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        return self._run(w if self.log_mel is None else self.log_mel(w))

    def score_features(self, log_mel: np.ndarray) -> np.ndarray:
        """Scores [B, n_mels, frames] log-mel inputs of a log-mel-input model (what
        `StreamingDetector` computes incrementally)."""
        if self.log_mel is None:
            raise ConfigError(f"{self.path} takes the waveform, not log-mel features")
        spec = self.log_mel.spec
        f = np.asarray(log_mel, dtype=np.float32)
        if f.ndim != 3 or f.shape[1:] != (spec.n_mels, spec.frames):
            raise AudioError(f"features must be [B, {spec.n_mels}, {spec.frames}], got {f.shape}")
        return self._run(f)

    def _run(self, x: np.ndarray) -> np.ndarray:
        (prob,) = self._session.run(None, {self._input: np.ascontiguousarray(x)})
        return np.asarray(prob, dtype=np.float32).reshape(-1)
