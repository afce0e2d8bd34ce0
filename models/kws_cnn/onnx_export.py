"""Export to ONNX: waveform [B, window_samples] in, wake probability [B] out, dynamic
batch, opset 18, one self-contained file. The metadata tells an edge device the sample
rate and window length (and the frontend parameters) so it needs no other file. The
frontend's STFT is exported as a convolution against a DFT basis (`DftLogMelFrontend`),
which onnxruntime runs several times faster than its STFT operator."""

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

import numpy as np
import torch

from wakefl.errors import ConfigError

from .config import ARCHITECTURE
from .frontend import DftLogMelFrontend
from .model import KwsCnn, ProbabilityModel
from .quantize import quantize_int8, synthetic_calibration_windows

OPSET = 18
INPUT_NAME = "wave"
OUTPUT_NAME = "wake_prob"


def onnx_metadata(model: KwsCnn, precision: str) -> dict[str, str]:
    cfg = model.cfg
    return {
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


def _set_metadata(path: Path, meta: dict[str, str]) -> None:
    import onnx

    proto = onnx.load(str(path))
    kept = [p for p in proto.metadata_props if p.key not in meta]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    for k, v in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = k, v
    onnx.save_model(proto, str(path), save_as_external_data=False)


def _export_fp32(model: KwsCnn, out: Path, dft_frontend: bool = True) -> None:
    export_model = copy.deepcopy(model).cpu().float().eval()
    if dft_frontend:
        export_model.frontend = DftLogMelFrontend(export_model.frontend)
    wrapped = ProbabilityModel(export_model).eval()
    example = torch.zeros(2, model.cfg.window_samples)
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
                input_names=[INPUT_NAME],
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
    dft_frontend: bool = True,
) -> Path:
    """Exports `model` to `out_path` (fp32, or static-QDQ int8 with `int8=True`, calibrated
    on `calibration_windows` [N, window_samples] or on synthetic audio when None).
    `dft_frontend=False` keeps onnxruntime's STFT operator (the benchmarks' reference)."""
    out = Path(out_path)
    if out.suffix != ".onnx":
        raise ConfigError(f"ONNX output must end in .onnx, got {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    if not int8:
        _export_fp32(model, out, dft_frontend)
        _set_metadata(out, onnx_metadata(model, "fp32"))
        return out
    if calibration_windows is None:
        calibration_windows = synthetic_calibration_windows(cfg.window_samples, cfg.sample_rate)
    calibration_windows = np.asarray(calibration_windows, dtype=np.float32)
    if calibration_windows.ndim != 2 or calibration_windows.shape[1] != cfg.window_samples:
        raise ConfigError(
            f"calibration windows must be [N, {cfg.window_samples}], got "
            f"{calibration_windows.shape}"
        )
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        fp32 = Path(tmp) / "fp32.onnx"
        _export_fp32(model, fp32, dft_frontend)
        quantize_int8(fp32, out, calibration_windows)
    data = Path(str(out) + ".data")
    if data.exists():  # never ship a second file
        os.remove(data)
    _set_metadata(out, onnx_metadata(model, "int8"))
    return out
