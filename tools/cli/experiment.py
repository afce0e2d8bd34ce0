"""`wakefl experiment paper`: the Self-FL paper's wake-word study on the synthetic corpus."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    exp = subparsers.add_parser("experiment", help="the paper's wake-word study")
    sub = exp.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    p = sub.add_parser(
        "paper",
        help="Self-FL vs FedAvg, DITTO, Per-FedAvg, pFedMe, pFedVEM and local fine-tuning",
        description=(
            "Runs the Self-FL paper's wake-word study (Tables 2a/2b, 5, 6, Figures 11-12) on "
            "the synthetic corpus of the chosen profile; writes results.json, results.md, "
            "step-count plots and DET curves into --out."
        ),
    )
    p.add_argument(
        "--profile",
        choices=("tiny", "small", "full"),
        default="tiny",
        help="tiny: a few minutes on CPU; small: under 45 min on 2 cores; "
        "full: paper-scale width, for a GPU machine",
    )
    p.add_argument("--out", required=True, help="output folder (the corpus is built in OUT/corpus)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the result JSON on stdout (progress goes to stderr)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of corpus, training and sampling")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="full-participation rounds (client sampling keeps the profile's ratio)",
    )
    p.add_argument("--width", type=float, default=None, help="model width (overrides the profile)")
    p.add_argument(
        "--manifest",
        default=None,
        help="use this corpus manifest instead of building the profile's corpus",
    )
    p.add_argument("--cache-dir", default=None, help="warm-start checkpoint cache")
    p.add_argument(
        "--baseline",
        default=None,
        help="warm start of every method: 'pretrained' (default: the shipped model of "
        "the width), 'pretrained:small|full', 'scratch' or a checkpoint",
    )
    p.add_argument(
        "--methods", default=None, help="comma-separated subset of the methods (default: all)"
    )
    _add_sampling(p)
    _add_operating_point(p)
    p.add_argument(
        "--selffl-ablations",
        default=None,
        help="comma-separated Self-FL ablation rows (the paper's rules back: paper-rules, "
        "paper-eqn10, paper-rate, no-early-variance, no-data-cap, or 'all'), each in "
        "settings of its own",
    )
    p.set_defaults(func=_paper)
    exp.set_defaults(func=lambda _args: (exp.print_help(), 2)[1])


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-sampling", action="store_true", help="skip the client-sampling settings")
    p.add_argument(
        "--sampling-methods",
        default=None,
        help="comma-separated other methods that also run under client sampling, beside "
        "Self-FL's two levels, each at its own selected learning rate ('none': Self-FL "
        "alone; default: every other method of the study)",
    )


def _add_operating_point(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target-fr",
        type=float,
        default=None,
        help="operating point: the baseline's FR on each device type's test clips (default "
        "the profile's, 0.05 for small and full). On the fleet of hard users, where the "
        "shipped model misses about half of the wake words, 0.5 puts the comparison where "
        "a device works and resolves the relative FR at matched false accepts",
    )


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run, for the report: run from the folder above
    `--out`, with the other paths relative to it (a result names no machine's folders)."""
    from pathlib import Path

    from wakefl.recorded_paths import recorded_path

    parts = [
        "wakefl",
        "experiment",
        "paper",
        "--profile",
        args.profile,
        "--out",
        Path(args.out).name,
        "--seed",
        str(args.seed),
    ]
    for flag, value in (
        ("--rounds", args.rounds),
        ("--width", args.width),
        ("--manifest", args.manifest and recorded_path(args.manifest, Path(args.out).parent)),
        ("--methods", args.methods),
        ("--baseline", args.baseline),
        ("--selffl-ablations", args.selffl_ablations),
        ("--target-fr", args.target_fr),
        ("--sampling-methods", args.sampling_methods),
    ):
        if value is not None:
            parts += [flag, str(value)]
    if args.no_sampling:
        parts.append("--no-sampling")
    if args.json:
        parts.append("--json")
    return " ".join(shlex.quote(p) for p in parts)


def _paper(args: argparse.Namespace) -> int:
    from wakefl.tools.studies.paper_experiment import run_paper_study
    from wakefl.tools.studies.paper_rules import ACTIVITY_RATES, METHODS, SELFFL_ABLATIONS

    methods = (
        METHODS
        if args.methods is None
        else tuple(m.strip() for m in args.methods.split(",") if m.strip())
    )
    names = [a.strip() for a in (args.selffl_ablations or "").split(",") if a.strip()]
    sampling_methods = _sampling_methods(args.sampling_methods)
    ablations = tuple(SELFFL_ABLATIONS) if names == ["all"] else tuple(names)
    # With --json, stdout carries only the JSON document.
    stream = sys.stderr if args.json else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=stream, flush=True)

    with contextlib.redirect_stdout(stream):
        result = run_paper_study(
            args.out,
            profile=args.profile,
            seed=args.seed,
            rounds=args.rounds,
            width=args.width,
            manifest=args.manifest,
            cache_dir=args.cache_dir,
            methods=methods,
            sampling_rates=() if args.no_sampling else ACTIVITY_RATES,
            progress=True,
            log=log,
            command=command_line(args),
            baseline=args.baseline,
            selffl_ablations=ablations,
            target_fr=args.target_fr,
            sampling_methods=sampling_methods,
        )
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True))
    else:
        log(f"[study] wrote {args.out}/results.md and {args.out}/results.json")
    return 0


def _sampling_methods(arg: str | None) -> tuple[str, ...] | None:
    """--sampling-methods: None (every other method), () for 'none', else the names."""
    if arg is None:
        return None
    names = tuple(m.strip() for m in arg.split(",") if m.strip())
    return () if names == ("none",) else names
