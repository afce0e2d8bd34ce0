"""The figures and rows of `wakefl eval`: per cell and state, FA per hour of both models on
the long negative streams (flagged as saturated within 20% of its ceiling, one event per
refractory period), relative FR at matched FA per clip and per hour with a speaker
bootstrap, the flat result rows, and the DET curves with each model's operating point."""

from __future__ import annotations

from typing import Any

import numpy as np

from wakefl.sdk.manifest import ManifestRow
from wakefl.sdk.wake_metrics import (
    det_curve,
    fa_at,
    fa_per_hour_ceiling,
    false_accepts_per_hour,
    fr_at,
    interval_record,
    is_saturated,
    relative_fr_at_matched_clip_fa,
    relative_fr_at_matched_fa,
    safe_ratio,
)
from wakefl.tools.evaluation.cells import (
    ALL,
    BASELINE,
    PAIRED,
    Cell,
    ClipTable,
    LoadedModels,
    bootstrap_units,
    cell_scores,
)
from wakefl.tools.evaluation.model_scoring import StreamPosteriors, detection_times
from wakefl.tools.evaluation.settings import EvalSettings


def _saturation_note(note: str, sat_b: bool, sat_c: bool, ceiling: float) -> str:
    """`note`, with a warning appended when the baseline's or the candidate's FA/hour is
    saturated (within 20% of its ceiling)."""
    if not (sat_b or sat_c):
        return note
    who = " and ".join(w for w, s in (("baseline", sat_b), ("candidate", sat_c)) if s)
    return "; ".join(
        n
        for n in (
            note,
            f"FA/hour of the {who} saturated: within 20% of its ceiling "
            f"of {ceiling:.0f}/h (one event per refractory period), the "
            "real rate of false triggers may be higher",
        )
        if n
    )


def _stream_figures(
    cell: Cell,
    state: str,
    streams: list[ManifestRow],
    post: dict[tuple[str, str], StreamPosteriors],
    ceiling: float | None,
) -> dict[str, Any]:
    """FA per hour of both models on the cell's streams of `state`, at the cell's thresholds."""
    srows = [
        r for r in streams if r.device_type in cell.members and (state == ALL or r.state == state)
    ]
    hours = sum(r.duration_s for r in srows) / 3600.0
    out: dict[str, Any] = {
        "stream_hours": hours,
        "n_streams": len(srows),
        "fa_per_hour_ceiling": ceiling,
    }
    if not srows or cell.op is None or ceiling is None:  # no ceiling: no streams scored
        return {
            **out,
            "fa_per_hour": None,
            "baseline_fa_per_hour": None,
            "relative_fa_per_hour": None,
            "false_accept_events": None,
            "baseline_false_accept_events": None,
            "fa_per_hour_saturated": False,
            "baseline_fa_per_hour_saturated": False,
            "_note": "",
        }
    times_b = [
        t
        for r in srows
        for t in detection_times(post[(BASELINE, r.path)], cell.op.baseline_threshold)
    ]
    times_c = [
        t
        for r in srows
        for t in detection_times(
            post[(cell.members[r.device_type], r.path)], cell.op.candidate_threshold
        )
    ]
    ev_b, ev_c = len(times_b), len(times_c)
    fph_b, fph_c = false_accepts_per_hour(times_b, hours), false_accepts_per_hour(times_c, hours)
    rel, note = safe_ratio(fph_c, fph_b, "FA/hour")
    sat_b, sat_c = is_saturated(fph_b, ceiling), is_saturated(fph_c, ceiling)
    note = _saturation_note(note, sat_b, sat_c, ceiling)
    return {
        **out,
        "fa_per_hour": fph_c,
        "baseline_fa_per_hour": fph_b,
        "relative_fa_per_hour": rel,
        "false_accept_events": ev_c,
        "baseline_false_accept_events": ev_b,
        "fa_per_hour_saturated": sat_c,
        "baseline_fa_per_hour_saturated": sat_b,
        "_note": note,
    }


def _stream_fa_curve(
    post: dict[tuple[str, str], StreamPosteriors],
    srows: list[ManifestRow],
    model_of: dict[str, str],
    hours: float,
) -> Any:
    """False accepts per hour on `srows` at any thresholds, each stream scored by the model
    `model_of` names for its device type."""

    def curve(thresholds: np.ndarray) -> np.ndarray:
        return np.array(
            [
                sum(len(detection_times(post[(model_of[r.device_type], r.path)], t)) for r in srows)
                / hours
                for t in np.asarray(thresholds, dtype=np.float64)
            ]
        )

    return curve


def _matched_fa_figures(
    cell: Cell,
    scores: dict[str, np.ndarray],
    clips: ClipTable,
    streams: list[ManifestRow],
    post: dict[tuple[str, str], StreamPosteriors],
    st: EvalSettings,
) -> dict[str, Any]:
    """Relative FR at matched FA of one cell: per clip, and per hour on its streams (both
    with a speaker bootstrap), plus the FA/hour one event on those streams amounts to."""
    out: dict[str, Any] = {
        "relative_fr_at_matched_clip_fa": None,
        "relative_fr_at_matched_fa_per_hour": None,
        "fa_per_hour_resolution": None,
    }
    if cell.op is None:
        return out
    lab = clips.labels[cell.mask]
    pos, neg = lab == 1, lab == 0
    base, cand = scores[BASELINE][cell.mask], cell_scores(cell, scores, clips)
    units = bootstrap_units(clips.speakers[cell.mask])
    tb = cell.op.baseline_threshold
    if neg.any():  # a user's own recordings may hold negatives only as streams
        out["relative_fr_at_matched_clip_fa"] = relative_fr_at_matched_clip_fa(
            base[pos], base[neg], cand[pos], cand[neg], st.target_fr, (units[pos], units[neg]),
            st.n_boot, st.seed, baseline_thr=tb,
        ).as_record()  # fmt: skip
    srows = [r for r in streams if r.device_type in cell.members]
    hours = sum(r.duration_s for r in srows) / 3600.0
    if not srows or hours <= 0:
        return out
    fa_b = _stream_fa_curve(post, srows, dict.fromkeys(cell.members, BASELINE), hours)
    fa_c = _stream_fa_curve(post, srows, cell.members, hours)
    out["relative_fr_at_matched_fa_per_hour"] = relative_fr_at_matched_fa(
        base[pos], cand[pos], fa_b, fa_c, float(fa_b(np.array([tb]))[0]), units[pos],
        st.n_boot, st.seed,
    ).as_record()  # fmt: skip
    out["fa_per_hour_resolution"] = 1.0 / hours
    return out


def _row(
    cell: Cell,
    state: str,
    clips: ClipTable,
    streams: dict[str, Any],
    st: EvalSettings,
    models: LoadedModels,
) -> dict[str, Any]:
    """One flat record: candidate vs baseline in one (device type, state)."""
    fig = cell.figures[state]
    in_state = cell.mask & (clips.states == state) if state != ALL else cell.mask
    notes = [*fig.notes, streams.pop("_note")]
    if cell.scope == ALL:
        notes.insert(0, "all device types pooled, one operating point")
    if cell.name == PAIRED:
        notes.insert(
            0,
            "each device type scored by its own model: "
            + ", ".join(f"{d}={n}" for d, n in sorted(cell.members.items())),
        )
    op = cell.op
    return {
        "candidate": cell.name,
        "device_type": cell.scope,
        "state": state,
        "operating_point": "shipped threshold" if op is not None and op.shipped else "target FR",
        "target_fr": None if op is not None and op.shipped else st.target_fr,
        "threshold": None if op is None else op.candidate_threshold,
        "baseline_threshold": None if op is None else op.baseline_threshold,
        "fr": fig.candidate_fr,
        "fa": fig.candidate_fa,
        "baseline_fr": fig.baseline_fr,
        "baseline_fa": fig.baseline_fa,
        "relative_fa": fig.relative_fa,
        "relative_fr": fig.relative_fr,
        "relative_fa_ci": interval_record(fig.relative_fa_ci, fig.relative_fa, fig.n_negative > 0),
        **streams,
        "n_positive": fig.n_positive,
        "n_negative": fig.n_negative,
        "n_speakers": len(set(clips.speakers[in_state].tolist())),
        "models": {d: models.paths[n] for d, n in sorted(cell.members.items())}
        if cell.name == PAIRED
        else None,
        "note": "; ".join(n for n in notes if n),
    }


def det_curves(
    cells: list[Cell], scores: dict[str, np.ndarray], clips: ClipTable
) -> tuple[dict, dict]:
    det: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    op_points: dict[str, dict[str, tuple[float, float]]] = {}
    for cell in cells:
        if cell.op is None:
            continue
        lab = clips.labels[cell.mask]
        base, cand = scores[BASELINE][cell.mask], cell_scores(cell, scores, clips)
        curves, ops = det.setdefault(cell.scope, {}), op_points.setdefault(cell.scope, {})
        for name, s, t in (
            (BASELINE, base, cell.op.baseline_threshold),
            (cell.name, cand, cell.op.candidate_threshold),
        ):
            if name not in curves and (lab == 0).any():  # a DET curve needs negative clips
                curves[name] = det_curve(s[lab == 1], s[lab == 0])
                ops[name] = (fa_at(s[lab == 0], t), fr_at(s[lab == 1], t))
    return det, op_points


def eval_rows(
    cells: list[Cell],
    scores: dict[str, np.ndarray],
    clips: ClipTable,
    streams: list[ManifestRow],
    post: dict[tuple[str, str], StreamPosteriors],
    st: EvalSettings,
    models: LoadedModels,
) -> list[dict[str, Any]]:
    """A row per (cell, state); the cell's relative FR at matched FA on its `all` row."""
    ceiling = _events_ceiling(post)
    rows = []
    for cell in cells:
        for state in cell.figures:
            row = _row(
                cell, state, clips, _stream_figures(cell, state, streams, post, ceiling), st, models
            )
            if state == ALL:
                row.update(_matched_fa_figures(cell, scores, clips, streams, post, st))
            rows.append(row)
    return rows


def _events_ceiling(post: dict[tuple[str, str], StreamPosteriors]) -> float | None:
    """The FA/hour ceiling of the streaming detector (None without streams)."""
    first = next(iter(post.values()), None)
    return (
        fa_per_hour_ceiling(
            first.hop_samples / first.sample_rate, first.refractory_samples / first.sample_rate
        )
        if first
        else None
    )
