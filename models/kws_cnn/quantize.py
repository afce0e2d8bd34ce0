"""Static int8 (QDQ) quantization of an exported fp32 model with onnxruntime. Only the
CNN's convolutions and the head's Gemms are quantized: the log-mel frontend (the DFT
convolution, mel MatMul, log) spans too wide a dynamic range for 8 bits and stays float. (quantize_dynamic
and quant_pre_process fail on this graph's shape inference; static QDQ does not need them.)"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.errors import ConfigError

QUANTIZED_OPS = ["Conv", "Gemm"]


def synthetic_calibration_windows(
    window_samples: int, sample_rate: int, n: int = 16, seed: int = 0
) -> np.ndarray:
    """Deterministic calibration audio spanning quiet to loud levels: noise, tone sweeps
    and amplitude-modulated harmonics (speech-like energy in 100 Hz-4 kHz). Real windows
    from a corpus calibrate better; this is the fallback."""
    rng = np.random.default_rng(seed)
    t = np.arange(window_samples) / sample_rate
    out = np.empty((n, window_samples), dtype=np.float32)
    for i in range(n):
        level = 10 ** rng.uniform(-3.0, -0.3)
        kind = i % 3
        if kind == 0:
            x = rng.standard_normal(window_samples)
        elif kind == 1:
            f0, f1 = rng.uniform(100, 500), rng.uniform(1000, 4000)
            phase = 2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * t[-1]))
            x = np.sin(phase) + 0.1 * rng.standard_normal(window_samples)
        else:
            f0 = rng.uniform(90, 250)
            x = sum((np.sin(2 * np.pi * k * f0 * t) / k for k in range(1, 12)), np.zeros_like(t))
            x *= 0.5 * (1 + np.sin(2 * np.pi * rng.uniform(2, 6) * t))
            x += 0.05 * rng.standard_normal(window_samples)
        x = x / (np.max(np.abs(x)) + 1e-9) * level
        out[i] = x.astype(np.float32)
    return out


def calibration_windows(waves: Sequence[np.ndarray], window: int, most: int = 256) -> np.ndarray:
    """Up to `most` windows of `window` samples, half-overlapping, cut from recordings
    (each padded in front with silence to one window when shorter): what calibrates int8
    on the user's own audio."""
    wins = []
    for x in waves:
        if x.size < window:
            x = np.concatenate([np.zeros(window - x.size, np.float32), x])
        step = max(window // 2, 1)
        wins += [x[i : i + window] for i in range(0, x.size - window + 1, step)]
    if not wins:
        raise ConfigError("no calibration windows in the given files")
    return np.stack(wins[:most])


class _WindowReader:
    """onnxruntime CalibrationDataReader over [N, T] windows, one window per batch."""

    def __init__(self, input_name: str, windows: np.ndarray) -> None:
        self._input = input_name
        self._windows = windows
        self._it: Iterator[np.ndarray] = iter(windows)

    def get_next(self) -> dict[str, np.ndarray] | None:
        w = next(self._it, None)
        return None if w is None else {self._input: w[None, :].astype(np.float32)}

    def rewind(self) -> None:
        self._it = iter(self._windows)


def frontend_convs(graph: Any) -> list[str]:
    """The names of the 1-D convolutions of the frontend (its DFT over the waveform): they
    stay float like the rest of the frontend."""
    weights = {t.name: list(t.dims) for t in graph.initializer}
    return [
        n.name for n in graph.node if n.op_type == "Conv" and len(weights.get(n.input[1], [])) == 3
    ]


def quantize_int8(
    fp32_path: Path | str, out_path: Path | str, calibration_windows: np.ndarray
) -> Path:
    """Writes the static-QDQ int8 version of `fp32_path` to `out_path`."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    windows = np.asarray(calibration_windows, dtype=np.float32)
    if windows.ndim < 2 or windows.shape[0] == 0:
        raise ConfigError(f"calibration inputs must be [N, ...] with N >= 1, got {windows.shape}")
    if not np.isfinite(windows).all():
        raise ConfigError("calibration windows hold NaN/Inf")
    graph = onnx.load(str(fp32_path), load_external_data=False).graph
    input_name = graph.input[0].name

    class Reader(_WindowReader, CalibrationDataReader):
        pass

    # The quantizer logs a pre-processing advice that does not apply here (see module doc).
    root = logging.getLogger()
    old = root.level
    root.setLevel(logging.ERROR)
    try:
        quantize_static(
            str(fp32_path),
            str(out_path),
            Reader(input_name, windows),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=QUANTIZED_OPS,
            nodes_to_exclude=frontend_convs(graph),
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
    finally:
        root.setLevel(old)
    return Path(out_path)
