"""Detection benchmark of a wake-word model on the pretraining corpus, per device type, for
the held-out speakers (the corpus's test split) and the unseen-voices corpus (or, with
`--split val`, the validation split alone, for choosing between candidate models):

- FRR at 0.5 and at 0.1 false accepts per hour, the FA/h counted as events of the streaming
  detector (shipped hop, smoothing and refractory period) on the negative streams;
- FA/h at 5% FRR;
- FRR and FA/h at the model's shipped threshold (its card), when it has one;
- the highest-scoring moments of the negative streams, with what was said there (the
  transcript the corpus build writes beside each stream);
- a DET curve (FRR against FA/h) per split, as PNG;
- with `--int8`, the same for the int8 ONNX export, and how often its decisions agree with
  fp32 at the shipped threshold, on every stream window and clip;
- with `--detectors 0.1:3 0.2:1`, the same figures for other streaming detector settings
  (hop and smoothing), from the same scores;
- with `--gate-pretrained small` (or `--gate-weights W`), the same figures for the
  two-stage detector (edge_runtime/gate_rule.py) at each of `--gate-thresholds`, and the
  share of stream windows the main model scores there (what sets its edge cost);
- with `--retimed DIR`, FRR at the shipped threshold on the wake-phrase clips of a corpus
  built with `--profile pretrain-timing` (the held-out speakers' phrases with "hey"
  shortened and the pause after it cut out; tools/CORPUS.md), of the same `--split`.
- with `--extra-streams DIR`, the negative streams of a corpus built with the same seed and
  `--profile pretrain-streams` (test) or `pretrain-valstreams` (`--split val`) join the main
  corpus's: FRR at 0.5 FA/h needs at least 2 hours of stream per device type to allow a
  single false accept.
- one threshold for all device types, the lowest at which their streams together give at
  most 0.5 FA/h: on the validation split, a shipped threshold set at a resolvable FA rate
  (`wakefl model set-threshold`); with `--pooled-fa-per-hour 0.25`, the same at other rates
  too (`set-threshold --fa-per-hour 0.25`), for a margin where validation streams promise
  fewer false accepts than held-out speakers give.
- with `--acoustics DIR`, the same figures on a corpus built with the same seed and
  `--profile pretrain-acoustics`: the held-out speakers (and the unseen voices) recorded
  through the second acoustic simulation (tools/acoustics/field_acoustics.py), which training never
  used. The report then sets the held-out conditions side by side (`conditions`): held-out
  speakers (the training simulator), held-out acoustics and unseen voices, each with FRR at
  the shipped threshold, FRR at <= 0.5 FA/h (one threshold for all types), FA/h at the
  shipped threshold and its resolution (one false accept in the condition's stream hours).
- with `--carrier DIR --conditions-from REPORT...`, the running-speech add-on alone, at the
  shipped threshold and at the held-out conditions' thresholds for <= 0.5 FA/h of earlier
  `--json` reports of the same weights: phrases in running speech at the FA/h of a 3-hour
  reading, without scoring its streams again.
- with `--breakdown N`, where the misses come from: the context probe's recordings
  (tools/probes/context_probe.py) of N held-out speakers of the corpus's recipe, scored with
  the same streaming rule, FRR by background kind (quiet, babble, one talker, TV, music,
  fan), active-speech ratio, placement (over the phrase or only outside it), AGC and noise
  suppression on or off, RT60, distance, and carrier sentences against isolated phrases, at
  the shipped threshold and at each held-out condition's threshold for <= 0.5 FA/h.

    python -m wakefl.tools.bench.detection --pretrained small --corpus DIR [--int8] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.edge_runtime.detection_rule import (
    DEFAULT_HOP_S as HOP_S,
)
from wakefl.edge_runtime.detection_rule import (
    DEFAULT_REFRACTORY_S as REFRACTORY_S,
)
from wakefl.edge_runtime.detection_rule import (
    DEFAULT_SMOOTHING as SMOOTHING,
)
from wakefl.edge_runtime.gate_rule import GATE_HOLD
from wakefl.errors import ConfigError
from wakefl.recorded_paths import recorded_path
from wakefl.tools.bench.detection_conditions import (
    addon_phrases,
    condition_thresholds,
    extra_stream_manifests,
    held_out_conditions,
    probe_breakdown,
    score_addon_clips,
    scored_splits,
)
from wakefl.tools.bench.detection_report import format_table, plot
from wakefl.tools.bench.detection_scoring import (
    FA_TARGETS,
    SplitScores,
    agreement,
    det_points,
    gated_split,
    is_fa_target,
    pooled_operating_point,
    pooled_target_key,
    score_split,
    summarize,
)
from wakefl.tools.probes.context_probe import MAX_SPEAKERS

# The gate thresholds the two-stage detector's shipped one was chosen from, on validation
# (edge_runtime/gate_rule.py, DEFAULT_GATE_THRESHOLD).
GATE_THRESHOLDS_READ = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)

# The peers benchmark reads these from here.


def parse_detector(text: str) -> tuple[float, int]:
    """`HOP:SMOOTHING`, e.g. `0.2:1`."""
    try:
        hop, smoothing = text.split(":")
        out = (float(hop), int(smoothing))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOP:SMOOTHING, got {text!r}") from None
    if not (out[0] > 0 and out[1] >= 1):
        raise argparse.ArgumentTypeError(f"hop must be > 0 and smoothing >= 1, got {text!r}")
    return out


def fa_rate(text: str) -> float:
    """A false-accept rate target in FA/h: finite, above 0, at most 10."""
    try:
        out = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FA/h, got {text!r}") from None
    if not is_fa_target(out):
        raise argparse.ArgumentTypeError(f"an FA/h target is in (0, 10], got {text!r}")
    return out


def _export(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Path], float | None, Any]:
    from wakefl.models.kws_cnn import load_model
    from wakefl.models.kws_cnn.pretrained import card_beside, load_pretrained, pretrained_card

    if args.pretrained:
        model, card = load_pretrained(args.pretrained), pretrained_card(args.pretrained)
    else:
        model = load_model(args.weights)
        card = card_beside(args.weights) or {}
    thr = card.get("threshold")
    return (
        _export_model(args, model, tmp / "model"),
        (float(thr) if isinstance(thr, int | float) else None),
        model,
    )


def _export_gate(args: argparse.Namespace, tmp: Path) -> dict[str, Path] | None:
    """The gate's model exported as the main model is (None without a gate)."""
    from wakefl.models.kws_cnn import load_model
    from wakefl.models.kws_cnn.pretrained import load_pretrained

    # getattr: tests that build their own Namespace name no gate, as for the add-ons.
    if getattr(args, "gate_pretrained", None):
        return _export_model(args, load_pretrained(args.gate_pretrained), tmp / "gate")
    if getattr(args, "gate_weights", None):
        return _export_model(args, load_model(args.gate_weights), tmp / "gate")
    return None


def _export_model(args: argparse.Namespace, model: Any, stem: Path) -> dict[str, Path]:
    from wakefl.models.kws_cnn import export_onnx

    paths = {"fp32": export_onnx(model, stem.with_suffix(".onnx"))}
    if args.int8:
        # Calibrate on real corpus audio: a few test clips of each device type.
        from wakefl.sdk.dataset import load_clip
        from wakefl.sdk.manifest import read_manifest

        rows = [
            r
            for r in read_manifest(args.corpus / "manifest.csv")
            if r.kind == "clip" and r.split == "val"
        ]
        pick = rows[:: max(1, len(rows) // 64)][:64]
        calib = np.stack(
            [
                load_clip(r.resolve(args.corpus / "manifest.csv"), model.cfg.window_samples)
                for r in pick
            ]
        )
        paths["int8"] = export_onnx(
            model, Path(f"{stem}-int8.onnx"), int8=True, calibration_windows=calib
        )
    return paths


def _weights_digest(args: argparse.Namespace) -> str:
    """The scored weights' digest: `wakefl model set-threshold` checks that a benchmark's
    threshold was set on the very weights it ships."""
    from wakefl.models.kws_cnn import weights_digest
    from wakefl.models.kws_cnn.pretrained import pretrained_path

    return weights_digest(pretrained_path(args.pretrained) if args.pretrained else args.weights)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from wakefl.edge_runtime import OnnxScorer
    from wakefl.sdk.manifest import read_manifest

    splits = scored_splits(args)
    extra = extra_stream_manifests(args.corpus, args.extra_streams or [], args.split)
    detectors = args.detectors or [(HOP_S, SMOOTHING)]
    (hop_s, smoothing), others = detectors[0], detectors[1:]
    result = _header(args, extra, hop_s, smoothing)
    with tempfile.TemporaryDirectory(prefix="wakefl-bench-det-") as tmp:
        paths, shipped, _ = _export(args, Path(tmp))
        result["shipped_threshold"] = shipped
        scorers = {k: OnnxScorer(p, threads=args.threads) for k, p in paths.items()}
        gate_paths = _export_gate(args, Path(tmp))
        gates = {k: OnnxScorer(p, threads=args.threads) for k, p in (gate_paths or {}).items()}
        result.update(addon_phrases(args, scorers, shipped))
        if getattr(args, "conditions_from", None):
            # Earlier readings of these weights fix the thresholds; the streams are not
            # scored again.
            result["conditions"] = conditions_from(args.conditions_from, result)
            _at_conditions(args, scorers["fp32"], result)
            return result
        for split, manifest in splits.items():
            devices = sorted(
                {r.device_type for r in read_manifest(manifest) if r.split == args.split}
            )
            curves: dict[str, list[tuple[float, float]]] = {}
            for precision, scorer in scorers.items():
                t0 = time.perf_counter()
                # Add-on streams join the main corpus's own split only.
                more = extra if manifest == args.corpus / "manifest.csv" else ()
                scored = _score_devices(scorer, manifest, devices, args, more, precision, split)
                per = {d: sc.detector(hop_s, smoothing) for d, sc in scored.items()}
                rows: dict[str, Any] = {d: summarize(sc, shipped) for d, sc in per.items()}
                rows.update(_pooled_points(per, getattr(args, "pooled_fa_per_hour", None)))
                rows["_seconds"] = round(time.perf_counter() - t0, 1)
                result.setdefault(precision, {})[split] = rows
                _other_detectors(result, others, scored, shipped, (precision, split))
                if gates:
                    gate = _score_devices(
                        gates[precision], manifest, devices, args, more, "gate", split
                    )
                    _gated(args, result, per, gate, shipped, (precision, split))
                curves.update({f"{precision} {d}": det_points(sc) for d, sc in per.items()})
                if precision == "fp32":
                    fp32 = per
                elif shipped is not None:
                    agree = [agreement(fp32[d], per[d], shipped) for d in devices]
                    a, n = sum(x for x, _ in agree), sum(y for _, y in agree)
                    result.setdefault("int8_agreement", {})[split] = {
                        "agree": a,
                        "decisions": n,
                        "share": a / n,
                    }
            if args.plots:
                args.plots.mkdir(parents=True, exist_ok=True)
                plot(curves, f"DET, {split}", args.plots / f"det-{split.replace(' ', '-')}.png")
        result["conditions"] = held_out_conditions(result.get("fp32", {}))
        _at_conditions(args, scorers["fp32"], result)
    return result


def _header(
    args: argparse.Namespace, extra: tuple[Path, ...], hop_s: float, smoothing: int
) -> dict[str, Any]:
    """What a report scored: the model, its digest, the corpora and the detector."""
    return {
        "model": args.pretrained or recorded_path(args.weights),
        "weights_digest": _weights_digest(args),
        "corpus": recorded_path(args.corpus),
        "hop_s": hop_s,
        "smoothing": smoothing,
        "refractory_s": REFRACTORY_S,
        "extra_streams": [recorded_path(m.parent) for m in extra],
        "own_streams": not _replaces_own_streams(args, extra),
        "acoustics": recorded_path(args.acoustics) if getattr(args, "acoustics", None) else None,
    }


def _pooled_points(per: dict[str, SplitScores], targets: list[float] | None) -> dict[str, Any]:
    """One threshold for all types at 0.5 FA/h (`_pooled`), and at each extra target."""
    out: dict[str, Any] = {"_pooled": pooled_operating_point(per, FA_TARGETS[0])}
    if targets:
        out["_pooled_by_target"] = {
            pooled_target_key(t): pooled_operating_point(per, t) for t in targets
        }
    return out


def _at_conditions(args: argparse.Namespace, scorer: Any, result: dict[str, Any]) -> None:
    """What is scored at the held-out conditions' thresholds: the running-speech add-on
    and the context probe's breakdown of the misses."""
    if getattr(args, "carrier", None) is not None:
        result["carrier_phrases_at_0.5_fa_h"] = carrier_at_conditions(
            scorer, args.carrier / "manifest.csv", args.split, result["conditions"]
        )
    if getattr(args, "breakdown", 0):
        result["miss_breakdown"] = probe_breakdown(
            args.corpus, args.breakdown, scorer, result["shipped_threshold"], result["conditions"]
        )


def conditions_from(reports: list[Path], result: dict[str, Any]) -> dict[str, Any]:
    """The held-out conditions of earlier benchmark reports of the same weights, merged
    (a later report's condition replaces an earlier one's of the same name), each named
    with the report it came from: the thresholds at which `--carrier` reads its clips."""
    out: dict[str, Any] = {}
    for path in reports:
        try:
            report = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(
                f"--conditions-from: {path} is not a readable JSON report: {exc}"
            ) from None
        if not isinstance(report, dict) or not isinstance(report.get("conditions"), dict):
            raise ConfigError(f"--conditions-from: {path} holds no held-out `conditions`")
        if report.get("weights_digest") != result["weights_digest"]:
            raise ConfigError(
                f"--conditions-from: {path} scored other weights (digest "
                f"{report.get('weights_digest')}, these are {result['weights_digest']})"
            )
        for name, cond in report["conditions"].items():
            if isinstance(cond, dict):
                out[name] = {**cond, "from_report": recorded_path(path)}
    if not condition_thresholds(out):
        raise ConfigError("--conditions-from: no condition there has a threshold for 0.5 FA/h")
    return out


def carrier_at_conditions(
    scorer: Any, manifest: Path, split: str, conditions: dict[str, Any]
) -> dict[str, Any]:
    """The running-speech add-on's clips at each held-out condition's one-for-all threshold
    at <= 0.5 FA/h: phrases said in one breath against isolated ones at the same
    false-accept rate, for a model whose card (if any) was set elsewhere."""
    out: dict[str, Any] = {}
    for name, thr in condition_thresholds(conditions).items():
        cells = score_addon_clips(scorer, manifest, split, thr, "--carrier")
        out[name] = {"threshold": thr, "by_type": cells}
    return out


def _replaces_own_streams(args: argparse.Namespace, extra: tuple[Path, ...]) -> bool:
    """Whether add-on streams are scored in place of the main corpus's own: only where
    `--only-extra-streams` asks for it and `extra` (the add-ons of this manifest) is not
    empty, so the unseen-voices corpus always keeps its own streams."""
    return bool(extra) and bool(getattr(args, "only_extra_streams", False))


def _score_devices(
    scorer: Any,
    manifest: Path,
    devices: list[str],
    args: argparse.Namespace,
    extra: tuple[Path, ...],
    precision: str,
    split: str,
) -> dict[str, SplitScores]:
    return {
        d: score_split(
            scorer,
            manifest,
            d,
            args.max_stream_seconds,
            split=args.split,
            extra_streams=extra,
            progress=f"{precision} {split}",
            own_streams=not _replaces_own_streams(args, extra),
        )
        for d in devices
    }


def _other_detectors(
    result: dict[str, Any],
    others: list[tuple[float, int]],
    scored: dict[str, SplitScores],
    shipped: float | None,
    where: tuple[str, str],
) -> None:
    """The same scores through other detector settings, into result["detectors"]."""
    precision, split = where
    for h, m in others:
        per = {d: sc.detector(h, m) for d, sc in scored.items()}
        rows: dict[str, Any] = {d: summarize(sc, shipped) for d, sc in per.items()}
        # The pooled point too: detector settings are compared at one FA/h for all types.
        rows.update(_pooled_points(per, None))
        rows["_seconds"] = result[precision][split]["_seconds"]
        label = f"hop {h} s, smoothing {m}"
        result.setdefault("detectors", {}).setdefault(label, {}).setdefault(precision, {})[
            split
        ] = rows


def _gated(
    args: argparse.Namespace,
    result: dict[str, Any],
    per: dict[str, SplitScores],
    gate: dict[str, SplitScores],
    shipped: float | None,
    where: tuple[str, str],
) -> None:
    """The main detector's scores through the two-stage detector at each gate threshold,
    into result["gated"]: the figures and the share of stream windows the main model scores."""
    precision, split = where
    for g in args.gate_thresholds:
        rows: dict[str, Any] = {}
        through: dict[str, SplitScores] = {}
        for d, sc in per.items():
            gated_sc, share = gated_split(
                sc, gate[d].detector(sc.hop_s, sc.smoothing), g, args.gate_hold
            )
            through[d] = gated_sc
            rows[d] = {**summarize(gated_sc, shipped), "main_window_share": share}
        rows.update(_pooled_points(through, None))
        hours = [sc.stream_hours for sc in per.values()]
        shares = [rows[d]["main_window_share"] for d in per]
        rows["_main_window_share"] = float(np.average(shares, weights=hours))
        result.setdefault("gated", {}).setdefault(
            f"gate {g}, hold {args.gate_hold}", {}
        ).setdefault(precision, {})[split] = rows


def _add_gate_arguments(p: argparse.ArgumentParser) -> None:
    gate = p.add_mutually_exclusive_group()
    gate.add_argument(
        "--gate-pretrained",
        choices=("full", "small"),
        default=None,
        help="also the two-stage detector with this model as the gate (edge_runtime/gate_rule.py)",
    )
    gate.add_argument("--gate-weights", type=Path, default=None, help="the gate as a checkpoint")
    p.add_argument(
        "--gate-thresholds",
        type=float,
        nargs="+",
        default=list(GATE_THRESHOLDS_READ),
        metavar="G",
        help="the gate's thresholds to read (default: "
        + " ".join(str(g) for g in GATE_THRESHOLDS_READ)
        + ", those the shipped gate threshold was chosen from)",
    )
    p.add_argument(
        "--gate-hold",
        type=int,
        default=GATE_HOLD,
        metavar="HOPS",
        help=f"hops the gate stays open after it passed (default {GATE_HOLD})",
    )


def _add_pooled_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pooled-fa-per-hour",
        type=fa_rate,
        nargs="+",
        default=None,
        metavar="T",
        help="also one threshold for all types at each of these FA/h (beside 0.5), e.g. a "
        "stricter target for `wakefl model set-threshold --fa-per-hour T` where the validation "
        "streams have proved optimistic",
    )


def _add_addon_arguments(p: argparse.ArgumentParser) -> None:
    """The corpus add-ons the benchmark scores beside the main corpus."""
    p.add_argument(
        "--retimed",
        type=Path,
        default=None,
        help="also a `--profile pretrain-timing` corpus folder: FRR on its re-timed phrases",
    )
    p.add_argument(
        "--carrier",
        type=Path,
        default=None,
        metavar="DIR",
        help="also a `--profile pretrain-carrier` corpus folder: FRR on its phrases in running "
        "speech (beside the isolated phrases') and the share of its confusables in running "
        "speech accepted, at the shipped threshold",
    )
    p.add_argument(
        "--conditions-from",
        type=Path,
        nargs="+",
        default=None,
        metavar="REPORT",
        help="with --carrier: take the held-out conditions' thresholds for <= 0.5 FA/h from "
        "these earlier --json reports of the same weights and score only the add-ons at "
        "them, not the streams again (e.g. the phrase in running speech at the FA/h of a "
        "3-hour reading)",
    )
    p.add_argument(
        "--only-extra-streams",
        action="store_true",
        help="score the --extra-streams add-ons' streams in place of the main corpus's own "
        "(its clips are still scored): a reading on streams no earlier run has read, e.g. a "
        "`pretrain-streams-second` build",
    )
    p.add_argument(
        "--extra-streams",
        type=Path,
        action="append",
        default=None,
        metavar="DIR",
        help="also a corpus folder built with --corpus's seed and `--profile pretrain-streams` "
        "(with --split test) or `pretrain-valstreams` (with --split val): its negative streams "
        "join the main corpus's of that split (repeatable)",
    )
    p.add_argument(
        "--acoustics",
        type=Path,
        default=None,
        metavar="DIR",
        help="also a corpus folder built with --corpus's seed and `--profile "
        "pretrain-acoustics`: the held-out speakers and unseen voices through the second "
        "acoustic simulation, reported as their own conditions",
    )


def _check_arguments(args: argparse.Namespace) -> None:
    """What argparse cannot say: settings that need or exclude each other."""
    if not 0 <= args.breakdown <= MAX_SPEAKERS:
        raise ConfigError(f"--breakdown takes 1-{MAX_SPEAKERS} speakers, got {args.breakdown}")
    if args.conditions_from and (args.carrier is None or args.breakdown):
        raise ConfigError(
            "--conditions-from reads --carrier at earlier reports' thresholds: give "
            "--carrier, and run --breakdown without it"
        )
    if any(not 0.0 <= g <= 1.0 for g in args.gate_thresholds) or args.gate_hold < 0:
        raise ConfigError("gate thresholds lie in [0, 1] and the gate's hold is >= 0 hops")
    if args.only_extra_streams and not args.extra_streams:
        raise ConfigError("--only-extra-streams scores the --extra-streams add-ons: give one")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pretrained", choices=("full", "small"))
    src.add_argument(
        "--weights", type=Path, help="a .safetensors checkpoint (a card beside it is used)"
    )
    p.add_argument("--corpus", type=Path, required=True, help="a pretrain corpus folder")
    p.add_argument("--int8", action="store_true", help="also the int8 ONNX export")
    p.add_argument(
        "--split",
        choices=("test", "val"),
        default="test",
        help="test: held-out speakers and unseen voices (the reported figures); val: the "
        "validation split only, for choosing between models without touching the test split",
    )
    p.add_argument(
        "--max-stream-seconds",
        type=float,
        default=None,
        help="score only the first S s of each stream",
    )
    p.add_argument(
        "--detectors",
        type=parse_detector,
        nargs="+",
        default=None,
        metavar="HOP:SMOOTHING",
        help=f"streaming detector settings, the first one primary (default {HOP_S}:{SMOOTHING}); "
        f"hops are multiples of {HOP_S} s, scored once",
    )
    _add_addon_arguments(p)
    p.add_argument(
        "--breakdown",
        type=int,
        default=0,
        metavar="SPEAKERS",
        help="also where the misses come from: FRR of the context probe's recordings "
        f"(SPEAKERS of --corpus's held-out speakers, 1-{MAX_SPEAKERS}) by background kind, ratio, "
        "placement, AGC, noise suppression, RT60, distance and carrier sentences, at the "
        "shipped threshold and each held-out condition's threshold for <= 0.5 FA/h",
    )
    _add_pooled_argument(p)
    _add_gate_arguments(p)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plots", type=Path, default=None, help="folder for DET curve PNGs")
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    _check_arguments(args)
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    return 0


if __name__ == "__main__":
    from wakefl.tools.script_errors import run_script

    raise SystemExit(run_script(main, __file__))
