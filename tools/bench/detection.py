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
- with `--retimed DIR`, FRR at the shipped threshold on the wake-phrase clips of a corpus
  built with `--profile pretrain-timing` (the held-out speakers' phrases with "hey"
  shortened and the pause after it cut out; tools/CORPUS.md), of the same `--split`.
- with `--extra-streams DIR`, the negative streams of a corpus built with the same seed and
  `--profile pretrain-streams` (test) or `pretrain-valstreams` (`--split val`) join the main
  corpus's: FRR at 0.5 FA/h needs at least 2 hours of stream per device type to allow a
  single false accept.
- one threshold for all device types, the lowest at which their streams together give at
  most 0.5 FA/h: on the validation split, a shipped threshold set at a resolvable FA rate
  (`wakefl model set-threshold`).
- with `--acoustics DIR`, the same figures on a corpus built with the same seed and
  `--profile pretrain-acoustics`: the held-out speakers (and the unseen voices) recorded
  through the second acoustic simulation (tools/acoustics/field_acoustics.py), which training never
  used. The report then sets the held-out conditions side by side (`conditions`): held-out
  speakers (the training simulator), held-out acoustics and unseen voices, each with FRR at
  the shipped threshold, FRR at <= 0.5 FA/h (one threshold for all types), FA/h at the
  shipped threshold and its resolution (one false accept in the condition's stream hours).

    python -m wakefl.tools.bench.detection --pretrained small --corpus DIR [--int8] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import dataclass, replace
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
from wakefl.edge_runtime.detection_rule import (
    count_events,
    refractory_hops,
    smoothed,
    stream_windows,
)
from wakefl.errors import ConfigError
from wakefl.recorded_paths import recorded_path
from wakefl.sdk.manifest import SAMPLE_RATE

FA_TARGETS = (0.5, 0.1)
TOP_EVENTS = 5  # the highest-scoring stream moments listed per device type
FRR_TARGET = 0.05


@dataclass
class SplitScores:
    """One model's scores on one device type of one split, for one detector setting."""

    pos: np.ndarray  # clip scores of wake-phrase clips
    neg: np.ndarray  # clip scores of other clips
    raw_streams: list[np.ndarray]  # raw window posteriors of each negative stream
    stream_hours: float
    hop_s: float = HOP_S
    smoothing: int = SMOOTHING
    pos_voices: np.ndarray | None = None  # each positive's voice family ("engine:voice")
    stream_files: list[Path] | None = None  # each stream's WAV, where its transcript lies
    # How the report names each stream (its file name when None): add-on streams carry
    # their corpus folder, since their file names repeat the main corpus's.
    stream_labels: list[str] | None = None
    window_s: float = 1.5

    @property
    def streams(self) -> list[np.ndarray]:
        return [smoothed(r, self.smoothing) for r in self.raw_streams]

    def detector(self, hop_s: float, smoothing: int) -> SplitScores:
        """The same scores seen by a detector at `hop_s` (a multiple of this one's: its
        window ends are every k-th of these) and `smoothing`."""
        step = hop_s / self.hop_s
        if step < 1 or abs(step - round(step)) > 1e-6:
            raise ConfigError(f"hop {hop_s} s is not a multiple of the scored hop {self.hop_s} s")
        return replace(
            self,
            raw_streams=[r[:: int(round(step))] for r in self.raw_streams],
            hop_s=hop_s,
            smoothing=smoothing,
        )


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


def _events(sc: SplitScores, thr: float) -> int:
    hops = refractory_hops(REFRACTORY_S, sc.hop_s, SAMPLE_RATE)
    return sum(count_events(s, thr, hops) for s in sc.streams)


def lowest_threshold(scs: list[SplitScores], fa_per_hour: float) -> float:
    """The lowest threshold at which the streams of `scs` together give at most
    `fa_per_hour` false accepts per hour (none at all with fewer hours than 1/target)."""
    hours = sum(sc.stream_hours for sc in scs)
    allowed = math.floor(fa_per_hour * hours + 1e-9)
    parts = [sc.pos for sc in scs] + [
        s[s >= np.quantile(s, 0.99)] for sc in scs for s in sc.streams
    ]
    cands = np.unique(np.concatenate([*parts, [1.0 + 1e-9]]))
    lo, hi = 0, len(cands) - 1
    while lo < hi:  # the first candidate whose events are within the allowance
        mid = (lo + hi) // 2
        if sum(_events(sc, float(cands[mid])) for sc in scs) <= allowed:
            hi = mid
        else:
            lo = mid + 1
    return float(cands[lo])


def pooled_operating_point(per: dict[str, SplitScores], fa_per_hour: float) -> dict[str, Any]:
    """One threshold for every device type: the lowest at which all their streams together
    give at most `fa_per_hour` false accepts per hour, with each type's FRR and FA/h there.
    Set on validation streams, it is a shipped threshold chosen at a resolvable FA rate."""
    thr = lowest_threshold(list(per.values()), fa_per_hour)
    hours = sum(sc.stream_hours for sc in per.values())
    by_type = {d: at_threshold(sc, thr) for d, sc in per.items()}
    # Each type's events were just counted for its own FA/h: sum those, not count again.
    events = sum(by_type[d]["fa_per_hour"] * sc.stream_hours for d, sc in per.items())
    return {
        "fa_per_hour_target": fa_per_hour,
        "threshold": thr,
        "stream_hours": round(hours, 3),
        "fa_per_hour": round(events) / hours,
        "resolved": hours * fa_per_hour >= 1.0,
        "by_type": by_type,
    }


def frr_at_fa(sc: SplitScores, fa_per_hour: float) -> dict[str, Any]:
    """FRR at the lowest threshold whose stream false accepts stay within the target. With
    fewer stream hours than 1/target, that means no false accept at all (flagged)."""
    thr = lowest_threshold([sc], fa_per_hour)
    return {
        "fa_per_hour_target": fa_per_hour,
        "threshold": thr,
        "frr": float(np.mean(sc.pos < thr)),
        "fa_per_hour": _events(sc, thr) / sc.stream_hours,
        "resolved": sc.stream_hours * fa_per_hour >= 1.0,
    }


def fa_at_frr(sc: SplitScores, frr: float) -> dict[str, Any]:
    thr = float(np.quantile(sc.pos, frr, method="lower")) if sc.pos.size else 1.0
    return {
        "frr_target": frr,
        "threshold": thr,
        "frr": float(np.mean(sc.pos < thr)),
        "fa_per_hour": _events(sc, thr) / sc.stream_hours,
    }


def at_threshold(sc: SplitScores, thr: float) -> dict[str, Any]:
    return {
        "threshold": thr,
        "frr": float(np.mean(sc.pos < thr)),
        "clip_far": float(np.mean(sc.neg >= thr)),
        "fa_per_hour": _events(sc, thr) / sc.stream_hours,
    }


def det_points(sc: SplitScores, n: int = 60) -> list[tuple[float, float]]:
    """(FA/h, FRR) over thresholds spread across the positives' scores."""
    thrs = np.unique(np.quantile(sc.pos, np.linspace(0.0, 0.5, n)))
    return [(_events(sc, float(t)) / sc.stream_hours, float(np.mean(sc.pos < t))) for t in thrs]


def voice_families(manifest: Path) -> dict[str, str]:
    """speaker -> "engine:voice" from the speakers.csv a built corpus has beside its
    manifest; empty for a corpus without one (imported recordings)."""
    import csv

    path = manifest.parent / "speakers.csv"
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if not {"speaker", "engine", "voice"} <= set(reader.fieldnames or ()):
            return {}  # some other table of speakers: no voice families to report
        return {r["speaker"]: f"{r['engine']}:{r['voice']}" for r in reader}


def _clip_scores(scorer: Any, clips: list[Any], manifest: Path, batch: int) -> np.ndarray:
    """The model's score of each clip row, decoded to its window, in `batch`es."""
    from wakefl.sdk.dataset import load_clip

    waves = np.stack([load_clip(r.resolve(manifest), scorer.window_samples) for r in clips])
    return np.concatenate([scorer.score(waves[i : i + batch]) for i in range(0, len(waves), batch)])


def score_split(
    scorer: Any,
    manifest: Path,
    device: str,
    max_stream_s: float | None,
    batch: int = 128,
    split: str = "test",
    extra_streams: tuple[Path, ...] = (),
) -> SplitScores:
    """Clip and stream scores of `device` in `split` of `manifest`; the streams of the same
    device and split in each of `extra_streams` (add-on manifests) are scored beside its own."""
    from wakefl.sdk.manifest import read_manifest

    rows = [r for r in read_manifest(manifest) if r.split == split and r.device_type == device]
    clips = [r for r in rows if r.kind == "clip"]
    if not clips:
        raise ConfigError(f"{manifest}: device type {device} has no {split} clips")
    scores = _clip_scores(scorer, clips, manifest, batch)
    labels = np.array([r.label for r in clips])
    found = [(r.resolve(manifest), Path(r.path).name) for r in rows if r.kind == "stream"]
    for m in extra_streams:
        found += [
            (r.resolve(m), f"{m.parent.name}/{r.path}")
            for r in read_manifest(m)
            if r.kind == "stream" and r.split == split and r.device_type == device
        ]
    files = [f for f, _ in found]
    if not files:
        raise ConfigError(f"{manifest}: device type {device} has no {split} streams")
    raw, seconds = _stream_scores(scorer, files, max_stream_s, batch)
    families = voice_families(manifest)
    voices = None
    if families:
        voices = np.array([families.get(r.speaker, "?") for r in clips if r.label == 1])
    return SplitScores(
        scores[labels == 1],
        scores[labels == 0],
        raw,
        seconds / 3600,
        pos_voices=voices,
        stream_files=files,
        stream_labels=[label for _, label in found],
        window_s=scorer.window_samples / scorer.sample_rate,
    )


def _stream_scores(
    scorer: Any, files: list[Path], max_stream_s: float | None, batch: int
) -> tuple[list[np.ndarray], float]:
    """Each stream's raw window posteriors at the shipped hop, and the seconds scored."""
    from wakefl.edge_runtime import load_audio

    raw, seconds = [], 0.0
    for f in files:
        w = load_audio(f, scorer.sample_rate)
        if max_stream_s is not None:
            w = w[: int(max_stream_s * scorer.sample_rate)]
        wins = stream_windows(w, scorer.window_samples, int(round(HOP_S * scorer.sample_rate)))
        raw.append(
            np.concatenate(
                [
                    scorer.score(np.ascontiguousarray(wins[i : i + batch]))
                    for i in range(0, len(wins), batch)
                ]
            ).astype(np.float64)
        )
        seconds += w.size / scorer.sample_rate
    return raw, seconds


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
            scores = _clip_scores(scorer, mine, manifest, batch)
            cell[count] = len(mine)
            # Missed phrases below the threshold; accepted confusables at or above it.
            wrong = None if shipped is None else (scores < shipped) == bool(label)
            cell[f"{share}_at_shipped_threshold"] = None if wrong is None else float(np.mean(wrong))
        out[d] = cell
    return out


def summarize(sc: SplitScores, shipped: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "positives": int(sc.pos.size),
        "negative_clips": int(sc.neg.size),
        "stream_hours": round(sc.stream_hours, 3),
        # The smallest FA/h these streams can show: one false accept in their hours.
        "fa_h_resolution": 1.0 / sc.stream_hours,
        **{f"frr_at_{t}_fa_h": frr_at_fa(sc, t) for t in FA_TARGETS},
        "fa_h_at_5pct_frr": fa_at_frr(sc, FRR_TARGET),
    }
    if shipped is not None:
        out["at_shipped_threshold"] = at_threshold(sc, shipped)
    if sc.pos_voices is not None:
        out["by_voice"] = by_voice(sc, out["frr_at_0.5_fa_h"]["threshold"], shipped)
    if sc.stream_files is not None:
        out["top_stream_events"] = top_stream_events(sc)
    return out


def top_stream_events(sc: SplitScores, k: int = TOP_EVENTS) -> list[dict[str, Any]]:
    """The `k` highest-scoring moments of the negative streams, as distinct detector events
    (at least a refractory period apart), with what the stream's transcript says was spoken
    in the window: the false accepts that set the threshold, and what they heard."""
    from wakefl.tools.corpus.build import read_transcript

    assert sc.stream_files is not None
    refractory = refractory_hops(REFRACTORY_S, sc.hop_s, SAMPLE_RATE)
    found: list[tuple[float, int, int]] = []
    for i, stream in enumerate(sc.streams):
        taken: list[int] = []
        for j in np.argsort(stream, kind="stable")[::-1]:
            if len(taken) == k:
                break
            if all(abs(int(j) - t) >= refractory for t in taken):
                taken.append(int(j))
                found.append((float(stream[j]), i, int(j)))
    top = sorted(found, reverse=True)[:k]
    transcripts = {i: read_transcript(sc.stream_files[i]) for i in {i for _, i, _ in top}}
    out = []
    for score, i, j in top:
        end = j * sc.hop_s + sc.window_s
        said = [
            f"{u.text} ({u.content}, {u.speaker})"
            for u in transcripts[i]
            if u.end_s > end - sc.window_s and u.start_s < end
        ]
        out.append(
            {
                "score": score,
                "stream": sc.stream_labels[i] if sc.stream_labels else sc.stream_files[i].name,
                "end_s": round(end, 2),
                "said": said,
            }
        )
    return out


def by_voice(sc: SplitScores, thr: float, shipped: float | None) -> dict[str, Any]:
    """FRR of each voice family's positives at the split's 0.5 FA/h threshold (all families
    share the negative streams) and at the shipped threshold."""
    assert sc.pos_voices is not None
    out: dict[str, Any] = {}
    for v in sorted(set(sc.pos_voices.tolist())):
        pos = sc.pos[sc.pos_voices == v]
        out[v] = {"positives": int(pos.size), "frr_at_0.5_fa_h": float(np.mean(pos < thr))}
        if shipped is not None:
            out[v]["frr_at_shipped_threshold"] = float(np.mean(pos < shipped))
    return out


def agreement(a: SplitScores, b: SplitScores, thr: float) -> tuple[int, int]:
    """(agreeing decisions, decisions) of two models at one threshold, over every clip and
    every smoothed stream window."""
    agree = total = 0
    for x, y in [(a.pos, b.pos), (a.neg, b.neg), *zip(a.streams, b.streams, strict=True)]:
        agree += int(np.sum((x >= thr) == (y >= thr)))
        total += x.size
    return agree, total


def plot(curves: dict[str, list[tuple[float, float]]], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, pts in curves.items():
        fa, fr = zip(*sorted(pts), strict=True)
        ax.plot(np.maximum(fa, 1e-2), np.maximum(fr, 1e-3), marker=".", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("false accepts per hour (streams)")
    ax.set_ylabel("false-reject rate (clips)")
    ax.set_title(title)
    ax.axvline(0.5, color="grey", lw=0.5)
    ax.axhline(0.05, color="grey", lw=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _export(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Path], float | None, Any]:
    from wakefl.models.kws_cnn import export_onnx, load_model
    from wakefl.models.kws_cnn.pretrained import card_beside, load_pretrained, pretrained_card

    if args.pretrained:
        model, card = load_pretrained(args.pretrained), pretrained_card(args.pretrained)
    else:
        model = load_model(args.weights)
        card = card_beside(args.weights) or {}
    paths = {"fp32": export_onnx(model, tmp / "model.onnx")}
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
            model, tmp / "model-int8.onnx", int8=True, calibration_windows=calib
        )
    thr = card.get("threshold")
    return paths, (float(thr) if isinstance(thr, int | float) else None), model


def _weights_digest(args: argparse.Namespace) -> str:
    """The scored weights' digest: `wakefl model set-threshold` checks that a benchmark's
    threshold was set on the very weights it ships."""
    from wakefl.models.kws_cnn import weights_digest
    from wakefl.models.kws_cnn.pretrained import pretrained_path

    return weights_digest(pretrained_path(args.pretrained) if args.pretrained else args.weights)


def _splits(corpus: Path, split: str) -> dict[str, Path]:
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    from wakefl.edge_runtime import OnnxScorer
    from wakefl.sdk.manifest import read_manifest

    splits = _scored_splits(args)
    extra = extra_stream_manifests(args.corpus, args.extra_streams or [], args.split)
    detectors = args.detectors or [(HOP_S, SMOOTHING)]
    (hop_s, smoothing), others = detectors[0], detectors[1:]
    result: dict[str, Any] = {
        "model": args.pretrained or recorded_path(args.weights),
        "weights_digest": _weights_digest(args),
        "corpus": recorded_path(args.corpus),
        "hop_s": hop_s,
        "smoothing": smoothing,
        "refractory_s": REFRACTORY_S,
        "extra_streams": [recorded_path(m.parent) for m in extra],
        "acoustics": recorded_path(args.acoustics) if getattr(args, "acoustics", None) else None,
    }
    with tempfile.TemporaryDirectory(prefix="wakefl-bench-det-") as tmp:
        paths, shipped, _ = _export(args, Path(tmp))
        result["shipped_threshold"] = shipped
        scorers = {k: OnnxScorer(p, threads=args.threads) for k, p in paths.items()}
        result.update(_addon_phrases(args, scorers, shipped))
        for split, manifest in splits.items():
            devices = sorted(
                {r.device_type for r in read_manifest(manifest) if r.split == args.split}
            )
            curves: dict[str, list[tuple[float, float]]] = {}
            for precision, scorer in scorers.items():
                t0 = time.perf_counter()
                # Add-on streams join the main corpus's own split only.
                more = extra if manifest == args.corpus / "manifest.csv" else ()
                scored = _score_devices(scorer, manifest, devices, args, more)
                per = {d: sc.detector(hop_s, smoothing) for d, sc in scored.items()}
                rows: dict[str, Any] = {d: summarize(sc, shipped) for d, sc in per.items()}
                rows["_pooled"] = pooled_operating_point(per, FA_TARGETS[0])
                rows["_seconds"] = round(time.perf_counter() - t0, 1)
                result.setdefault(precision, {})[split] = rows
                _other_detectors(result, others, scored, shipped, (precision, split))
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
    return result


def _addon_phrases(
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


def _scored_splits(args: argparse.Namespace) -> dict[str, Path]:
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
    return _with_conditions(_splits(args.corpus, args.split), field)


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


def _score_devices(
    scorer: Any,
    manifest: Path,
    devices: list[str],
    args: argparse.Namespace,
    extra: tuple[Path, ...],
) -> dict[str, SplitScores]:
    return {
        d: score_split(
            scorer, manifest, d, args.max_stream_seconds, split=args.split, extra_streams=extra
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
        rows: dict[str, Any] = {
            d: summarize(sc.detector(h, m), shipped) for d, sc in scored.items()
        }
        rows["_seconds"] = result[precision][split]["_seconds"]
        label = f"hop {h} s, smoothing {m}"
        result.setdefault("detectors", {}).setdefault(label, {}).setdefault(precision, {})[
            split
        ] = rows


def format_table(result: dict[str, Any]) -> str:
    primary = f"hop {result['hop_s']} s, smoothing {result['smoothing']}"
    lines = _table_lines(result, primary)
    for label, figures in result.get("detectors", {}).items():
        lines += _table_lines(figures, label)
    lines += condition_lines(result.get("conditions", {}))
    lines += _voice_lines(result.get("fp32", {}))
    lines += _retimed_lines(result.get("retimed_phrases", {}))
    lines += carrier_lines(result.get("carrier_phrases", {}), result)
    lines += _event_lines(result.get("fp32", {}))
    for split, ag in result.get("int8_agreement", {}).items():
        lines.append(
            f"\nint8 vs fp32 decisions at the shipped threshold ({primary}), {split}: "
            f"{ag['share']:.4f} ({ag['agree']}/{ag['decisions']})"
        )
    lines.append(
        "\n* fewer stream hours than 1/target: the threshold allows no false accept at all"
    )
    return "\n".join(lines)


def condition_lines(conditions: dict[str, Any]) -> list[str]:
    """fp32 held-out conditions side by side: FRR at the shipped threshold, FRR at <= 0.5
    FA/h, FA/h at the shipped threshold, and the stream hours that resolve it."""
    if not conditions:
        return []
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    lines = [
        "\nfp32, held-out conditions: FRR @shipped thr | FRR @<=0.5 FA/h | FA/h @shipped thr "
        "| stream h (1 false accept = FA/h)",
        "condition | type | FRR @shipped | FRR @0.5 FA/h | FA/h @shipped | hours (resolution)",
    ]
    for name, c in conditions.items():
        for d, r in [*c["by_type"].items(), ("all", c["all types"])]:
            flag = "" if r.get("resolved_at_0.5_fa_h", True) else "*"
            lines.append(
                f"{name} | {d} | {fmt(r.get('frr_at_shipped_threshold'), '.3f')} | "
                f"{fmt(r.get('frr_at_0.5_fa_h'), '.3f')}{flag} | "
                f"{fmt(r.get('fa_h_at_shipped_threshold'), '.2f')} | "
                f"{r['stream_hours']} ({fmt(r.get('fa_h_resolution'), '.2f')})"
            )
    return lines


def _voice_lines(splits: dict[str, Any]) -> list[str]:
    """fp32 FRR of each voice family per device type: at 0.5 FA/h, and at the shipped
    threshold after the slash."""
    lines = []
    for split, rows in splits.items():
        types = [d for d in rows if not d.startswith("_") and "by_voice" in rows[d]]
        if not types:
            continue
        lines.append(f"\nfp32, {split}, FRR by voice @0.5 FA/h / @shipped thr")
        lines.append("voice | " + " | ".join(types))
        for v in sorted({v for d in types for v in rows[d]["by_voice"]}):
            cells = [_voice_cell(rows[d]["by_voice"].get(v)) for d in types]
            lines.append(f"{v} | " + " | ".join(cells))
    return lines


def _retimed_lines(by_precision: dict[str, Any]) -> list[str]:
    lines = []
    for precision, rows in by_precision.items():
        cells = []
        for d, r in rows.items():
            frr = r["frr_at_shipped_threshold"]
            cells.append(f"{d} {'-' if frr is None else format(frr, '.3f')} ({r['positives']})")
        lines.append(
            f"\n{precision}, re-timed phrases, FRR at the shipped threshold (clips): "
            + " | ".join(cells)
        )
    return lines


def carrier_lines(by_precision: dict[str, Any], result: dict[str, Any]) -> list[str]:
    """The phrase in running speech beside the isolated phrase of the same held-out split,
    both at the shipped threshold (clips), per device type."""
    lines = []
    for precision, rows in by_precision.items():
        splits = result.get(precision, {})
        isolated = splits.get("held-out speakers") or splits.get("validation") or {}
        cells = []
        for d, r in rows.items():
            frr = r["frr_at_shipped_threshold"]
            alone = (isolated.get(d) or {}).get("at_shipped_threshold", {}).get("frr")
            fa = r.get("fa_share_at_shipped_threshold")
            cells.append(
                f"{d} {_share(frr)} ({r['positives']}; isolated {_share(alone)})"
                + (
                    f", confusables accepted {_share(fa)} ({r['negatives']})"
                    if "negatives" in r
                    else ""
                )
            )
        lines.append(
            f"\n{precision}, phrases in running speech, FRR at the shipped threshold (clips): "
            + " | ".join(cells)
        )
    return lines


def _share(x: float | None) -> str:
    return "-" if x is None else format(x, ".3f")


def _event_lines(splits: dict[str, Any]) -> list[str]:
    """fp32's highest-scoring moments of each device type's negative streams."""
    lines = []
    for split, rows in splits.items():
        types = [d for d in rows if not d.startswith("_") and rows[d].get("top_stream_events")]
        if not types:
            continue
        lines.append(f"\nfp32, {split}, highest-scoring moments of the negative streams")
        lines.append("type | score | stream @ window end | said in the window")
        for d in types:
            for e in rows[d]["top_stream_events"]:
                said = "; ".join(e["said"]) or "-"
                lines.append(f"{d} | {e['score']:.4f} | {e['stream']} @ {e['end_s']} s | {said}")
    return lines


def _voice_cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    cell = f"{r['frr_at_0.5_fa_h']:.2f}"
    if "frr_at_shipped_threshold" in r:
        cell += f"/{r['frr_at_shipped_threshold']:.2f}"
    return cell


def _table_lines(result: dict[str, Any], detector: str) -> list[str]:
    lines = []
    for precision in ("fp32", "int8"):
        for split, rows in result.get(precision, {}).items():
            lines.append(f"\n{precision}, {split}, {detector} ({rows['_seconds']} s to score)")
            lines.append(
                "type | FRR @0.5 FA/h | FRR @0.1 FA/h | FA/h @5% FRR | shipped thr: FRR, FA/h | hours"
            )
            for d, r in rows.items():
                if d.startswith("_"):
                    continue
                a, b, c = r["frr_at_0.5_fa_h"], r["frr_at_0.1_fa_h"], r["fa_h_at_5pct_frr"]
                s = r.get("at_shipped_threshold")
                ship = f"{s['frr']:.3f}, {s['fa_per_hour']:.2f}" if s else "-"
                flag = lambda x: "" if x["resolved"] else "*"  # noqa: E731
                lines.append(
                    f"{d} | {a['frr']:.3f}{flag(a)} | {b['frr']:.3f}{flag(b)} | "
                    f"{c['fa_per_hour']:.2f} | {ship} | {r['stream_hours']}"
                )
            if "_pooled" in rows:
                lines += _pooled_lines(rows["_pooled"])
    return lines


def _pooled_lines(p: dict[str, Any]) -> list[str]:
    """One threshold for every type, set on all their streams together."""
    cells = [f"{d} {r['frr']:.3f}, {r['fa_per_hour']:.2f}" for d, r in p["by_type"].items()]
    return [
        f"one threshold for all types, <= {p['fa_per_hour_target']} FA/h over their "
        f"{p['stream_hours']} h of streams{'' if p['resolved'] else '*'}: {p['threshold']:.6f} "
        f"({p['fa_per_hour']:.2f} FA/h); FRR, FA/h by type: " + " | ".join(cells)
    ]


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
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plots", type=Path, default=None, help="folder for DET curve PNGs")
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
