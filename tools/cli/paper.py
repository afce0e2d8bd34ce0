"""`wakefl paper synthetic`: the Self-FL paper's synthetic Gaussian study."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from wakefl.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("paper", help="the Self-FL paper's synthetic Gaussian study")
    sub = p.add_subparsers(dest="paper_command", metavar="STUDY", required=True)
    s = sub.add_parser("synthetic", help="two-level Gaussian model, errors vs the closed forms")
    s.add_argument("--reps", type=int, default=3, help="repetitions (fleets) per case (default 3)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--rounds", type=int, default=30, help="federation rounds (default 30)")
    s.add_argument(
        "--methods",
        default=None,
        help="comma-separated strategy names (default: all in the registry)",
    )
    s.add_argument(
        "--out",
        type=Path,
        default=Path("results/paper_synthetic"),
        help="folder for the PNG plots and study.json",
    )
    s.add_argument("--json", action="store_true", help="print the result document as JSON")
    s.set_defaults(func=_synthetic)


def _synthetic(args: argparse.Namespace) -> int:
    import torch

    from wakefl.sdk.selffl.registry import available_strategies
    from wakefl.tools.studies.synthetic_study import best_by, run_study, write_plots

    torch.set_num_threads(1)
    if args.reps < 1 or args.rounds < 1:
        raise ConfigError("--reps and --rounds must be >= 1")
    methods = None
    if args.methods:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = sorted(set(methods) - set(available_strategies()))
        if unknown:
            raise ConfigError(f"unknown methods {unknown}; available: {available_strategies()}")
    doc = run_study(
        reps=args.reps,
        seed=args.seed,
        rounds=args.rounds,
        methods=methods,
        progress=sys.stderr.isatty(),
    )
    doc["best_global"] = best_by(doc, "global_mae")
    doc["best_local"] = best_by(doc, "local_mae")
    doc["plots"] = write_plots(doc, args.out)
    (args.out / "study.json").write_text(json.dumps(doc, indent=2))
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"{'case':<14}{'C':>5}  {'method':<12}{'global MAE':>12}{'local MAE':>12}")
        for r in doc["results"]:
            print(
                f"{r['case']:<14}{r['activity_rate']:>5}  {r['method']:<12}"
                f"{_fmt(r['global_mae']):>12}{_fmt(r['local_mae']):>12}"
            )
        print(f"plots: {', '.join(doc['plots'])}")
    return 0


def _fmt(x: float | None) -> str:
    return "diverged" if x is None else f"{x:.3e}"
