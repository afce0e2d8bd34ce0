"""One model on a corpus at one threshold, no candidate to compare: what a device maker
asks of the shipped model on their own recordings (`wakefl eval` without `--candidate`).

Per device type and pooled: the false-reject rate on the wake-word clips, false accepts on
the other clips when there are any, and false accepts per hour on the negative streams
through the streaming detector. Each figure comes with its resolution, the step one clip
or one event moves it by, so that 0 false accepts in 20 minutes of stream reads as "below
3 per hour", not as "none"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.operating_point import DEFAULT_HOP_S
from wakefl.sdk.manifest import ManifestRow, read_manifest
from wakefl.sdk.wake_metrics import fa_per_hour_ceiling, is_saturated
from wakefl.tools.evaluation.missing_figures import with_remedy
from wakefl.tools.evaluation.model_scoring import (
    detection_times,
    load_clip_windows,
    load_scorer,
    score_windows,
    stream_posteriors,
)

ALL = "all"


@dataclass(frozen=True)
class DetectorSettings:
    """The streaming detector's settings for the streams (None: its defaults)."""

    hop_s: float = DEFAULT_HOP_S
    smoothing: int | None = None
    refractory_s: float | None = None
    batch: int = 64
    progress: bool = False


def resolution(count: int) -> float | None:
    """The step one more clip (or one more event per hour) moves a rate by: 1 / count."""
    return 1.0 / count if count > 0 else None


def clip_figures(pos_scores: np.ndarray, neg_scores: np.ndarray, threshold: float) -> dict:
    """FRR on the wake-word clips and FA on the other clips at `threshold` (a clip fires
    when its score reaches the threshold), with their resolutions."""
    n_pos, n_neg = int(pos_scores.size), int(neg_scores.size)
    misses = int(np.count_nonzero(pos_scores < threshold))
    accepts = int(np.count_nonzero(neg_scores >= threshold))
    return {
        "n_positive": n_pos,
        "misses": misses,
        "frr": misses / n_pos if n_pos else None,
        "frr_resolution": resolution(n_pos),
        "n_negative_clips": n_neg,
        "clip_false_accepts": accepts if n_neg else None,
        "clip_fa": accepts / n_neg if n_neg else None,
    }


def stream_figures(events: int, hours: float, ceiling: float | None) -> dict:
    """False accepts per hour on `hours` of stream, and its resolution (one event)."""
    fph = events / hours if hours > 0 else None
    return {
        "stream_hours": hours,
        "false_accept_events": events if hours > 0 else None,
        "fa_per_hour": fph,
        "fa_per_hour_resolution": 1.0 / hours if hours > 0 else None,
        "fa_per_hour_saturated": ceiling is not None and is_saturated(fph, ceiling),
    }


def row_note(row: dict, split: str = "test") -> str:
    """Why a figure of a row is missing, in words, with the recordings that would measure
    it (empty when none is missing)."""
    notes = []
    if not row["n_positive"]:
        notes.append(with_remedy("no wake-word clips: FRR not measured", split))
    if row["fa_per_hour"] is None:
        notes.append(with_remedy("no negative streams: FA/h not measured", split))
    if row["fa_per_hour_saturated"]:
        notes.append("FA/h saturated at one event per refractory period")
    return "; ".join(notes)


def _threshold_for(threshold: float | dict[str, float], device: str) -> float:
    if isinstance(threshold, dict):
        value = threshold.get(device, threshold.get("*"))
        if value is None:
            raise ConfigError(f"no threshold for device type {device!r}")
        return float(value)
    return float(threshold)


def _stream_events(
    scorer: Any,
    streams: Sequence[ManifestRow],
    manifest_dir: Path,
    thresholds: dict[str, float],
    st: DetectorSettings,
) -> tuple[dict[str, int], float | None]:
    """False accept events per device type on its streams, and the FA/h ceiling."""
    from wakefl.edge_runtime import load_audio

    events = dict.fromkeys(thresholds, 0)
    ceiling = None
    for r in streams:
        wave = load_audio(str(manifest_dir / r.path), sample_rate=scorer.sample_rate)
        post = stream_posteriors(scorer, wave, st.hop_s, st.smoothing, st.refractory_s, st.batch)
        events[r.device_type] += len(detection_times(post, thresholds[r.device_type]))
        ceiling = fa_per_hour_ceiling(
            post.hop_samples / post.sample_rate, post.refractory_samples / post.sample_rate
        )
    return events, ceiling


def score_model(
    model: str | Path,
    manifest_path: str | Path,
    split: str,
    threshold: float | dict[str, float],
    st: DetectorSettings | None = None,
) -> list[dict[str, Any]]:
    """One row per device type of the split's clips, then the pooled row `all` (when the
    device types share one threshold)."""
    st = st or DetectorSettings()
    manifest_path = Path(manifest_path)
    rows = [r for r in read_manifest(manifest_path) if r.split == split]
    clips = [r for r in rows if r.kind == "clip"]
    if not clips:
        raise ConfigError(f"the manifest has no clips in split {split!r}")
    devices = sorted({r.device_type for r in clips})
    thresholds = {d: _threshold_for(threshold, d) for d in devices}
    streams = [r for r in rows if r.kind == "stream" and r.device_type in thresholds]
    scorer = load_scorer(model)
    manifest_dir = manifest_path.resolve().parent
    windows = load_clip_windows(
        clips, manifest_dir, scorer.sample_rate, scorer.window_samples, st.progress
    )
    scores = score_windows(scorer, windows, st.batch, desc="score", progress=st.progress)
    labels = np.array([r.label for r in clips])
    dev = np.array([r.device_type for r in clips])
    events, ceiling = _stream_events(scorer, streams, manifest_dir, thresholds, st)
    out = []
    groups = [(d, [d]) for d in devices]
    if len(set(thresholds.values())) == 1:
        groups.append((ALL, devices))
    for name, members in groups:
        m = np.isin(dev, members)
        t = thresholds[members[0]]
        hours = sum(r.duration_s for r in streams if r.device_type in members) / 3600.0
        row = {
            "device_type": name,
            "threshold": t,
            **clip_figures(scores[m & (labels == 1)], scores[m & (labels == 0)], t),
            **stream_figures(sum(events[d] for d in members), hours, ceiling),
        }
        row["note"] = row_note(row, split)
        out.append(row)
    return out


def _fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The console table; a row's missing figures are explained below it."""
    head = (
        f"{'device':<7} {'threshold':>9} {'FRR':>6} {'±1 clip':>8} {'wake':>5} "
        f"{'FA/h':>7} {'±1 event':>9} {'stream h':>8} {'clip FA':>7} {'neg clips':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        fph = _fmt(r["fa_per_hour"], 2) + ("*" if r["fa_per_hour_saturated"] else "")
        lines.append(
            f"{r['device_type']:<7} {r['threshold']:>9.4f} {_fmt(r['frr']):>6} "
            f"{_fmt(r['frr_resolution']):>8} {r['n_positive']:>5} {fph:>7} "
            f"{_fmt(r['fa_per_hour_resolution'], 2):>9} {r['stream_hours']:>8.3f} "
            f"{_fmt(r['clip_fa']):>7} {r['n_negative_clips']:>9}"
        )
    lines += [f"  {r['device_type']}: {r['note']}" for r in rows if r["note"]]
    lines.append(
        "±1 clip / ±1 event: the step one more miss or one more false accept moves the "
        "figure by (its resolution); 0 events in H hours of stream says only that the rate "
        "is small against 1/H. wake, stream h and neg clips: what each figure rests on"
    )
    return "\n".join(lines)
