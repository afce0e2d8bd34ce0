"""The served-model gate in hindsight: what a demo device's validation data said about the
model its gate switched to, seen as the gate sees it and as the test figure is measured.

For every device type whose gate switched in a `wakefl demo` run, the served model against
the baseline on that type's validation data: relative FR at matched FA (below 1: fewer
misses at no more false accepts), with a bootstrap interval over speakers and stretches of
stream, in four views:

- `gate`: false accepts on the validation clips and on windows cut every 0.5 s from the
  validation streams (`wakefl device --val-stream-hop`), at the baseline's threshold for
  the gate's target FR (the demo's 0.5 on the fleet): what the gate weighed, served
  against baseline;
- `gate, shipped threshold`: the same negatives at the baseline's shipped threshold,
  where the demo's test figure is measured;
- `detector`: the streams scored as the streaming detector scores them (every 0.1 s,
  smoothed), with the clips, at the shipped threshold;
- `detector, streams only`: false accepts counted on those stream scores alone, as the
  test figure counts them (per hour of stream), at the shipped threshold.

Beside them, the test figure from the run's `demo_results.json`. A model that every view
calls better and the test calls worse is one no admission rule over this validation
evidence would have kept out: the validation audio lacks what the test audio holds.

`--extra-streams ADDON` adds a streams add-on's validation streams (`wakefl corpus build
--profile fleet-valstreams --seed S`: 16 more minutes per device type) to each device
type's: what the same views say with more of the device's own negative audio.

    python -m wakefl.tools.studies.gate_hindsight --run runs/demo [--manifest M]
        [--extra-streams ADDON/manifest.csv] [--gate-target-fr 0.5] [--n-boot 300]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.sdk.matched_fa import relative_fr_at_matched_clip_fa

GATE_HOP_S = 0.5  # `wakefl device --val-stream-hop`'s default
VIEWS = ("gate", "gate, shipped threshold", "detector", "detector, streams only")


@dataclass(frozen=True)
class Scores:
    """One model's validation scores on one device type: wake-word clips, other clips,
    stream windows at the gate's hop and smoothed stream scores at the detector's hop."""

    pos: np.ndarray
    clip_neg: np.ndarray
    gate_windows: np.ndarray
    detector_windows: np.ndarray


@dataclass(frozen=True)
class Units:
    """The bootstrap unit of every score in `Scores`' four arrays, in their order."""

    pos: np.ndarray
    clip_neg: np.ndarray
    gate_windows: np.ndarray
    detector_windows: np.ndarray


def views(
    base: Scores,
    served: Scores,
    units: Units,
    shipped_threshold: float,
    gate_target_fr: float,
    n_boot: int = 300,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Relative FR at matched FA of `served` against `base` in each of `VIEWS` (the module
    docstring): {view: MatchedFaResult.as_record()}."""
    setups = {
        "gate": ("gate_windows", True, None),
        "gate, shipped threshold": ("gate_windows", True, shipped_threshold),
        "detector": ("detector_windows", True, shipped_threshold),
        "detector, streams only": ("detector_windows", False, shipped_threshold),
    }
    out = {}
    for view, (windows, with_clips, thr) in setups.items():

        def negatives(s: Any, field: str = windows, clips: bool = with_clips) -> np.ndarray:
            return np.concatenate([s.clip_neg, getattr(s, field)] if clips else [getattr(s, field)])

        out[view] = relative_fr_at_matched_clip_fa(
            base.pos, negatives(base), served.pos, negatives(served), gate_target_fr,
            groups=(units.pos.tolist(), negatives(units).tolist()), n_boot=n_boot, seed=seed,
            baseline_thr=thr,
        ).as_record()  # fmt: skip
    return out


def _stream_units(stream: str, n: int, hop: int) -> np.ndarray:
    """The bootstrap units of a stream's `n` windows every `hop` samples, as the device's
    gate names them (sdk/stream_windows.py)."""
    from wakefl.sdk.manifest import SAMPLE_RATE
    from wakefl.sdk.stream_windows import bootstrap_unit

    return np.array([bootstrap_unit(stream, k * hop / SAMPLE_RATE) for k in range(n)])


def device_scores(
    manifest: Path, device_type: str, models: dict[str, Path], extra: Path | None = None
) -> tuple[dict[str, Scores], Units]:
    """Every model's validation `Scores` on `device_type` (models: name -> weights), and
    their bootstrap units (speakers; a stream's 30 s stretches, as the gate's). `extra`: a
    streams add-on whose validation streams of `device_type` join the corpus's."""
    from wakefl.edge_runtime import load_audio
    from wakefl.edge_runtime.detection_rule import smoothed, stream_windows
    from wakefl.operating_point import DEFAULT_HOP_S, DEFAULT_SMOOTHING
    from wakefl.sdk.manifest import SAMPLE_RATE, read_manifest
    from wakefl.sdk.stream_windows import ADDON_UNIT_PREFIX
    from wakefl.tools.evaluation.model_scoring import TorchScorer, load_clip_windows, score_windows

    rows = [r for r in read_manifest(manifest) if r.device_type == device_type and r.split == "val"]
    clips = [r for r in rows if r.kind == "clip"]
    # (row, its manifest, its units' prefix): as `wakefl device --val-streams` names them,
    # an add-on's streams under the add-on prefix, the corpus's own as they are.
    streams = [(r, manifest, "") for r in rows if r.kind == "stream" and r.label == 0]
    if extra is not None:
        streams += [
            (r, extra, ADDON_UNIT_PREFIX)
            for r in read_manifest(extra)
            if (r.device_type, r.split, r.kind, r.label) == (device_type, "val", "stream", 0)
        ]
    if not any(r.label == 1 for r in clips) or not streams:
        raise ConfigError(f"{manifest}: {device_type} has no validation wake words or streams")
    scorers = {name: TorchScorer(path) for name, path in models.items()}
    window = next(iter(scorers.values())).window_samples
    labels = np.array([r.label for r in clips])
    waves = load_clip_windows(clips, manifest.parent, SAMPLE_RATE, window, progress=False)
    hops = {"gate": round(GATE_HOP_S * SAMPLE_RATE), "detector": round(DEFAULT_HOP_S * SAMPLE_RATE)}
    cuts = {  # every stream's windows at each hop (views, no copies)
        k: [stream_windows(load_audio(r.resolve(m), SAMPLE_RATE), window, h) for r, m, _ in streams]
        for k, h in hops.items()
    }
    out = {}
    for name, scorer in scorers.items():
        c = score_windows(scorer, waves, progress=False)
        gate = [score_windows(scorer, w, progress=False) for w in cuts["gate"]]
        det = [smoothed(score_windows(scorer, w, progress=False), DEFAULT_SMOOTHING)
               for w in cuts["detector"]]  # fmt: skip
        out[name] = Scores(
            c[labels == 1], c[labels == 0], np.concatenate(gate), np.concatenate(det)
        )
    speakers = np.array([r.speaker for r in clips])
    stream_units = {
        k: np.concatenate([_stream_units(f"{prefix}{r.path}", len(w), hops[k])
                           for (r, _, prefix), w in zip(streams, ws, strict=True)])
        for k, ws in cuts.items()
    }  # fmt: skip
    units = Units(
        speakers[labels == 1], speakers[labels == 0], stream_units["gate"], stream_units["detector"]
    )
    return out, units


def hindsight(
    run: Path, manifest: Path, gate_target_fr: float, n_boot: int = 300, extra: Path | None = None
) -> list[dict[str, Any]]:
    """One record per device type whose gate switched in the demo run at `run`: the test
    figure and the validation views (with `extra`'s validation streams added)."""
    from wakefl.operating_point import shipped_threshold_in

    results = json.loads((run / "report" / "demo_results.json").read_text(encoding="utf-8"))
    base_path = run / "models" / "baseline.safetensors"
    config = json.loads(base_path.with_suffix(".json").read_text(encoding="utf-8"))
    shipped = shipped_threshold_in(config, str(base_path))
    if shipped is None:
        raise ConfigError(f"{base_path}: the baseline names no shipped threshold")
    out = []
    for row in results["rows"]:
        if not row.get("gate_switched"):
            continue
        t = row["device_type"]
        served_path = run / "models" / f"served-{t}.safetensors"
        scores, units = device_scores(
            manifest, t, {"base": base_path, "served": served_path}, extra
        )
        out.append(
            {
                "device_type": t,
                "serves": row["serves"],
                "test": {
                    "relative_fr": row["relative_fr"],
                    "relative_fr_ci": row["relative_fr_ci"],
                },
                "validation": views(
                    scores["base"], scores["served"], units, shipped, gate_target_fr, n_boot
                ),
            }
        )
    return out


def _fmt(rec: dict[str, Any]) -> str:
    def f(x: Any) -> str:
        return x if isinstance(x, str) else "n/a" if x is None else f"{x:.2f}"

    lo, hi = rec["relative_fr_ci"]
    return f"{f(rec['relative_fr'])} [{f(lo)}, {f(hi)}]"


def table(records: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: one row per switched device type."""
    lines = [
        "| type | serves | test | " + " | ".join(f"validation: {v}" for v in VIEWS) + " |",
        "|---|---|---|" + "---|" * len(VIEWS),
    ]
    for r in records:
        cells = [_fmt(r["test"])] + [_fmt(r["validation"][v]) for v in VIEWS]
        lines.append(f"| {r['device_type']} | {r['serves']} | " + " | ".join(cells) + " |")
    return lines


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a `wakefl demo --workdir`")
    ap.add_argument("--manifest", type=Path, default=None, help="default: the run's corpus")
    ap.add_argument(
        "--extra-streams",
        type=Path,
        default=None,
        help="a streams add-on manifest (e.g. --profile fleet-valstreams, the run's seed) "
        "whose validation streams join each device type's",
    )
    ap.add_argument("--gate-target-fr", type=float, default=0.5)
    ap.add_argument("--n-boot", type=int, default=300)
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def _run_manifest(run: Path) -> Path:
    from wakefl.cache_location import cache_root

    results = json.loads((run / "report" / "demo_results.json").read_text(encoding="utf-8"))
    return cache_root() / "corpus" / f"{results['profile']}-seed{results['seed']}" / "manifest.csv"


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if not (a.run / "report" / "demo_results.json").is_file():
        raise ConfigError(f"{a.run}: no report/demo_results.json (not a `wakefl demo` run)")
    manifest = a.manifest or _run_manifest(a.run)
    if not manifest.is_file():
        raise ConfigError(f"{manifest}: no such corpus manifest (give --manifest)")
    if a.extra_streams is not None and not a.extra_streams.is_file():
        raise ConfigError(f"{a.extra_streams}: no such streams add-on manifest")
    records = hindsight(a.run, manifest, a.gate_target_fr, a.n_boot, a.extra_streams)
    print("\n".join(table(records)) if records else f"{a.run}: no gate switched")
    if a.json is not None:
        a.json.write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
