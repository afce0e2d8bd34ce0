"""What the detection benchmark scores beyond the main corpus's own splits: the held-out
acoustics add-on's twins of them, the add-ons of more negative streams, the re-timed and
running-speech phrases (each add-on checked to be a build of the main corpus's speakers),
and the held-out conditions set side by side."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.tools.bench.detection_scoring import clip_scores


def speaker_recipe(info: Any) -> tuple[Any, ...]:
    """What fixes a corpus build's speakers and splits: seed, phrase and speaker recipe."""
    info = info if isinstance(info, dict) else {}
    prof = info.get("profile") if isinstance(info.get("profile"), dict) else {}
    return (info.get("seed"), info.get("phrase"), prof.get("n_speakers"), prof.get("voice_set"))


def acoustics_manifests(corpus: Path, folder: Path | None, split: str) -> dict[str, Path]:
    """The `--acoustics` add-on's manifests by condition name, checked to be a
    `pretrain-acoustics` build (field acoustics) of `corpus`'s speakers: another seed's
    held-out speakers would include the main corpus's training speakers."""
    from wakefl.tools.corpus.build import read_corpus_info

    if folder is None:
        return {}
    info = read_corpus_info(folder)
    if info is None or not (folder / "manifest.csv").exists():
        raise ConfigError(f"--acoustics: {folder} is not a finished corpus build")
    if not isinstance(info, dict) or info.get("acoustics") != "field":
        raise ConfigError(
            f"--acoustics: {folder} was not built with `--profile pretrain-acoustics`"
        )
    main = read_corpus_info(corpus)
    if speaker_recipe(info) != speaker_recipe(main):
        raise ConfigError(
            f"--acoustics: {folder} was not built with {corpus}'s speakers (seed, phrase, "
            f"speakers): {speaker_recipe(info)} against {speaker_recipe(main)}"
        )
    if split == "val":
        return {"validation, held-out acoustics": folder / "manifest.csv"}
    out = {"held-out acoustics": folder / "manifest.csv"}
    if (folder / "unseen" / "manifest.csv").exists():
        out["unseen voices, held-out acoustics"] = folder / "unseen" / "manifest.csv"
    return out


def extra_stream_manifests(
    corpus: Path, folders: list[Path], split: str = "test"
) -> tuple[Path, ...]:
    """The manifests of `--extra-streams` add-ons, each checked to be a build of the same
    speakers as `corpus` (same seed, phrase and speaker recipe), since another seed's
    held-out speakers would include the main corpus's training speakers, and to hold
    negative streams of `split`."""
    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.corpus.build import read_corpus_info

    if not folders:
        return ()
    main = read_corpus_info(corpus)
    if main is None:
        raise ConfigError(f"{corpus}: no corpus.json, so --extra-streams cannot be checked")
    out = []
    for folder in folders:
        info = read_corpus_info(folder)
        if info is None or not (folder / "manifest.csv").exists():
            raise ConfigError(f"--extra-streams: {folder} is not a finished corpus build")
        if speaker_recipe(info) != speaker_recipe(main):
            raise ConfigError(
                f"--extra-streams: {folder} was not built with {corpus}'s speakers (seed, "
                f"phrase, speakers): {speaker_recipe(info)} against {speaker_recipe(main)}"
            )
        rows = read_manifest(folder / "manifest.csv")
        if not any(r.kind == "stream" and r.split == split for r in rows):
            profile = info.get("profile", {}).get("name") if isinstance(info, dict) else None
            raise ConfigError(
                f"--extra-streams: {folder} (profile {profile}) holds no {split} streams; "
                "--split test takes a `pretrain-streams` build, --split val a "
                "`pretrain-valstreams` one"
            )
        out.append(folder / "manifest.csv")
    return tuple(out)


def score_retimed(
    scorer: Any, manifest: Path, split: str, shipped: float | None, batch: int = 128
) -> dict[str, Any]:
    """Per device type, the wake-phrase clips of `split` in `manifest` and the share the
    model misses at the shipped threshold (None without one)."""
    return score_addon_clips(scorer, manifest, split, shipped, "--retimed", batch)


def score_addon_clips(
    scorer: Any,
    manifest: Path,
    split: str,
    shipped: float | None,
    flag: str,
    batch: int = 128,
) -> dict[str, Any]:
    """Per device type, an add-on's wake-phrase clips of `split` and the share the model
    misses at the shipped threshold (None without one); where the add-on also has other
    clips (a `pretrain-carrier` build's confusables in running speech), the share of them
    it accepts there."""
    from wakefl.sdk.manifest import read_manifest

    if not manifest.exists():
        raise ConfigError(f"{flag}: {manifest} does not exist")
    rows = [r for r in read_manifest(manifest) if r.split == split and r.kind == "clip"]
    if not any(r.label == 1 for r in rows):
        raise ConfigError(f"{flag}: {manifest} has no {split} wake-phrase clips")
    out: dict[str, Any] = {}
    for d in sorted({r.device_type for r in rows if r.label == 1}):
        cell: dict[str, Any] = {}
        for label, count, share in ((1, "positives", "frr"), (0, "negatives", "fa_share")):
            mine = [r for r in rows if r.device_type == d and r.label == label]
            if label == 0 and not mine:
                continue
            scores = clip_scores(scorer, mine, manifest, batch)
            cell[count] = len(mine)
            # Missed phrases below the threshold; accepted confusables at or above it.
            wrong = None if shipped is None else (scores < shipped) == bool(label)
            cell[f"{share}_at_shipped_threshold"] = None if wrong is None else float(np.mean(wrong))
        out[d] = cell
    return out


def addon_phrases(
    args: argparse.Namespace, scorers: dict[str, Any], shipped: float | None
) -> dict[str, Any]:
    """The re-timed and running-speech add-ons' clips, scored by each precision."""
    out: dict[str, Any] = {}
    for key, folder, flag in (
        ("retimed_phrases", args.retimed, "--retimed"),
        ("carrier_phrases", getattr(args, "carrier", None), "--carrier"),
    ):
        if folder is not None:
            out[key] = {
                k: score_addon_clips(sc, folder / "manifest.csv", args.split, shipped, flag)
                for k, sc in scorers.items()
            }
    return out


def corpus_splits(corpus: Path, split: str) -> dict[str, Path]:
    """The manifests to score, by the name the report gives them."""
    if not (corpus / "manifest.csv").exists():
        raise ConfigError(
            f"{corpus} holds no manifest.csv (build it with `wakefl corpus build "
            "--profile pretrain`)"
        )
    if split == "val":
        # Choosing between models on the test split biases the figures reported on it.
        return {"validation": corpus / "manifest.csv"}
    splits = {
        "held-out speakers": corpus / "manifest.csv",
        "unseen voices": corpus / "unseen" / "manifest.csv",
    }
    return {k: v for k, v in splits.items() if v.exists()}


def scored_splits(args: argparse.Namespace) -> dict[str, Path]:
    """The main corpus's splits with the `--acoustics` add-on's twins beside them; a
    `pretrain-acoustics` build given as `--corpus` is scored alone, under its own names."""
    from wakefl.tools.corpus.build import read_corpus_info

    acoustics = getattr(args, "acoustics", None)
    info = read_corpus_info(args.corpus)
    if isinstance(info, dict) and info.get("acoustics") == "field":
        if acoustics is not None:
            raise ConfigError(
                f"--corpus {args.corpus} is a held-out-acoustics build; give the main "
                "corpus as --corpus and this one as --acoustics"
            )
        return acoustics_manifests(args.corpus, args.corpus, args.split)
    field = acoustics_manifests(args.corpus, acoustics, args.split)
    return _with_conditions(corpus_splits(args.corpus, args.split), field)


def _with_conditions(splits: dict[str, Path], field: dict[str, Path]) -> dict[str, Path]:
    """The splits in report order: each training-simulator split, then its held-out
    acoustics twin."""
    twins = {
        "held-out speakers": "held-out acoustics",
        "unseen voices": "unseen voices, held-out acoustics",
        "validation": "validation, held-out acoustics",
    }
    out: dict[str, Path] = {}
    for name, path in splits.items():
        out[name] = path
        if twins.get(name) in field:
            out[twins[name]] = field[twins[name]]
    return {**out, **{k: v for k, v in field.items() if k not in out}}


def held_out_conditions(splits: dict[str, Any]) -> dict[str, Any]:
    """Per held-out condition (each scored split): per device type and over all types, FRR
    at the shipped threshold, FRR at <= 0.5 FA/h (each type at its own threshold; over all
    types at the one threshold their streams set together), FA/h at the shipped threshold,
    the stream hours and the FA/h resolution (one false accept in those hours)."""
    out: dict[str, Any] = {}
    for split, rows in splits.items():
        types = {d: r for d, r in rows.items() if not d.startswith("_")}
        if not types:
            continue
        by_type = {d: _condition_cell(r) for d, r in types.items()}
        hours = sum(r["stream_hours"] for r in types.values())
        positives = sum(r["positives"] for r in types.values())
        pooled = rows.get("_pooled", {})
        cell: dict[str, Any] = {
            "positives": positives,
            "stream_hours": round(hours, 3),
            "fa_h_resolution": 1.0 / hours if hours else None,
            "frr_at_0.5_fa_h": _weighted(
                types, {d: p["frr"] for d, p in pooled.get("by_type", {}).items()}
            ),
            "threshold_at_0.5_fa_h": pooled.get("threshold"),
            "resolved_at_0.5_fa_h": pooled.get("resolved"),
        }
        if all("at_shipped_threshold" in r for r in types.values()):
            ship = {d: r["at_shipped_threshold"] for d, r in types.items()}
            cell["frr_at_shipped_threshold"] = _weighted(
                types, {d: s["frr"] for d, s in ship.items()}
            )
            events = sum(ship[d]["fa_per_hour"] * types[d]["stream_hours"] for d in types)
            cell["fa_h_at_shipped_threshold"] = events / hours if hours else None
        out[split] = {"all types": cell, "by_type": by_type}
    return out


def condition_thresholds(conditions: dict[str, Any]) -> dict[str, float]:
    """Each held-out condition's one threshold for all types at <= 0.5 FA/h, by name
    (conditions without one left out)."""
    out = {}
    for name, cond in conditions.items():
        t = (cond.get("all types") or {}).get("threshold_at_0.5_fa_h")
        if t is not None:
            out[name] = float(t)
    return out


def _weighted(types: dict[str, Any], frr: dict[str, float]) -> float | None:
    """FRR over all types' positives from each type's FRR."""
    if set(frr) != set(types):
        return None
    n = sum(types[d]["positives"] for d in types)
    return sum(frr[d] * types[d]["positives"] for d in types) / n if n else None


def _condition_cell(r: dict[str, Any]) -> dict[str, Any]:
    ship = r.get("at_shipped_threshold")
    return {
        "positives": r["positives"],
        "frr_at_shipped_threshold": ship["frr"] if ship else None,
        "frr_at_0.5_fa_h": r["frr_at_0.5_fa_h"]["frr"],
        "resolved_at_0.5_fa_h": r["frr_at_0.5_fa_h"]["resolved"],
        "fa_h_at_shipped_threshold": ship["fa_per_hour"] if ship else None,
        "stream_hours": r["stream_hours"],
        "fa_h_resolution": 1.0 / r["stream_hours"] if r["stream_hours"] else None,
    }


def probe_breakdown(
    corpus: Path, speakers: int, scorer: Any, shipped: float | None, conditions: dict[str, Any]
) -> dict[str, Any]:
    """Where the misses come from: the context probe's recordings (tools/probes/) of
    `speakers` held-out speakers of `corpus`'s own recipe (its profile, seed and phrase),
    FRR broken down by background kind, ratio, placement, AGC, noise suppression, RT60,
    distance and carrier sentences, at the shipped threshold and at each held-out
    condition's one threshold for <= 0.5 FA/h."""
    from wakefl.tools.corpus.build import read_corpus_info
    from wakefl.tools.probes.context_probe import (
        miss_breakdown,
        probe_recordings,
        recording_scores,
    )

    info = read_corpus_info(corpus)
    prof = info.get("profile") if isinstance(info, dict) else None
    if not isinstance(info, dict) or not isinstance(prof, dict) or not prof.get("name"):
        raise ConfigError(f"--breakdown: {corpus} names no corpus profile to draw speakers from")
    thresholds = {} if shipped is None else {"shipped threshold": float(shipped)}
    for name, t in condition_thresholds(conditions).items():
        thresholds[f"{name}, <= 0.5 FA/h"] = t
    recordings = probe_recordings(
        speakers, int(info.get("seed", 0)), str(prof["name"]), str(info.get("phrase"))
    )
    peaks = recording_scores(scorer, recordings)
    return {
        "speakers": speakers,
        "recordings": len(recordings),
        "thresholds": thresholds,
        "frr": miss_breakdown(recordings, peaks, thresholds),
    }
