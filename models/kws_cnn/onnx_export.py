"""Export to ONNX: log-mel spectrogram [B, n_mels, frames] in (or, on request, the
waveform [B, window_samples]), wake probability [B] out, dynamic batch, opset 18, one
self-contained file. The metadata tells an edge device the sample rate, window length and
frontend settings, so `wakefl.edge_runtime` needs no other file to turn audio into the
model's input (edge_runtime/log_mel.py). Why log-mel in: onnxruntime's STFT operator
took half of a window's time, and a stream's overlapping windows share most of their
frames, which a device computes once."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wakefl.errors import ConfigError

from .config import ARCHITECTURE
from .frontend import LOG_FLOOR, DftLogMelFrontend
from .model import KwsCnn, LogMelProbabilityModel, ProbabilityModel
from .operating_point import METADATA_KEYS, OperatingPoint
from .quantize import check_calibration_method, quantize_int8, synthetic_calibration_windows

OPSET = 18
INPUT_NAME = "wave"
LOG_MEL_INPUT = "log_mel"
FRONTENDS = ("log_mel", "dft", "stft")
OUTPUT_NAME = "wake_prob"


def onnx_metadata(model: KwsCnn, precision: str, frontend: str = "log_mel") -> dict[str, str]:
    cfg = model.cfg
    f_max = cfg.f_max if cfg.f_max is not None else cfg.sample_rate / 2.0
    return {
        # "log_mel": the graph takes [B, n_mels, frames] (edge_runtime.log_mel computes
        # it from these settings); "wave": [B, window_samples].
        "input": "log_mel" if frontend == "log_mel" else "wave",
        "f_min": repr(float(cfg.f_min)),
        "f_max": repr(float(f_max)),
        "log_floor": repr(LOG_FLOOR),
        "frames": str(cfg.n_frames),
        "architecture": ARCHITECTURE,
        "model_version": str(cfg.version),
        "precision": precision,
        "sample_rate": str(cfg.sample_rate),
        "window_samples": str(cfg.window_samples),
        "n_mels": str(cfg.n_mels),
        "n_fft": str(cfg.n_fft),
        "win_length": str(cfg.win_length),
        "hop_length": str(cfg.hop_length),
        "model_config": json.dumps(cfg.to_dict()),
    }


# Node metadata the exporter writes that holds the exporting machine's file paths (Python
# stack traces): nothing a runtime reads, and a shipped file should not reveal them.
_PATH_KEYS = ("pkg.torch.onnx.stack_trace",)


def strip_node_paths(proto: Any) -> int:
    """Removes the node metadata entries of `_PATH_KEYS` from every node of the model's
    graph and functions; returns how many it removed."""
    removed = 0
    nodes = list(proto.graph.node) + [n for f in proto.functions for n in f.node]
    for node in nodes:
        kept = [p for p in node.metadata_props if p.key not in _PATH_KEYS]
        removed += len(node.metadata_props) - len(kept)
        del node.metadata_props[:]
        node.metadata_props.extend(kept)
    return removed


def _set_metadata(path: Path, meta: dict[str, str]) -> None:
    import onnx

    proto = onnx.load(str(path))
    strip_node_paths(proto)
    # Keys of an operating point are written only from `meta`: never a stale one.
    kept = [p for p in proto.metadata_props if p.key not in meta and p.key not in METADATA_KEYS]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    for k, v in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = k, v
    onnx.save_model(proto, str(path), save_as_external_data=False)


def _export_fp32(model: KwsCnn, out: Path, frontend: str) -> None:
    export_model = copy.deepcopy(model).cpu().float().eval()
    cfg = model.cfg
    wrapped: torch.nn.Module
    if frontend == "log_mel":
        wrapped = LogMelProbabilityModel(export_model).eval()
        example, input_name = torch.zeros(2, cfg.n_mels, cfg.n_frames), LOG_MEL_INPUT
    else:
        if frontend == "dft":
            # The same function, another module type: the attribute is typed for the first.
            export_model.frontend = DftLogMelFrontend(export_model.frontend)  # type: ignore[assignment]
        wrapped = ProbabilityModel(export_model).eval()
        example, input_name = torch.zeros(2, cfg.window_samples), INPUT_NAME
    batch = torch.export.Dim("batch", min=1, max=4096)
    # The exporter prints progress and warns about optional torchvision ops; neither is
    # actionable for this model.
    quiet = io.StringIO()
    exporter_log = logging.getLogger("torch.onnx")
    old = exporter_log.level
    exporter_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(quiet):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                wrapped,
                (example,),
                dynamo=True,
                opset_version=OPSET,
                input_names=[input_name],
                output_names=[OUTPUT_NAME],
                dynamic_shapes=({0: batch},),
                external_data=False,
                verbose=False,
            )
            if program is None:
                raise RuntimeError("torch.onnx.export returned no program")
            program.save(str(out), external_data=False)
    finally:
        exporter_log.setLevel(old)


def export_onnx(
    model: KwsCnn,
    out_path: Path | str,
    int8: bool = False,
    calibration_windows: np.ndarray | None = None,
    frontend: str = "log_mel",
    operating_point: OperatingPoint | None = None,
    calibration_method: str = "minmax",
) -> Path:
    """Exports `model` to `out_path` (fp32, or static-QDQ int8 with `int8=True`, calibrated
    on `calibration_windows` [N, window_samples] or on synthetic audio when None, by
    `calibration_method`: quantize.CALIBRATION_METHODS).
    `operating_point` (the shipped threshold and its detector settings) goes into the
    metadata, where the edge runtime takes its default threshold from.

    `frontend` says where the log-mel spectrogram is computed: "log_mel" (the default)
    exports the model after its frontend, log-mel in, and the edge runtime computes the
    log-mel in numpy, reusing a stream's frames across overlapping windows; "dft" and
    "stft" export waveform-in graphs, the STFT as a DFT convolution or as onnxruntime's
    STFT operator (a benchmark reference)."""
    out = Path(out_path)
    if out.suffix != ".onnx":
        raise ConfigError(f"ONNX output must end in .onnx, got {out}")
    if frontend not in FRONTENDS:
        raise ConfigError(f"frontend must be one of {', '.join(FRONTENDS)}, got {frontend!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    extra = operating_point.metadata() if operating_point is not None else {}
    if not int8:
        _export_fp32(model, out, frontend)
        _set_metadata(out, {**onnx_metadata(model, "fp32", frontend), **extra})
        return out
    check_calibration_method(calibration_method)  # before the fp32 export, not after
    if calibration_windows is None:
        calibration_windows = synthetic_calibration_windows(cfg.window_samples, cfg.sample_rate)
    calibration_windows = np.asarray(calibration_windows, dtype=np.float32)
    if calibration_windows.ndim != 2 or calibration_windows.shape[1] != cfg.window_samples:
        raise ConfigError(
            f"calibration windows must be [N, {cfg.window_samples}], got "
            f"{calibration_windows.shape}"
        )
    calibration = calibration_windows
    if frontend == "log_mel":
        with torch.no_grad():
            # A copy: the caller's model stays on its device and dtype.
            log_mel = copy.deepcopy(model.frontend).cpu().float()
            calibration = log_mel(torch.from_numpy(calibration)).numpy()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        fp32 = Path(tmp) / "fp32.onnx"
        _export_fp32(model, fp32, frontend)
        quantize_int8(fp32, out, calibration, calibration_method)
    data = Path(str(out) + ".data")
    if data.exists():  # never ship a second file
        os.remove(data)
    _set_metadata(out, {**onnx_metadata(model, "int8", frontend), **extra})
    return out
