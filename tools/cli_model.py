"""`wakefl model info|export`: inspect the wake-word CNN and export it to ONNX."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from wakefl.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("model", help="inspect and export the wake-word model")
    sub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    info = sub.add_parser("info", help="parameter and layer counts of the model")
    src = info.add_mutually_exclusive_group()
    src.add_argument("--width", type=float, default=None, help="width multiplier (default 1.0)")
    src.add_argument("--weights", type=Path, default=None, help="a .safetensors checkpoint")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_info)

    exp = sub.add_parser("export", help="export to ONNX (waveform in, wake probability out)")
    exp.add_argument("--out", type=Path, required=True, help="output FILE.onnx")
    src = exp.add_mutually_exclusive_group()
    src.add_argument("--weights", type=Path, default=None, help="a .safetensors checkpoint")
    src.add_argument("--width", type=float, default=None,
                     help="export a freshly initialised model of this width (default 1.0)")
    exp.add_argument("--seed", type=int, default=0, help="initialisation seed without --weights")
    exp.add_argument("--int8", action="store_true", help="static int8 (QDQ) quantization")
    exp.add_argument("--calibration", type=Path, nargs="+", default=None, metavar="WAV",
                     help="WAV files whose windows calibrate int8 (default: synthetic audio)")
    exp.add_argument("--json", action="store_true", help="print JSON")
    exp.set_defaults(func=_export)


def _build(args: argparse.Namespace):
    import torch

    from wakefl.models.kws_cnn import KwsCnn, ModelConfig, load_model

    torch.set_num_threads(1)
    if args.weights is not None:
        return load_model(args.weights)
    torch.manual_seed(getattr(args, "seed", 0))
    return KwsCnn(ModelConfig(width=1.0 if args.width is None else args.width)).eval()


def model_summary(model) -> dict:
    from wakefl.models.kws_cnn import head_slice

    cfg = model.cfg
    hs = head_slice(model)
    return {
        "architecture": "kws_cnn",
        "trainable_params": model.num_trainable_params(),
        **model.layer_counts(),
        "conv_pool_layers": sum(model.layer_counts().values()),
        "head_params": hs.stop - hs.start,
        "width": cfg.width,
        "sample_rate": cfg.sample_rate,
        "window_s": cfg.window_s,
        "window_samples": cfg.window_samples,
        "n_mels": cfg.n_mels,
        "n_frames": cfg.n_frames,
        "win_ms": cfg.win_ms,
        "hop_ms": cfg.hop_ms,
        "version": cfg.version,
    }


def _info(args: argparse.Namespace) -> int:
    summary = model_summary(_build(args))
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:>18}: {v}")
    return 0


def _calibration_windows(paths: list[Path], window: int, sample_rate: int):
    import numpy as np

    from wakefl.edge_runtime import load_audio

    wins = []
    for p in paths:
        x = load_audio(p, sample_rate)
        if x.size < window:
            x = np.concatenate([np.zeros(window - x.size, np.float32), x])
        step = max(window // 2, 1)
        wins += [x[i:i + window] for i in range(0, x.size - window + 1, step)]
    if not wins:
        raise ConfigError("no calibration windows in the given files")
    return np.stack(wins[:256])


def _export(args: argparse.Namespace) -> int:
    from wakefl.models.kws_cnn import export_onnx

    if args.out.suffix != ".onnx":
        raise ConfigError(f"--out must end in .onnx, got {args.out}")
    if args.calibration and not args.int8:
        raise ConfigError("--calibration only applies with --int8")
    model = _build(args)
    calib = None
    if args.calibration:
        calib = _calibration_windows(args.calibration, model.cfg.window_samples,
                                     model.cfg.sample_rate)
    out = export_onnx(model, args.out, int8=args.int8, calibration_windows=calib)
    result = {"out": str(out), "precision": "int8" if args.int8 else "fp32",
              "bytes": out.stat().st_size, "trainable_params": model.num_trainable_params(),
              "width": model.cfg.width, "window_samples": model.cfg.window_samples,
              "sample_rate": model.cfg.sample_rate}
    print(json.dumps(result) if args.json else
          f"wrote {out} ({result['precision']}, {result['bytes'] / 1e6:.2f} MB)")
    return 0
