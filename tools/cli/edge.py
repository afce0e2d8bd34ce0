"""`wakefl edge detect`: wake-word detection on a WAV file with onnxruntime only (no torch),
as a detect-only device would run it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from wakefl.edge_runtime.gate_rule import DEFAULT_GATE_THRESHOLD


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("edge", help="streaming wake-word detection with onnxruntime")
    sub = p.add_subparsers(dest="edge_command", metavar="ACTION", required=True)
    d = sub.add_parser("detect", help="detect the wake word in a WAV file")
    d.add_argument("audio", type=Path, help="WAV file (resampled and mixed down as needed)")
    d.add_argument("--model", type=Path, required=True, help="exported FILE.onnx")
    d.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="on the smoothed posterior (default: the model's shipped threshold, from its "
        "ONNX metadata; 0.5 only for a model that carries none). The output says which",
    )
    d.add_argument(
        "--hop", type=float, default=0.1, help="seconds between scored windows (default 0.1)"
    )
    d.add_argument(
        "--smoothing",
        type=int,
        default=3,
        help="posteriors in the moving average (default 3)",
    )
    d.add_argument(
        "--refractory",
        type=float,
        default=1.0,
        help="seconds after a detection during which no other fires (default 1.0)",
    )
    d.add_argument(
        "--gate",
        type=Path,
        default=None,
        metavar="FILE.onnx",
        help="a cheaper model (e.g. `small`'s export) that scores every window: --model then "
        "scores only the windows near where it reached --gate-threshold, and fires only "
        "there (the two-stage detector: a fraction of --model's cost)",
    )
    d.add_argument(
        "--gate-threshold",
        type=float,
        default=DEFAULT_GATE_THRESHOLD,
        help=f"the gate's posterior that opens it (default {DEFAULT_GATE_THRESHOLD})",
    )
    d.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    d.add_argument(
        "--posteriors", action="store_true", help="include every window's posterior in the JSON"
    )
    d.add_argument("--json", action="store_true", help="print JSON")
    d.set_defaults(func=_detect)


def _detect(args: argparse.Namespace) -> int:
    from wakefl.edge_runtime import Gate, OnnxScorer, detect_file

    scorer = OnnxScorer(args.model, threads=args.threads)
    gate = None
    if args.gate is not None:
        gate = Gate(OnnxScorer(args.gate, threads=args.threads), args.gate_threshold)
    res = detect_file(
        scorer,
        args.audio,
        hop_s=args.hop,
        threshold=args.threshold,
        smoothing=args.smoothing,
        refractory_s=args.refractory,
        gate=gate,
    )
    out = {
        "audio": str(args.audio),
        "model": str(args.model),
        "duration_s": round(res.duration_s, 4),
        "windows": int(len(res.times_s)),
        "max_score": float(res.scores.max()) if len(res.scores) else None,
        "threshold": res.extra["threshold"],
        "threshold_source": res.extra["threshold_source"],
        "hop_s": args.hop,
        "events": [{"time_s": round(e.time_s, 4), "score": e.score} for e in res.events],
    }
    if gate is not None:
        out["gate"] = {
            "model": str(args.gate),
            "threshold": gate.threshold,
            "main_windows": res.extra["main_windows"],
        }
    if args.posteriors:
        out["posteriors"] = [
            {"time_s": round(float(t), 4), "raw": float(r), "score": float(s)}
            for t, r, s in zip(res.times_s, res.raw_scores, res.scores, strict=True)
        ]
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"{args.audio}: {out['duration_s']} s, {out['windows']} windows, "
            f"{len(out['events'])} detection(s) at threshold {out['threshold']:.4f} "
            f"({out['threshold_source']})"
        )
        if gate is not None:
            print(
                f"  gate {args.gate}: --model scored {res.extra['main_windows']} of {out['windows']} windows"
            )
        for e in out["events"]:
            print(f"  {e['time_s']:9.2f} s  score {e['score']:.3f}")
    return 0
