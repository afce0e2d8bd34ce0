"""The evaluation runner behind `wakefl eval`: candidates against a baseline, per device
type and device state, with relative FA at matched FR, bootstrap intervals over speakers,
DET curves, and false accepts per hour on the long negative streams.

Operating points. For each device type the baseline works at one threshold: either fitted
on that device type's clips of the split (largest threshold with FR <= target, see
`wakefl.sdk.wake_metrics`), or the threshold it ships with (`--threshold`, a thresholds file
per device type, or the model card's with `--at-shipped-threshold`), which is what a device
maker needs to know on new recordings. Each candidate's threshold is matched to the FR the
baseline has there, on the same clips. A device ships one threshold, not one per state, so
the per-state rows evaluate both models at their device-type thresholds: their relative FR
shows how well the match holds within a state. The figures come from the one routine the
paper study uses too, `wakefl.sdk.wake_metrics.relative_by_subset`.

The device type "all" pools every device type with its own operating point on the pooled
clips. A candidate paired with a device type (`model.onnx:A`, or a pairing file) is scored
only on that device type's clips and streams; the pooled row of the paired models ("paired")
scores each device type's clips with that device type's own model.

Streams are scored in batches of windows cut from the whole stream (`stream_posteriors`),
which gives the streaming detector's posteriors and events bit for bit, once per model and
stream; events at each threshold then cost next to nothing. FA per hour within 20% of its
ceiling (one event per refractory period) is flagged as saturated.

This module holds the run; its settings are in `settings`, the inputs (pairing, shipped thresholds) are in
`inputs`, the models, clips, cells and stream posteriors in `cells`, and the stream
figures, relative FR at matched FA, rows and DET curves in `figures`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.sdk.manifest import ManifestRow, read_manifest
from wakefl.tools.evaluation.cells import (
    ALL,
    BASELINE,
    NO_SPEECH_PREFIX,
    PAIRED,
    Cell,
    LoadedModels,
    bootstrap_units,
    clip_table,
    fill_cell,
    load_models,
    plan_cells,
    score_clips,
    select_rows,
    stream_detections,
    stream_posteriors_by_model,
)
from wakefl.tools.evaluation.figures import det_curves, eval_rows
from wakefl.tools.evaluation.inputs import (
    CandidateSpec,
    baseline_thresholds,
    card_threshold,
    parse_candidate,
    read_pairing,
    read_thresholds,
)
from wakefl.tools.evaluation.settings import EvalSettings

# The names `wakefl eval`'s engine has always offered here, wherever they now live.
__all__ = [
    "ALL",
    "BASELINE",
    "NO_SPEECH_PREFIX",
    "PAIRED",
    "CandidateSpec",
    "EvalResult",
    "EvalSettings",
    "bootstrap_units",
    "card_threshold",
    "parse_candidate",
    "read_pairing",
    "read_thresholds",
    "run_evaluation",
    "stream_detections",
]


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


def _check_settings(st: EvalSettings) -> None:
    if not (0.0 <= st.target_fr < 1.0):
        raise ConfigError(f"--target-fr must be in [0, 1), got {st.target_fr}")
    if st.n_boot < 1 or st.batch < 1:
        raise ConfigError(f"--n-boot and --batch must be at least 1, got {st.n_boot}, {st.batch}")


def run_evaluation(
    baseline_path: str | Path,
    candidates: Sequence[str | Path | CandidateSpec],
    manifest_path: str | Path,
    settings: EvalSettings | None = None,
) -> EvalResult:
    """Evaluate every candidate against the baseline on the manifest's split. A candidate
    is a path (every device type), `path:DEVICE` or a `CandidateSpec` (one device type)."""
    st = settings or EvalSettings()
    _check_settings(st)
    if not candidates:
        raise ConfigError("give at least one candidate model")
    specs = [c if isinstance(c, CandidateSpec) else parse_candidate(str(c)) for c in candidates]
    manifest_path = Path(manifest_path)
    clip_rows, streams = select_rows(read_manifest(manifest_path), st.split)
    manifest_dir = manifest_path.resolve().parent
    clips = clip_table(clip_rows)
    devices = sorted(set(clips.devices.tolist()))
    models = load_models(baseline_path, specs, devices)
    shipped = baseline_thresholds(st, baseline_path, devices)
    scores = score_clips(models, clips, manifest_dir, st)

    cells: list[Cell] = []
    skipped: list[str] = []
    for cell in plan_cells(models, clips, devices):
        if fill_cell(cell, scores, clips, shipped, st):
            cells.append(cell)
        else:
            skipped.append(cell.name)
    post = stream_posteriors_by_model(cells, models, streams, manifest_dir, st)
    rows = eval_rows(cells, scores, clips, streams, post, st, models)
    det, op_points = det_curves(cells, scores, clips)
    return EvalResult(
        rows=rows,
        det=det,
        operating_points=op_points,
        models=dict(models.paths),
        settings=st,
        manifest=str(manifest_path),
        summary=_summary(clip_rows, streams, devices, shipped, models, skipped),
    )


def _summary(
    clip_rows: list[ManifestRow],
    streams: list[ManifestRow],
    devices: list[str],
    shipped: dict[str, float] | None,
    models: LoadedModels,
    skipped: list[str],
) -> dict[str, Any]:
    """What was evaluated: clip and stream counts, device types, shipped thresholds, the
    paired models and the pooled rows left out."""
    return {
        "n_clips": len(clip_rows),
        "n_streams": len(streams),
        "stream_hours": sum(r.duration_s for r in streams) / 3600.0,
        "device_types": devices,
        "baseline_thresholds": shipped,
        "paired": dict(models.paired),
        "pooled_rows_skipped": (
            {
                "candidates": skipped,
                "why": "the device types ship different thresholds, so the "
                "pooled set has no single operating point",
            }
            if skipped
            else None
        ),
    }
