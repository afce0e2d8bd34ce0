"""The models, clips and cells of `wakefl eval`: the models loaded and checked against the
baseline's front end, the split's clips and their scores, the (device type, candidate)
cells with their operating point and figures per state, and the streams' posteriors.

Streams are scored in batches of windows cut from the whole stream (`stream_posteriors`),
which gives the streaming detector's posteriors and events bit for bit, once per model and
stream; events at each threshold then cost next to nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from wakefl.errors import ConfigError
from wakefl.progress_bars import bar_disabled
from wakefl.sdk.manifest import STATES, ManifestRow
from wakefl.sdk.wake_metrics import CellFigures, OperatingPoint, relative_by_subset
from wakefl.tools.evaluation.inputs import CandidateSpec
from wakefl.tools.evaluation.model_scoring import (
    StreamPosteriors,
    check_same_frontend,
    detection_times,
    load_clip_windows,
    load_scorer,
    score_windows,
    stream_posteriors,
)
from wakefl.tools.evaluation.settings import EvalSettings

ALL = "all"
BASELINE = "baseline"
# Row name of the pooled figures of the candidates paired with one device type each.
PAIRED = "paired"


# The corpus builder gives every background-only clip of a split one pseudo-speaker name;
# the importer gives every background-only row its own `nospeech-` name.
NO_SPEECH_PREFIX = "nospeech-"


def bootstrap_units(speakers: Sequence[str] | np.ndarray) -> np.ndarray:
    """Resampling unit of each clip for the speaker bootstrap: its speaker, except that
    background-only clips (speaker `nospeech-<...>`) are each their own unit. They share
    no voice, and each has its own room and noise draw; resampling them as one block would
    drop or double every one of them at once and widen the interval for no reason."""
    spk = np.asarray(speakers, dtype=str).reshape(-1)
    out = spk.astype(object)
    for i in np.flatnonzero(np.char.startswith(spk, NO_SPEECH_PREFIX)):
        out[i] = f"{spk[i]}#{i}"
    return out.astype(str)


@dataclass
class LoadedModels:
    scorers: dict[str, Any]  # model name -> scorer, the baseline first
    paths: dict[str, str]
    paired: dict[str, str]  # device type -> the name of the model paired with it
    unpaired: list[str]  # candidates scored on every device type


@dataclass
class ClipTable:
    rows: list[ManifestRow]
    labels: np.ndarray
    devices: np.ndarray
    states: np.ndarray
    speakers: np.ndarray


@dataclass(eq=False)
class Cell:
    """One (scope, row candidate): which model scores each device type, the clips, the
    operating point and the figures per state."""

    scope: str
    name: str
    members: dict[str, str]  # device type -> model name
    mask: np.ndarray
    op: OperatingPoint | None = None
    figures: dict[str, CellFigures] = field(default_factory=dict)


def _unique_names(paths: Sequence[str | Path]) -> list[str]:
    """Candidate names for the tables: the file stem, or the path where stems collide."""
    stems = [Path(p).stem for p in paths]
    return [
        s if stems.count(s) == 1 and s not in (BASELINE, PAIRED) else str(p)
        for s, p in zip(stems, paths, strict=True)
    ]


def load_models(
    baseline_path: str | Path, specs: Sequence[CandidateSpec], devices: list[str]
) -> LoadedModels:
    baseline = load_scorer(baseline_path)
    models = LoadedModels({BASELINE: baseline}, {BASELINE: str(baseline_path)}, {}, [])
    for name, spec in zip(_unique_names([s.path for s in specs]), specs, strict=True):
        if spec.device_type is not None and spec.device_type not in devices:
            raise ConfigError(
                f"candidate {spec.path} is paired with device type {spec.device_type!r}, "
                f"which has no clips in the split (device types: {', '.join(devices)})"
            )
        if spec.device_type in models.paired:
            raise ConfigError(
                f"two candidates are paired with device type {spec.device_type!r} "
                f"({models.paths[models.paired[spec.device_type]]}, {spec.path}): the "
                "pooled row needs one model per device type; evaluate them in separate runs"
            )
        scorer = load_scorer(spec.path)
        check_same_frontend(baseline, scorer, name=f"candidate {name} ({spec.path})")
        models.scorers[name], models.paths[name] = scorer, spec.path
        if spec.device_type is None:
            models.unpaired.append(name)
        else:
            models.paired[spec.device_type] = name
    return models


def select_rows(rows: list[ManifestRow], split: str) -> tuple[list[ManifestRow], list[ManifestRow]]:
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


def clip_table(clips: list[ManifestRow]) -> ClipTable:
    speakers = np.array([r.speaker for r in clips])
    return ClipTable(
        clips,
        np.array([r.label for r in clips]),
        np.array([r.device_type for r in clips]),
        np.array([r.state for r in clips]),
        speakers,
    )


def score_clips(
    models: LoadedModels, clips: ClipTable, manifest_dir: Path, st: EvalSettings
) -> dict[str, np.ndarray]:
    """Each model's scores of the clips it is evaluated on (NaN elsewhere): a paired
    model scores only its device type's clips."""
    base = models.scorers[BASELINE]
    windows = load_clip_windows(
        clips.rows, manifest_dir, base.sample_rate, base.window_samples, st.progress
    )
    paired_to = {name: dt for dt, name in models.paired.items()}
    scores = {}
    for name, scorer in models.scorers.items():
        mask = (
            clips.devices == paired_to[name]
            if name in paired_to
            else np.ones(len(clips.rows), bool)
        )
        scores[name] = np.full(len(clips.rows), np.nan)
        scores[name][mask] = score_windows(
            scorer, windows[mask], st.batch, desc=f"score {name}", progress=st.progress
        )
    return scores


def plan_cells(models: LoadedModels, clips: ClipTable, devices: list[str]) -> list[Cell]:
    """The (scope, row candidate) cells: per device type every candidate evaluated there;
    pooled, every unpaired candidate and the paired models together."""
    cells = []
    for d in devices:
        names = [*models.unpaired, *([models.paired[d]] if d in models.paired else [])]
        cells += [Cell(d, n, {d: n}, clips.devices == d) for n in names]
    cells += [
        Cell(ALL, n, dict.fromkeys(devices, n), np.ones(len(clips.rows), bool))
        for n in models.unpaired
    ]
    if models.paired:
        cells.append(
            Cell(ALL, PAIRED, dict(models.paired), np.isin(clips.devices, list(models.paired)))
        )
    return cells


def cell_scores(cell: Cell, scores: dict[str, np.ndarray], clips: ClipTable) -> np.ndarray:
    out = np.full(len(clips.rows), np.nan)
    for d, name in cell.members.items():
        m = clips.devices == d
        out[m] = scores[name][m]
    return out[cell.mask]


def _pooled_threshold(shipped: dict[str, float], members: dict[str, str]) -> float | None:
    values = {shipped[d] for d in members}
    return values.pop() if len(values) == 1 else None


def fill_cell(
    cell: Cell,
    scores: dict[str, np.ndarray],
    clips: ClipTable,
    shipped: dict[str, float] | None,
    st: EvalSettings,
) -> bool:
    """Operating point and per-state figures of one cell; False when the pooled cell has
    no single shipped threshold (device types ship different ones)."""
    tb = None
    if shipped is not None:
        tb = shipped[cell.scope] if cell.scope != ALL else _pooled_threshold(shipped, cell.members)
        if tb is None:
            return False
    states = clips.states[cell.mask]
    subsets = {ALL: np.ones(states.size, bool)}
    subsets.update({s: states == s for s in STATES if (states == s).any()})
    cell.op, cell.figures = relative_by_subset(
        scores[BASELINE][cell.mask],
        cell_scores(cell, scores, clips),
        clips.labels[cell.mask],
        # Units numbered within the cell, as the study numbers them within a device type:
        # the same clips then resample alike in both.
        bootstrap_units(clips.speakers[cell.mask]),
        subsets,
        st.target_fr,
        st.n_boot,
        st.seed,
        baseline_thr=tb,
    )
    return True


def stream_detections(
    scorer: Any, wave: np.ndarray, threshold: float, settings: EvalSettings
) -> list[float]:
    """Times (s) of the detections the edge runtime's streaming detector raises on `wave`
    (scored in batches; the same events bit for bit)."""
    post = stream_posteriors(
        scorer, wave, settings.hop_s, settings.smoothing, settings.refractory_s, settings.batch
    )
    return detection_times(post, threshold)


def stream_posteriors_by_model(
    cells: list[Cell],
    models: LoadedModels,
    streams: list[ManifestRow],
    manifest_dir: Path,
    st: EvalSettings,
) -> dict[tuple[str, str], StreamPosteriors]:
    """(model, stream path) -> posteriors, for every model some cell evaluates on that
    stream's device type: each stream is decoded once and each model scores it once."""
    from wakefl.edge_runtime import load_audio

    needed: dict[str, set[str]] = {}
    for cell in cells:
        for d, name in cell.members.items():
            needed.setdefault(d, {BASELINE}).add(name)
    out: dict[tuple[str, str], StreamPosteriors] = {}
    rate = models.scorers[BASELINE].sample_rate
    for r in tqdm(
        [r for r in streams if r.device_type in needed],
        desc="streams",
        unit="stream",
        disable=bar_disabled(st.progress),
    ):
        wave = load_audio(str(manifest_dir / r.path), sample_rate=rate)
        for name in sorted(needed[r.device_type]):
            out[(name, r.path)] = stream_posteriors(
                models.scorers[name], wave, st.hop_s, st.smoothing, st.refractory_s, st.batch
            )
    return out
