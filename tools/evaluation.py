"""The evaluation runner behind `wakefl eval`: candidates against a baseline, per device
type and device state, with relative FA at matched FR, bootstrap intervals over speakers,
DET curves, and false accepts per hour on the long negative streams.

Operating points. For each device type the baseline's threshold is fixed on that device
type's clips of the split (largest threshold with FR <= target, see
`wakefl.sdk.wake_metrics`) and each candidate's threshold is matched to the baseline's FR on
the same clips. A device ships one threshold, not one per state, so the per-state rows
evaluate both models at their device-type thresholds: their relative FR shows how well the
match holds within a state. The device type "all" pools every device type and has its own
operating point fixed on the pooled clips. Streams are run through the edge runtime's
streaming detector at each model's threshold for that device type (the pooled threshold for
"all"), so FA per hour counts detection events as a device would raise them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from wakefl.errors import ConfigError
from wakefl.sdk.manifest import STATES, ManifestRow, read_manifest
from wakefl.sdk.wake_metrics import (
    baseline_threshold,
    bootstrap_relative_fa_by_subset,
    det_curve,
    fa_at,
    false_accepts_per_hour,
    fr_at,
    matched_threshold,
    safe_ratio,
)
from wakefl.tools.model_scoring import (
    check_same_frontend,
    load_clip_windows,
    load_scorer,
    score_windows,
)

ALL = "all"
BASELINE = "baseline"


# The corpus builder gives every background-only clip of a split one pseudo-speaker name.
NO_SPEECH_PREFIX = "nospeech-"


def bootstrap_units(speakers: Sequence[str] | np.ndarray) -> np.ndarray:
    """Resampling unit of each clip for the speaker bootstrap: its speaker, except that
    background-only clips (speaker `nospeech-<split>`) are each their own unit. They share
    no voice, and each has its own room and noise draw; resampling them as one block would
    drop or double every one of them at once and widen the interval for no reason."""
    spk = np.asarray(speakers, dtype=str).reshape(-1)
    out = spk.astype(object)
    for i in np.flatnonzero(np.char.startswith(spk, NO_SPEECH_PREFIX)):
        out[i] = f"{spk[i]}#{i}"
    return out.astype(str)


@dataclass
class EvalSettings:
    split: str = "test"
    target_fr: float = 0.05
    n_boot: int = 200
    seed: int = 0
    batch: int = 64
    hop_s: float = 0.1
    smoothing: int | None = None  # None: the detector's default
    refractory_s: float | None = None  # None: the detector's default
    progress: bool = True


@dataclass
class EvalResult:
    rows: list[dict[str, Any]]
    # device type -> model name -> (fa_rates, fr_rates)
    det: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]
    # device type -> model name -> (fa, fr) at its operating threshold
    operating_points: dict[str, dict[str, tuple[float, float]]]
    models: dict[str, str]  # name -> path
    settings: EvalSettings
    manifest: str
    summary: dict[str, Any] = field(default_factory=dict)


class CachedScorer:
    """Remembers the score of every window it has seen, so a stream run through the
    detector again at another threshold is not scored again."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sample_rate = inner.sample_rate
        self.window_samples = inner.window_samples
        self._cache: dict[bytes, float] = {}

    def score(self, windows: np.ndarray) -> np.ndarray:
        w = np.ascontiguousarray(windows, dtype=np.float32)
        if w.ndim == 1:
            w = w[None, :]
        keys = [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in w]
        todo = [i for i, k in enumerate(keys) if k not in self._cache]
        if todo:
            fresh = np.asarray(self.inner.score(w[todo]), dtype=np.float64).reshape(-1)
            for i, s in zip(todo, fresh, strict=True):
                self._cache[keys[i]] = float(s)
        return np.array([self._cache[k] for k in keys], dtype=np.float32)


def _unique_names(paths: Sequence[str | Path]) -> list[str]:
    """Candidate names for the tables: the file stem, or the path where stems collide."""
    stems = [Path(p).stem for p in paths]
    return [s if stems.count(s) == 1 and s != BASELINE else str(p) for s, p in zip(stems, paths, strict=True)]


def _select_rows(rows: list[ManifestRow], split: str) -> tuple[list[ManifestRow], list[ManifestRow]]:
    clips = [r for r in rows if r.split == split and r.kind == "clip"]
    streams = [r for r in rows if r.split == split and r.kind == "stream"]
    if not clips:
        splits = sorted({r.split for r in rows if r.kind == "clip"})
        raise ConfigError(
            f"the manifest has no clips in split {split!r} (splits with clips: {', '.join(splits) or 'none'})"
        )
    for device in sorted({r.device_type for r in clips}):
        if not any(r.label == 1 for r in clips if r.device_type == device):
            raise ConfigError(
                f"device type {device!r} has no wake-word clips in split {split!r}: its FR and "
                "operating point cannot be measured"
            )
    return clips, streams


def stream_detections(scorer: Any, wave: np.ndarray, threshold: float, settings: EvalSettings) -> list[float]:
    """Times (s) of the detections the edge runtime's streaming detector raises on `wave`."""
    from wakefl.edge_runtime import detect_audio

    if threshold > 1.0:  # above every probability: the model never fires
        return []
    kwargs: dict[str, Any] = {"hop_s": settings.hop_s, "threshold": float(threshold)}
    if settings.smoothing is not None:
        kwargs["smoothing"] = settings.smoothing
    if settings.refractory_s is not None:
        kwargs["refractory_s"] = settings.refractory_s
    return [e.time_s for e in detect_audio(scorer, wave, **kwargs).events]


def _fmt_none(x: float | None) -> float | None:
    return None if x is None else float(x)


def run_evaluation(
    baseline_path: str | Path,
    candidate_paths: Sequence[str | Path],
    manifest_path: str | Path,
    settings: EvalSettings | None = None,
) -> EvalResult:
    """Evaluate every candidate against the baseline on the manifest's split."""
    from wakefl.edge_runtime import load_audio

    st = settings or EvalSettings()
    if not candidate_paths:
        raise ConfigError("give at least one candidate model")
    if not (0.0 <= st.target_fr < 1.0):
        raise ConfigError(f"--target-fr must be in [0, 1), got {st.target_fr}")
    manifest_path = Path(manifest_path)
    rows = read_manifest(manifest_path)
    clips, streams = _select_rows(rows, st.split)
    manifest_dir = manifest_path.resolve().parent

    baseline = load_scorer(baseline_path)
    cand_names = _unique_names(candidate_paths)
    candidates = {}
    for name, path in zip(cand_names, candidate_paths, strict=True):
        scorer = load_scorer(path)
        check_same_frontend(baseline, scorer, name=f"candidate {name} ({path})")
        candidates[name] = scorer
    models = {BASELINE: baseline, **candidates}

    windows = load_clip_windows(clips, manifest_dir, baseline.sample_rate, baseline.window_samples, st.progress)
    scores = {
        name: score_windows(m, windows, st.batch, desc=f"score {name}", progress=st.progress)
        for name, m in models.items()
    }
    del windows

    labels = np.array([r.label for r in clips])
    devices = np.array([r.device_type for r in clips])
    states = np.array([r.state for r in clips])
    speakers = np.array([r.speaker for r in clips])
    units = bootstrap_units(speakers)
    device_names = sorted(set(devices.tolist()))

    # Operating points: per device type, and one for the pooled set.
    scopes = {d: devices == d for d in device_names}
    scopes[ALL] = np.ones(len(clips), dtype=bool)
    thresholds: dict[str, dict[str, float]] = {}
    for scope, m in scopes.items():
        pos_b = scores[BASELINE][m & (labels == 1)]
        tb = baseline_threshold(pos_b, st.target_fr)
        thresholds[scope] = {BASELINE: tb}
        for name in candidates:
            thresholds[scope][name] = matched_threshold(scores[name][m & (labels == 1)], fr_at(pos_b, tb))

    # Streams: each model's false accepts at its threshold for the stream's device type.
    # (scope, model, stream path) -> detection times
    stream_events: dict[tuple[str, str, str], list[float]] = {}
    stream_rows_by_scope = {
        scope: [r for r in streams if scope == ALL or r.device_type == scope] for scope in scopes
    }
    if streams:
        cached = {name: CachedScorer(m) for name, m in models.items()}
        jobs = [(r, scope) for scope in scopes for r in stream_rows_by_scope[scope]]
        waves: dict[str, np.ndarray] = {}
        for r, scope in tqdm(jobs, desc="streams", unit="stream", disable=not st.progress):
            if r.path not in waves:
                waves[r.path] = load_audio(str(manifest_dir / r.path), sample_rate=baseline.sample_rate)
            for name in models:
                stream_events[(scope, name, r.path)] = stream_detections(
                    cached[name], waves[r.path], thresholds[scope][name], st
                )
            if scope == ALL:
                del waves[r.path]  # the pooled scope comes last: this stream is done

    out_rows: list[dict[str, Any]] = []
    det: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    op_points: dict[str, dict[str, tuple[float, float]]] = {}
    for scope, m in scopes.items():
        pos_m, neg_m = m & (labels == 1), m & (labels == 0)
        det[scope] = {name: det_curve(s[pos_m], s[neg_m]) for name, s in scores.items()} if neg_m.any() else {}
        op_points[scope] = (
            {
                name: (fa_at(s[neg_m], thresholds[scope][name]), fr_at(s[pos_m], thresholds[scope][name]))
                for name, s in scores.items()
            }
            if neg_m.any()
            else {}
        )
        present_states = [s for s in STATES if (m & (states == s)).any()]
        state_masks = {ALL: np.ones(int(neg_m.sum()), dtype=bool)}
        for s in present_states:
            state_masks[s] = states[neg_m] == s
        for name in candidates:
            cis = (
                bootstrap_relative_fa_by_subset(
                    scores[BASELINE][pos_m], scores[BASELINE][neg_m], scores[name][pos_m],
                    scores[name][neg_m], st.target_fr, state_masks,
                    groups=(units[pos_m], units[neg_m]), n_boot=st.n_boot,
                    seed=st.seed,
                )
                if neg_m.any()
                else {}
            )
            for state in [ALL, *present_states]:
                sm = m if state == ALL else m & (states == state)
                out_rows.append(
                    _row(
                        name, scope, state, sm, labels, speakers, scores, thresholds[scope],
                        cis.get(state, (None, None)), stream_rows_by_scope[scope], stream_events, st,
                    )
                )
    return EvalResult(
        rows=out_rows,
        det=det,
        operating_points=op_points,
        models={BASELINE: str(baseline_path), **{n: str(p) for n, p in zip(cand_names, candidate_paths, strict=True)}},
        settings=st,
        manifest=str(manifest_path),
        summary={
            "n_clips": len(clips),
            "n_streams": len(streams),
            "stream_hours": sum(r.duration_s for r in streams) / 3600.0,
            "device_types": device_names,
        },
    )


def _row(
    name: str, scope: str, state: str, m: np.ndarray, labels: np.ndarray, speakers: np.ndarray,
    scores: dict[str, np.ndarray], thr: dict[str, float], ci: tuple[float | None, float | None],
    scope_streams: list[ManifestRow], stream_events: dict[tuple[str, str, str], int],
    st: EvalSettings,
) -> dict[str, Any]:
    """One flat record: candidate vs baseline in one (device type, state)."""
    pos_m, neg_m = m & (labels == 1), m & (labels == 0)
    n_pos, n_neg = int(pos_m.sum()), int(neg_m.sum())
    notes = []
    tb, tc = thr[BASELINE], thr[name]
    if n_pos:
        fr_b, fr_c = fr_at(scores[BASELINE][pos_m], tb), fr_at(scores[name][pos_m], tc)
        rel_fr, note = safe_ratio(fr_c, fr_b, "FR")
        notes.append(note)
    else:
        fr_b = fr_c = rel_fr = None
        notes.append("no wake-word clips here: FR not measured")
    if n_neg:
        fa_b, fa_c = fa_at(scores[BASELINE][neg_m], tb), fa_at(scores[name][neg_m], tc)
        rel_fa, note = safe_ratio(fa_c, fa_b, "FA")
        notes.append(note)
    else:
        fa_b = fa_c = rel_fa = None
        notes.append("no negative clips here: FA not measured")

    srows = [r for r in scope_streams if state == ALL or r.state == state]
    hours = sum(r.duration_s for r in srows) / 3600.0
    if srows:
        times_b = [t for r in srows for t in stream_events[(scope, BASELINE, r.path)]]
        times_c = [t for r in srows for t in stream_events[(scope, name, r.path)]]
        ev_b, ev_c = len(times_b), len(times_c)
        fph_b = false_accepts_per_hour(times_b, hours)
        fph_c = false_accepts_per_hour(times_c, hours)
        rel_fph, note = safe_ratio(fph_c, fph_b, "FA/hour")
        notes.append(note)
    else:
        ev_b = ev_c = fph_b = fph_c = rel_fph = None
    if scope == ALL:
        notes.insert(0, "all device types pooled, one operating point")
    return {
        "candidate": name,
        "device_type": scope,
        "state": state,
        "target_fr": st.target_fr,
        "threshold": tc,
        "baseline_threshold": tb,
        "fr": _fmt_none(fr_c),
        "fa": _fmt_none(fa_c),
        "baseline_fr": _fmt_none(fr_b),
        "baseline_fa": _fmt_none(fa_b),
        "relative_fa": _fmt_none(rel_fa),
        "relative_fr": _fmt_none(rel_fr),
        "relative_fa_ci": [_fmt_none(ci[0]), _fmt_none(ci[1])],
        "fa_per_hour": _fmt_none(fph_c),
        "baseline_fa_per_hour": _fmt_none(fph_b),
        "relative_fa_per_hour": _fmt_none(rel_fph),
        "false_accept_events": ev_c,
        "baseline_false_accept_events": ev_b,
        "stream_hours": hours,
        "n_streams": len(srows),
        "n_positive": n_pos,
        "n_negative": n_neg,
        "n_speakers": len(set(speakers[m].tolist())),
        "note": "; ".join(n for n in notes if n),
    }
