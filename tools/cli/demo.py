"""`wakefl demo`: a small Self-FL federation end to end, ending in a relative FA/FR report."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo", help="a small federation end to end, with a report", description=__doc__
    )
    p.add_argument(
        "--profile",
        choices=["fleet", "fleet-enrolled", "demo", "tiny", "small"],
        default="fleet",
        help="corpus profile (default fleet: per device type 12 users of its own, speaking "
        "with voices no shipped model trained on, in rooms and devices of the held-out "
        "acoustic simulation, 144 test clips and 6 minutes of streams per device type, and "
        "3 users kept out of training; fleet-enrolled: the same users and test sets, with "
        "four times the training clips; demo: the training engines' voices, 240 test clips; "
        "tiny: 24 test clips)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="Self-FL rounds (default 4 on the fleet profile, 3 on the others)",
    )
    p.add_argument(
        "--width",
        type=float,
        default=None,
        help="model width (default: 0.25, the shipped small model, on the fleet profile; "
        "1.0, the shipped full model, on the others)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--baseline",
        default=None,
        help="warm start: 'pretrained' (default: the shipped model of --width), "
        "'pretrained:small|full', 'scratch' (train on the corpus) or a checkpoint",
    )
    p.add_argument(
        "--warm-epochs",
        type=int,
        default=30,
        help="baseline training epochs with --baseline scratch",
    )
    p.add_argument(
        "--target-fr",
        type=float,
        default=0.1,
        help="FR target of the baseline's operating point where it has no shipped threshold "
        "or the profile is not the fleet, and of each device's served-model gate off the "
        "fleet (default 0.1)",
    )
    p.add_argument(
        "--gate-target-fr",
        type=float,
        default=None,
        help="FR target of each device's served-model gate (default: 0.5 on the fleet, "
        "where the shipped baseline misses about half of its users' wake words, else "
        "--target-fr)",
    )
    _add_run_options(p)
    p.set_defaults(func=_run)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """Where the run goes, the broker and the corpus."""
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path("runs/demo"),
        help="where the run's state, models and report go (default runs/demo)",
    )
    p.add_argument(
        "--broker",
        default=None,
        help="mqtt[s]://[user:pass@]host:port of an external broker "
        "(default: an embedded mosquitto on 127.0.0.1)",
    )
    p.add_argument(
        "--manifest",
        type=Path,
        default=None,
        help="use this corpus manifest instead of the synthetic one",
    )
    p.add_argument(
        "--val-streams",
        type=Path,
        default=None,
        metavar="MANIFEST",
        help="a streams add-on whose validation streams every device adds to its served-model "
        "gate's evidence (`wakefl device --val-streams`), e.g. `wakefl corpus build --profile "
        "fleet-valstreams --seed S`",
    )
    p.add_argument(
        "--no-val-streams",
        action="store_true",
        help="on the fleet profiles, judge the served-model gate on the corpus's own validation "
        "clips and 4 minutes of stream per device type only (default: add the fleet-valstreams "
        "add-on of --seed, 16 minutes more, built once and cached)",
    )
    p.add_argument("--round-timeout", type=float, default=300.0)


def _run(args: argparse.Namespace) -> int:
    from wakefl.errors import ConfigError
    from wakefl.tools.fleet.demo import DemoSettings, run_demo

    if args.rounds is not None and args.rounds < 1:
        raise ConfigError("--rounds must be at least 1")
    if args.val_streams is not None and args.no_val_streams:
        raise ConfigError("--val-streams and --no-val-streams contradict each other")
    if args.val_streams is not None:
        if not args.val_streams.is_file():
            raise ConfigError(f"--val-streams {args.val_streams}: no such manifest")
        args.val_streams = args.val_streams.resolve()  # the devices run in other folders
    run_demo(
        DemoSettings(
            profile=args.profile,
            rounds=args.rounds,
            width=args.width,
            seed=args.seed,
            warm_epochs=args.warm_epochs,
            baseline=args.baseline,
            workdir=args.workdir,
            broker=args.broker,
            manifest=args.manifest,
            round_timeout=args.round_timeout,
            target_fr=args.target_fr,
            gate_target_fr=args.gate_target_fr,
            val_streams=args.val_streams,
            val_streams_addon=not args.no_val_streams,
        )
    )
    return 0
