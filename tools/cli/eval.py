"""`wakefl eval`: relative FA at matched FR of candidate models against a baseline, per
device type and device state, with FA per hour on the negative streams, DET curves and a
report."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="relative FA/FR of candidates against a baseline",
        description="Evaluate candidate models against a baseline at matched FR, per device "
        "type and state. Without --candidate, score the --baseline model alone at its shipped "
        "threshold (or --threshold): FRR and FA/h with their resolution. Models are .onnx "
        "files (scored by onnxruntime, as on a device) or .safetensors checkpoints.",
    )
    _add_model_options(p)
    _add_operating_point_options(p)
    _add_output_options(p)
    _add_scoring_options(p)
    p.set_defaults(func=run)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """The baseline, the candidates and the clips they are scored on."""
    p.add_argument(
        "--baseline",
        default="pretrained:full",
        help="baseline model (.onnx or .safetensors), or a shipped model "
        "'pretrained:full' (default) / 'pretrained:small'; without --candidate, the model "
        "scored alone",
    )
    p.add_argument(
        "--candidate",
        action="append",
        default=None,
        help="candidate model, scored on every device type; MODEL:TYPE scores it only "
        "on device type TYPE (a personalized model); repeat for several. None: the "
        "baseline is scored alone",
    )
    p.add_argument(
        "--pairing",
        metavar="CSV",
        help="CSV with columns model,device_type: each model scored only on its device type",
    )
    p.add_argument("--manifest", required=True, help="corpus manifest.csv")
    p.add_argument(
        "--split", default="test", choices=("train", "val", "test"), help="(default test)"
    )


def _add_operating_point_options(p: argparse.ArgumentParser) -> None:
    """The baseline's threshold: fitted to a target FR, or a shipped one."""
    p.add_argument(
        "--target-fr",
        type=float,
        default=0.05,
        help="fit the baseline's threshold to this FR (default 0.05)",
    )
    fixed = p.add_mutually_exclusive_group()
    fixed.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="the baseline's shipped threshold, on every device type (no refitting)",
    )
    fixed.add_argument(
        "--thresholds",
        metavar="FILE",
        help='the baseline\'s shipped threshold per device type: JSON {"A": 0.6, ...} '
        'or CSV device_type,threshold ("*": every other device type)',
    )
    fixed.add_argument(
        "--at-shipped-threshold",
        action="store_true",
        help="use the shipped_threshold of the baseline's model card (<model>.json "
        "or ONNX metadata)",
    )


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """JSON on stdout and the written report."""
    p.add_argument("--json", action="store_true", help='print {"rows": [...]} as JSON')
    p.add_argument(
        "--report", metavar="DIR", help="write DET plots and a Markdown/HTML report here"
    )
    p.add_argument(
        "--format",
        choices=("md", "html", "both"),
        default="both",
        help="report format (default both)",
    )


def _add_scoring_options(p: argparse.ArgumentParser) -> None:
    """Bootstrap, batching and the streaming detector's settings."""
    p.add_argument(
        "--n-boot", type=int, default=200, help="bootstrap resamples for the CI (default 200)"
    )
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    p.add_argument("--batch", type=int, default=64, help="clips per scoring batch (default 64)")
    p.add_argument(
        "--hop-s", type=float, default=0.1, help="streaming detector hop in s (default 0.1)"
    )
    p.add_argument(
        "--smoothing",
        type=int,
        default=None,
        help="detector smoothing in posteriors (default: the detector's, 3)",
    )
    p.add_argument(
        "--refractory-s",
        type=float,
        default=None,
        help="detector refractory period in s (default: the detector's, 1.0)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _bound(x: float | str | None) -> str:
    return "inf" if x == "unbounded" else _fmt(x)  # type: ignore[arg-type]


def _table(rows: list[dict], split: str = "test") -> str:
    head = f"{'candidate':<16} {'device':<7} {'state':<9} {'FR':>6} {'FA':>6} {'relFA':>6} {'CI':>15} {'relFR':>6} {'FA/h':>8} {'pos':>5} {'neg':>5} {'str h':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ci = f"[{_bound(r['relative_fa_ci']['lower'])},{_bound(r['relative_fa_ci']['upper'])}]"
        fph = "n/a" if r["fa_per_hour"] is None else f"{r['fa_per_hour']:.1f}"
        if r.get("fa_per_hour_saturated"):
            fph += "*"  # saturated: at the refractory period's ceiling
        lines.append(
            f"{r['candidate'][:16]:<16} {r['device_type']:<7} {r['state']:<9} {_fmt(r['fr']):>6} "
            f"{_fmt(r['fa']):>6} {_fmt(r['relative_fa']):>6} {ci:>15} {_fmt(r['relative_fr']):>6} "
            f"{fph:>8} {r['n_positive']:>5} {r['n_negative']:>5} {r['stream_hours']:>6.2f}"
        )
    lines.append(
        "pos, neg: the wake-word and other clips FR, FA and relFA rest on; str h: the hours "
        "of negative stream FA/h rests on"
    )
    if any(r.get("fa_per_hour_saturated") or r.get("baseline_fa_per_hour_saturated") for r in rows):
        lines.append(
            "* FA/h saturated: within 20% of its ceiling (one event per refractory "
            "period); the real rate of false triggers may be higher"
        )
    return "\n".join(lines + empty_cell_notes(rows, split))


# Words of the notes that explain a missing figure (the others explain a present one).
_EMPTY_WORDS = ("not measured", "no wake-word or no other", "unbounded", "no interval")


def empty_cell_notes(rows: list[dict], split: str = "test") -> list[str]:
    """Why cells show n/a, once per distinct reason, naming the cells, and what recordings
    would fill them: the JSON's notes, brought to the console."""
    from wakefl.tools.evaluation.missing_figures import what_fills

    why: dict[str, list[str]] = {}
    for r in rows:
        if r.get("relative_fa") is not None and r.get("fa_per_hour") is not None:
            continue
        cell = f"{r['candidate']}/{r['device_type']}/{r['state']}"
        notes = str(r.get("note", "")).split("; ")
        reasons = [n for n in notes if any(w in n for w in _EMPTY_WORDS)] or ["no figure"]
        if r.get("fa_per_hour") is None and r.get("n_streams", 1) == 0:
            reasons = [x for x in reasons if x != "no figure"]
            reasons.append("no negative streams here: FA/h not measured")
        for reason in reasons:
            why.setdefault(reason, []).append(cell)
    lines = ["n/a cells:"] if why else []
    for reason, cells in why.items():
        shown = ", ".join(cells[:4]) + (f" and {len(cells) - 4} more" if len(cells) > 4 else "")
        lines.append(f"  {reason}: {shown}")
        fills = what_fills(reason, split)
        if fills:
            lines.append(f"    to measure it, {fills}")
    return lines


def run(args: argparse.Namespace) -> int:
    from wakefl.errors import ConfigError
    from wakefl.tools.evaluation.evaluate import EvalSettings, run_evaluation
    from wakefl.tools.evaluation.inputs import parse_candidate, read_pairing, read_thresholds
    from wakefl.tools.evaluation.report import matched_fa_table, result_json, write_report

    if not (math.isfinite(args.target_fr) and 0.0 <= args.target_fr < 1.0):
        raise ConfigError(f"--target-fr must be in [0, 1), got {args.target_fr}")
    if args.n_boot < 1:
        raise ConfigError(f"--n-boot must be at least 1, got {args.n_boot}")
    if args.batch < 1:
        raise ConfigError(f"--batch must be at least 1, got {args.batch}")
    candidates = [parse_candidate(c) for c in args.candidate or []]
    if args.pairing:
        candidates += read_pairing(args.pairing)
    threshold = read_thresholds(args.thresholds) if args.thresholds else args.threshold
    if not candidates:
        return _score_alone(args, threshold)
    settings = EvalSettings(
        split=args.split,
        target_fr=args.target_fr,
        n_boot=args.n_boot,
        seed=args.seed,
        batch=args.batch,
        hop_s=args.hop_s,
        smoothing=args.smoothing,
        refractory_s=args.refractory_s,
        progress=not args.quiet,
        threshold=threshold,
        at_shipped_threshold=args.at_shipped_threshold,
    )
    result = run_evaluation(_baseline_path(args), candidates, args.manifest, settings)
    if args.report:
        formats = ("md", "html") if args.format == "both" else (args.format,)
        written = write_report(result, args.report, formats)
        print(f"report written to {args.report} ({len(written)} files)", file=sys.stderr)
    if args.json:
        print(json.dumps(result_json(result), allow_nan=False))
    else:
        print(_table(result.rows, args.split))
        print("\n".join(["", *matched_fa_table(result.rows)]))
    return 0


def _baseline_path(args: argparse.Namespace) -> str:
    baseline = args.baseline
    if str(baseline).startswith("pretrained:"):
        from wakefl.tools.training.warm_start import resolve_baseline

        return str(resolve_baseline(baseline, None, width=0.0, progress=not args.quiet))
    return str(baseline)


def _score_alone(args: argparse.Namespace, threshold: float | dict | None) -> int:
    """No candidate: the --baseline model alone at its shipped threshold (or the given
    one), FRR and FA/h with their resolutions."""
    from wakefl.errors import ConfigError
    from wakefl.tools.evaluation.inputs import card_threshold
    from wakefl.tools.evaluation.single_model import DetectorSettings, format_rows, score_model

    if args.report:
        raise ConfigError("--report compares models: give --candidate, or drop --report")
    model = _baseline_path(args)
    if not Path(model).is_file():
        raise ConfigError(f"model file not found: {model} (--baseline)")
    source = "given"
    if threshold is None:
        threshold = card_threshold(model)
        source = "the model's shipped threshold"
        if threshold is None:
            raise ConfigError(
                f"{args.baseline} carries no shipped threshold (no .json beside it, none in "
                "its ONNX metadata): give --threshold, or --candidate to compare models"
            )
    settings = DetectorSettings(
        args.hop_s, args.smoothing, args.refractory_s, args.batch, not args.quiet
    )
    rows = score_model(model, args.manifest, args.split, threshold, settings)
    if args.json:
        print(json.dumps({"model": args.baseline, "threshold_source": source, "rows": rows}))
    else:
        print(f"{args.baseline} alone on the {args.split} split, at {source}")
        print(format_rows(rows))
    return 0
