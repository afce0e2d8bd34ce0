"""`wakefl model info|export|pretrain|publish|set-threshold|blend|soup`: inspect, export,
train, ship and blend or average the wake-word CNN (pretrain's flags:
tools/training/pretrain_flags.py)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wakefl.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("model", help="inspect and export the wake-word model")
    sub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    _register_info(sub)
    _register_export(sub)
    from wakefl.tools.training.pretrain_flags import register_pretrain

    register_pretrain(sub, _pretrain)
    _register_publish(sub)
    _register_set_threshold(sub)
    _register_blend(sub)
    _register_soup(sub)


def _register_info(sub: argparse._SubParsersAction) -> None:
    """`wakefl model info`."""
    info = sub.add_parser("info", help="parameter and layer counts of the model")
    src = info.add_mutually_exclusive_group()
    src.add_argument("--width", type=float, default=None, help="width multiplier (default 1.0)")
    src.add_argument("--weights", type=Path, default=None, help="a .safetensors checkpoint")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_info)


def _register_export(sub: argparse._SubParsersAction) -> None:
    """`wakefl model export`."""
    exp = sub.add_parser("export", help="export to ONNX (log-mel in, wake probability out)")
    exp.add_argument("--out", type=Path, required=True, help="output FILE.onnx")
    src = exp.add_mutually_exclusive_group()
    src.add_argument("--weights", type=Path, default=None, help="a .safetensors checkpoint")
    src.add_argument(
        "--pretrained",
        choices=("full", "small"),
        default=None,
        help="export a shipped pretrained model, with its shipped threshold",
    )
    src.add_argument(
        "--random-weights",
        action="store_true",
        help="export an untrained, randomly initialised model (for timing and tests): it "
        "scores every sound near 0.5, so at the fallback threshold 0.5 it fires at random, "
        "on silence too. Without it, --weights or --pretrained is required",
    )
    exp.add_argument(
        "--width",
        type=float,
        default=None,
        help="with --random-weights: the width multiplier (default 1.0)",
    )
    exp.add_argument(
        "--seed", type=int, default=0, help="with --random-weights: the seed (default 0)"
    )
    exp.add_argument("--int8", action="store_true", help="static int8 (QDQ) quantization")
    exp.add_argument(
        "--calibration",
        type=Path,
        nargs="+",
        default=None,
        metavar="WAV",
        help="WAV files whose windows calibrate int8 (default: synthetic audio)",
    )
    exp.add_argument(
        "--frontend",
        choices=("log_mel", "dft", "stft"),
        default="log_mel",
        help="log_mel (default): the graph takes the log-mel spectrogram, which "
        "wakefl.edge_runtime computes; dft or stft: the graph takes the waveform (for other "
        "runtimes), its STFT as a DFT convolution or as the ONNX STFT operator",
    )
    exp.add_argument("--json", action="store_true", help="print JSON")
    exp.set_defaults(func=_export)


def _register_publish(sub: argparse._SubParsersAction) -> None:
    """`wakefl model publish`."""
    pub = sub.add_parser(
        "publish",
        help="ship a pretraining run's best model (fp16) as models/kws_cnn/pretrained/NAME",
    )
    pub.add_argument(
        "--run", type=Path, required=True, help="a `wakefl model pretrain` --out folder"
    )
    pub.add_argument("--name", choices=("full", "small"), required=True)
    pub.add_argument(
        "--corpus",
        type=Path,
        default=None,
        metavar="MANIFEST",
        help="set the shipped threshold on this corpus's validation clips (default: the run's)",
    )
    pub.add_argument(
        "--target-frr",
        type=float,
        default=0.05,
        help="the shipped threshold's false-reject rate on validation clips (default 0.05)",
    )
    pub.add_argument(
        "--checkpoint",
        choices=("best", "last"),
        default="best",
        help="best (by the run's validation criterion, the default) or the last checkpoint",
    )
    pub.set_defaults(func=_publish)


def _register_set_threshold(sub: argparse._SubParsersAction) -> None:
    """`wakefl model set-threshold`."""
    thr = sub.add_parser(
        "set-threshold",
        help="ship a published model at the threshold its validation streams set",
    )
    thr.add_argument(
        "--weights",
        type=Path,
        required=True,
        help="a published model, e.g. models/kws_cnn/pretrained/full.safetensors",
    )
    thr.add_argument(
        "--from",
        dest="bench_json",
        type=Path,
        required=True,
        metavar="JSON",
        help="the --json of `python -m wakefl.tools.bench.detection --split val "
        "--extra-streams <pretrain-valstreams build>` on these very weights: its one "
        "threshold for all device types at 0.5 FA/h becomes the shipped one",
    )
    thr.add_argument(
        "--fa-per-hour",
        type=float,
        default=0.5,
        metavar="T",
        help="ship the one threshold for all device types at T FA/h instead (the benchmark "
        "run with `--pooled-fa-per-hour T`): a margin where validation streams have "
        "promised fewer false accepts than held-out speakers gave",
    )
    thr.add_argument(
        "--near-rhymes",
        type=Path,
        default=None,
        metavar="JSON",
        help="the --json of `python -m wakefl.tools.probes.near_rhyme_rate` on these very "
        "weights: ship the higher of the two thresholds for the same FA/h",
    )
    thr.set_defaults(func=_set_threshold)


def _register_blend(sub: argparse._SubParsersAction) -> None:
    """`wakefl model blend`."""
    bl = sub.add_parser(
        "blend", help="write the weight blend (1-A)*FIRST + A*SECOND of two models of one config"
    )
    bl.add_argument("--first", type=Path, required=True, metavar="WEIGHTS")
    bl.add_argument("--second", type=Path, required=True, metavar="WEIGHTS")
    bl.add_argument(
        "--alpha", type=float, required=True, metavar="A", help="the second model's share, 0-1"
    )
    _add_mix_output_options(bl, "the blend of two published models")
    bl.set_defaults(func=_blend)


def _register_soup(sub: argparse._SubParsersAction) -> None:
    """`wakefl model soup`."""
    sp = sub.add_parser("soup", help="write the weighted average of several models of one config")
    sp.add_argument("--models", type=Path, nargs="+", required=True, metavar="WEIGHTS")
    sp.add_argument(
        "--shares",
        type=float,
        nargs="+",
        default=None,
        metavar="S",
        help="each model's share, in --models order, summing to 1 (default: equal shares)",
    )
    _add_mix_output_options(sp, "the average of published models")
    sp.set_defaults(func=_soup)


def _add_mix_output_options(parser: argparse.ArgumentParser, what: str) -> None:
    """Where `blend` and `soup` write: an fp32 file, or a shipped model with its card."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="output FILE.safetensors (fp32)")
    where.add_argument(
        "--publish",
        choices=("full", "small"),
        metavar="NAME",
        help=f"ship {what} (fp16, with its card) as models/kws_cnn/pretrained/NAME, its "
        "threshold set on --corpus's validation clips",
    )
    parser.add_argument("--corpus", type=Path, metavar="MANIFEST", help="with --publish")
    parser.add_argument(
        "--dest", type=Path, default=None, help="with --publish: another folder to ship into"
    )


def _build(args: argparse.Namespace):
    import torch

    from wakefl.models.kws_cnn import KwsCnn, ModelConfig, load_model

    torch.set_num_threads(1)
    if getattr(args, "pretrained", None) is not None:
        from wakefl.models.kws_cnn.pretrained import load_pretrained

        return load_pretrained(args.pretrained)
    if args.weights is not None:
        return load_model(args.weights)
    torch.manual_seed(getattr(args, "seed", 0))
    return KwsCnn(ModelConfig(width=1.0 if args.width is None else args.width)).eval()


def _info(args: argparse.Namespace) -> int:
    from wakefl.models.kws_cnn.model import model_summary

    summary = model_summary(_build(args))
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:>18}: {v}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from wakefl.models.kws_cnn import export_onnx, operating_point
    from wakefl.operating_point import THRESHOLD_KEY

    if args.out.suffix != ".onnx":
        raise ConfigError(f"--out must end in .onnx, got {args.out}")
    if args.calibration and not args.int8:
        raise ConfigError("--calibration only applies with --int8")
    _check_export_source(args)
    model = _build(args)
    calib = _int8_calibration(args.calibration, model) if args.int8 else None
    point = operating_point.for_export(model, args.pretrained, args.weights)
    out = export_onnx(
        model,
        args.out,
        int8=args.int8,
        calibration_windows=calib,
        frontend=args.frontend,
        operating_point=point,
    )
    sidecar = out.with_suffix(".json")
    if point is not None:
        # Beside the ONNX file too, where `wakefl eval --at-shipped-threshold` looks first.
        extra = {"pretrained": args.pretrained} if args.pretrained else {}
        sidecar.write_text(
            json.dumps({**point.sidecar(), **extra}, indent=2) + "\n", encoding="utf-8"
        )
    elif sidecar.is_file() and THRESHOLD_KEY in sidecar.read_text(encoding="utf-8"):
        sidecar.unlink()  # a previous export's threshold must not pass for this model's
    result = {
        "out": str(out),
        "precision": "int8" if args.int8 else "fp32",
        "bytes": out.stat().st_size,
        "trainable_params": model.num_trainable_params(),
        "width": model.cfg.width,
        "window_samples": model.cfg.window_samples,
        "sample_rate": model.cfg.sample_rate,
        "shipped_threshold": None if point is None else point.threshold,
        "threshold_source": None if point is None else point.source,
    }
    if args.int8:
        result["int8_agreement"] = _int8_agreement(model, out, point)
    if args.json:
        print(json.dumps(result))
    else:
        _print_export(result, args.random_weights, sidecar)
    return 0


def _int8_calibration(files: list[Path] | None, model: Any) -> Any:
    """The windows int8 is calibrated on: the given recordings, else the shipped
    calibration set's calibration windows (several engines and voices through device types
    A-E); says which on stderr."""
    from wakefl.edge_runtime import load_audio
    from wakefl.models.kws_cnn.quantize import bundled_calibration, calibration_windows

    if files:
        waves = [load_audio(p, model.cfg.sample_rate) for p in files]
        windows = calibration_windows(waves, model.cfg.window_samples)
        said = f"{len(windows)} windows of the {len(files)} given recording(s)"
    else:
        windows, said = bundled_calibration("calibration")
        said += "; --calibration WAV... calibrates on your own recordings"
    if windows.shape[1] != model.cfg.window_samples:
        raise ConfigError(
            f"the calibration windows hold {windows.shape[1]} samples, the model's "
            f"{model.cfg.window_samples}: give --calibration WAV..."
        )
    print(f"int8: calibrating on {said}", file=sys.stderr)
    return windows


def _int8_agreement(model: Any, int8_path: Path, point: Any) -> dict[str, Any]:
    """The int8 model's decisions against the fp32 model's at the model's threshold (0.5
    without one), on the shipped calibration set's held-out windows played as a stream at
    the detector's 0.1 s hop: voices calibration never heard, at every offset a device
    scores. Warns on stderr below AGREEMENT_FLOOR."""
    import torch

    from wakefl.edge_runtime import OnnxScorer
    from wakefl.edge_runtime.detection_rule import hop_samples
    from wakefl.models.kws_cnn.quantize import AGREEMENT_FLOOR, bundled_stream, decision_agreement

    cfg = model.cfg
    hop = hop_samples(0.1, cfg.sample_rate)
    windows, said = bundled_stream("held_out", cfg.window_samples, hop)
    with torch.no_grad():
        fp32 = model.predict_proba(torch.from_numpy(windows)).numpy()
    int8 = OnnxScorer(int8_path).score(windows)
    threshold = 0.5 if point is None else point.threshold
    check = {**decision_agreement(fp32, int8, threshold), "held_out": said}
    if check["below_floor"]:
        print(
            f"warning: int8 decides as fp32 on only {check['share']:.1%} of the held-out "
            f"windows (below {AGREEMENT_FLOOR:.0%}): calibrate on recordings of the device "
            "(--calibration WAV...), or ship the fp32 model",
            file=sys.stderr,
        )
    return check


def _print_export(result: dict[str, Any], untrained: bool, sidecar: Path) -> None:
    """What `model export` wrote, in words."""
    print(f"wrote {result['out']} ({result['precision']}, {result['bytes'] / 1e6:.2f} MB)")
    check = result.get("int8_agreement")
    if check:
        print(
            f"  int8 decides as fp32 on {check['agree']} of {check['windows']} held-out "
            f"windows ({check['share']:.1%}) at threshold {check['threshold']:.4f}, largest "
            f"score gap {check['max_score_gap']:.3f} ({check['held_out']}, as a stream)"
        )
        for flip in check["flipped"]:
            print(f"    window {flip['window']}: fp32 {flip['fp32']:.4f}, int8 {flip['int8']:.4f}")
    if untrained:
        print("  untrained: it scores every sound near 0.5 and fires at random, on silence too")
    if result["shipped_threshold"] is None:
        print("  no shipped threshold: `wakefl edge detect` runs it at 0.5 unless told")
    else:
        print(
            f"  shipped threshold {result['shipped_threshold']:.4f} "
            f"({result['threshold_source']}), also in {sidecar}"
        )


def _check_export_source(args: argparse.Namespace) -> None:
    """An untrained model fires at random: it is exported only when asked by name."""
    if args.random_weights:
        return
    if args.width is not None:
        raise ConfigError("--width only applies with --random-weights")
    if args.weights is None and args.pretrained is None:
        raise ConfigError(
            "give --pretrained NAME or --weights FILE.safetensors; --random-weights "
            "[--width W] exports an untrained model, which fires at random"
        )


def _pretrain(args: argparse.Namespace) -> int:
    from wakefl.tools.training.data import default_corpus
    from wakefl.tools.training.pretrain import pretrain
    from wakefl.tools.training.settings import settings_from_flags

    settings = settings_from_flags(args)
    manifest = args.corpus
    if manifest is None:
        manifest = default_corpus(args.phrase, args.seed, progress=not args.quiet)
    info = pretrain(
        manifest,
        args.out,
        settings,
        resume=args.resume,
        init_from=args.init_from,
        max_minutes=args.max_minutes,
        progress=not args.quiet,
        extra=args.extra_corpus,
        start_step=args.start_step,
    )
    best = info.get("best") or {}
    print(
        json.dumps(
            {
                "out": str(args.out),
                "step": info["step"],
                "seconds": round(info["seconds"], 1),
                "best": best,
            }
        )
    )
    return 0


def _publish(args: argparse.Namespace) -> int:
    from wakefl.tools.training.publish import publish

    if not 0.0 < args.target_frr < 1.0:
        raise ConfigError("--target-frr must be in (0, 1)")
    out = publish(
        args.run,
        args.name,
        manifest=args.corpus,
        target_frr=args.target_frr,
        checkpoint=args.checkpoint,
    )
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB) with its config and card")
    return 0


def _set_threshold(args: argparse.Namespace) -> int:
    from wakefl.tools.training.publish import set_stream_threshold

    card = set_stream_threshold(args.weights, args.bench_json, args.fa_per_hour, args.near_rhymes)
    point = card["stream_operating_point"]
    print(
        f"{args.weights}: shipped threshold {card['threshold']:.6f} (was {card['clip_threshold']:.6f})\n"
        f"  validation streams: {point['threshold']:.6f} gives {point['fa_per_hour']:.2f} FA/h "
        f"over {point['stream_hours']} h"
    )
    rhymes = card.get("near_rhyme_operating_point")
    if rhymes is not None:
        print(
            f"  near-rhyme streams: {rhymes['threshold']:.6f} projects "
            f"{rhymes['projected_fa_per_hour']:.2f} FA/h ({rhymes['pairs']} speaker-near-rhyme pairs)"
        )
    return 0


def _blend(args: argparse.Namespace) -> int:
    from wakefl.models.kws_cnn import load_model
    from wakefl.models.kws_cnn.blend import blend

    def ship() -> Path:
        from wakefl.tools.training.publish import publish_blend

        return publish_blend(
            args.first, args.second, args.alpha, args.publish, args.corpus, dest=args.dest
        )

    return _write_mix(
        args,
        lambda: blend(load_model(args.first), load_model(args.second), args.alpha),
        ship,
        f"alpha {args.alpha}",
    )


def _soup(args: argparse.Namespace) -> int:
    from wakefl.models.kws_cnn import load_model
    from wakefl.models.kws_cnn.blend import average

    shares = args.shares or [1.0 / len(args.models)] * len(args.models)

    def ship() -> Path:
        from wakefl.tools.training.publish import publish_soup

        return publish_soup(args.models, shares, args.publish, args.corpus, dest=args.dest)

    return _write_mix(
        args,
        lambda: average([load_model(w) for w in args.models], shares),
        ship,
        f"shares {shares}",
    )


def _write_mix(
    args: argparse.Namespace, mix: Callable[[], Any], ship: Callable[[], Path], what: str
) -> int:
    """`blend`'s and `soup`'s output: `ship()` a published model (with --publish, which
    needs --corpus), or save `mix()` to --out in fp32."""
    from wakefl.models.kws_cnn import save_model

    if args.publish is not None:
        if args.corpus is None:
            raise ConfigError("--publish needs --corpus MANIFEST to set the shipped threshold on")
        print(f"shipped {ship()} ({what}) with its config and card")
        return 0
    if args.out.suffix != ".safetensors":
        raise ConfigError(f"--out must name a .safetensors file, got {args.out}")
    print(f"wrote {save_model(mix(), args.out)} ({what}) with its config")
    return 0
