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
# Activations and weights both as uint8 (U8U8), not the u8s8 that onnxruntime defaults to:
# on x86 CPUs with AVX2 and no VNNI its u8s8 kernels add pairs of products in 16 bits and
# saturate. There `full`'s u8s8 export changed 27 of 1,500 validation clips' decisions and
# 6 of the 106 held-out windows'; U8U8 changed 1 and 1, about as few as S8S8 (5 and 0),
# at 1.2x u8s8's latency where S8S8 took 2x (MODEL_CARD.md, "int8 calibration set").
ACTIVATION_TYPE = "QUInt8"
WEIGHT_TYPE = "QUInt8"
# The calibration set shipped beside the pretrained models (made by
# tools/corpus/calibration_set.py): its windows, one after another, and what each holds.
CALIBRATION_AUDIO = "int8-calibration.flac"
CALIBRATION_INDEX = "int8-calibration.json"
CALIBRATION_DIR = Path(__file__).resolve().parent / "pretrained"
# Below this share of windows on which int8 and fp32 decide alike, `model export --int8`
# warns: one decision in a hundred is what a device maker would notice in the field.
AGREEMENT_FLOOR = 0.99
# The agreement report lists this many of the windows int8 decides apart: enough to see
# where they sit against the threshold, few enough that a broken export's report stays short.
FLIPPED_LISTED = 8
# How the activations' ranges are read off the calibration windows: their extremes
# ("minmax", what exports use), or the 99.999th percentile of their histogram
# ("percentile": one outlying activation cannot widen a step for all the others).
CALIBRATION_METHODS = ("minmax", "percentile")


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


def bundled_calibration(role: str, folder: Path = CALIBRATION_DIR) -> tuple[np.ndarray, str]:
    """The shipped calibration set's windows of `role` ("calibration" or "held_out") as
    [N, window] float32, and a line saying what they hold."""
    import json

    import soundfile as sf

    index = json.loads((folder / CALIBRATION_INDEX).read_text(encoding="utf-8"))
    audio, _ = sf.read(str(folder / CALIBRATION_AUDIO), dtype="float32")
    windows = audio.reshape(-1, int(index["window_samples"]))
    rows = index["windows"]
    if len(rows) != windows.shape[0]:
        raise ConfigError(f"{folder / CALIBRATION_INDEX} does not describe {CALIBRATION_AUDIO}")
    keep = [i for i, r in enumerate(rows) if r["role"] == role]
    voices = {r["voice"].split(":")[0] for r in (rows[i] for i in keep) if r["voice"]}
    devices = sorted({rows[i]["device_type"] for i in keep})
    said = (
        f"{len(keep)} windows of the shipped calibration set: "
        f"{len({rows[i]['voice'] for i in keep} - {''})} voices of {', '.join(sorted(voices))}, "
        f"device types {''.join(devices)}"
    )
    return windows[keep], said


def bundled_stream(role: str, window: int, hop: int) -> tuple[np.ndarray, str]:
    """The shipped calibration set's windows of `role` played one after another as a
    stream and cut again into [N, window] windows every `hop` samples: every offset a
    streaming device scores. With the line of `bundled_calibration` saying what they hold."""
    from wakefl.edge_runtime.detection_rule import stream_windows

    windows, said = bundled_calibration(role)
    return np.ascontiguousarray(stream_windows(windows.reshape(-1), window, hop)), said


def decision_agreement(fp32: np.ndarray, int8: np.ndarray, threshold: float) -> dict[str, Any]:
    """How often the int8 model decides as the fp32 model does at `threshold` (a window
    fires when its score reaches it), over the same windows, and their largest score gap;
    `flipped` lists the windows decided apart (index and both scores, at most
    FLIPPED_LISTED of them, those nearest the threshold in fp32 first), which tells a
    quantization error from fp32 scores that sit on the threshold."""
    a, b = np.asarray(fp32, np.float64), np.asarray(int8, np.float64)
    if a.shape != b.shape or a.size == 0:
        raise ConfigError(f"agreement needs scores of the same windows, got {a.shape}, {b.shape}")
    apart = np.flatnonzero((a >= threshold) != (b >= threshold))
    agree = int(a.size - apart.size)
    nearest = apart[np.argsort(np.abs(a[apart] - threshold), kind="stable")][:FLIPPED_LISTED]
    return {
        "windows": int(a.size),
        "agree": agree,
        "share": agree / a.size,
        "threshold": float(threshold),
        "max_score_gap": float(np.max(np.abs(a - b))),
        "below_floor": agree / a.size < AGREEMENT_FLOOR,
        "flipped": [{"window": int(i), "fp32": float(a[i]), "int8": float(b[i])} for i in nearest],
    }


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


def check_calibration_method(method: str) -> None:
    if method not in CALIBRATION_METHODS:
        raise ConfigError(
            f"calibration method must be one of {', '.join(CALIBRATION_METHODS)}, got {method!r}"
        )


def quantize_int8(
    fp32_path: Path | str,
    out_path: Path | str,
    calibration_windows: np.ndarray,
    method: str = "minmax",
) -> Path:
    """Writes the static-QDQ int8 version of `fp32_path` to `out_path`, its activation
    ranges read off `calibration_windows` by `method` (one of CALIBRATION_METHODS)."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    check_calibration_method(method)
    calibrate = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile}
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
            activation_type=getattr(QuantType, ACTIVATION_TYPE),
            weight_type=getattr(QuantType, WEIGHT_TYPE),
            calibrate_method=calibrate[method],
        )
    finally:
        root.setLevel(old)
    return Path(out_path)
