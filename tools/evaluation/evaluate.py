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
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from wakefl.errors import ConfigError
from wakefl.progress_bars import bar_disabled
from wakefl.sdk.manifest import STATES, ManifestRow, read_manifest
from wakefl.sdk.wake_metrics import (
    CellFigures,
    OperatingPoint,
    det_curve,
    fa_at,
    fa_per_hour_ceiling,
    false_accepts_per_hour,
    fr_at,
    interval_record,
    is_saturated,
    relative_by_subset,
    relative_fr_at_matched_clip_fa,
    relative_fr_at_matched_fa,
    safe_ratio,
)
from wakefl.tools.evaluation.model_scoring import (
    StreamPosteriors,
    check_same_frontend,
    detection_times,
    load_clip_windows,
    load_scorer,
    score_windows,
    stream_posteriors,
)

ALL = "all"
BASELINE = "baseline"
# Row name of the pooled figures of the candidates paired with one device type each.
PAIRED = "paired"
_NAME_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


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
    # The baseline's shipped threshold: one for every device type, or one per device type
    # (key "*": every device type not named). None: fitted to `target_fr`.
    threshold: float | dict[str, float] | None = None
    at_shipped_threshold: bool = False  # take the threshold from the baseline's model card


@dataclass(frozen=True)
class CandidateSpec:
    """A candidate model and the device type it is paired with (None: every device type)."""

    path: str
    device_type: str | None = None


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


# --------------------------------------------------------------------------------------
# Inputs: candidate pairing, shipped thresholds
# --------------------------------------------------------------------------------------


def _is_name(text: str) -> bool:
    return bool(text) and set(text) <= _NAME_CHARS and text[0] not in "_.-"


def parse_candidate(spec: str) -> CandidateSpec:
    """`model.onnx` (every device type) or `model.onnx:A` (device type A only). A path that
    exists as given is never split, so a file name holding ':' still works."""
    text = spec.strip()
    if Path(text).is_file() or ":" not in text:
        return CandidateSpec(text)
    path, _, device = text.rpartition(":")
    device = device.strip()
    if not _is_name(device):
        raise ConfigError(
            f"--candidate {spec!r}: {device!r} after ':' is not a device type name "
            "(letters, digits, '_', '-', '.')"
        )
    return CandidateSpec(path.strip(), device)


def read_pairing(path: str | Path) -> list[CandidateSpec]:
    """A pairing file: CSV with columns `model,device_type` (model paths relative to the
    file's folder), one personalized model per device type."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"pairing file not found: {path}")
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in reader.fieldnames or []]
        if not {"model", "device_type"} <= set(header):
            raise ConfigError(
                f"{path}: a pairing file needs the columns model,device_type; got {','.join(header)}"
            )
        reader.fieldnames = header
        out = []
        for line, rec in enumerate(reader, start=2):
            model, device = (rec.get("model") or "").strip(), (rec.get("device_type") or "").strip()
            if not model or not _is_name(device):
                raise ConfigError(
                    f"{path}:{line}: needs a model path and a device type name, got "
                    f"{model!r}, {device!r}"
                )
            out.append(
                CandidateSpec(
                    str(path.parent / model) if not Path(model).is_absolute() else model, device
                )
            )
    if not out:
        raise ConfigError(f"{path}: the pairing file lists no models")
    return out


def _check_threshold(value: Any, where: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0.0 <= value <= 1.0
    ):
        raise ConfigError(f"{where}: a threshold must be a number in [0, 1], got {value!r}")
    return float(value)


def read_thresholds(path: str | Path) -> dict[str, float]:
    """A thresholds file per device type: JSON `{"A": 0.62, "B": 0.55, "*": 0.6}` or CSV
    with columns `device_type,threshold` ("*" stands for every device type not named)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"thresholds file not found: {path}")
    text = path.read_text(encoding="utf-8-sig")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict) or not data:
            raise ConfigError(f"{path}: expected a JSON object of device type -> threshold")
        items = list(data.items())
    else:
        rows = list(csv.DictReader(text.splitlines()))
        if not rows or not {"device_type", "threshold"} <= set(rows[0]):
            raise ConfigError(
                f"{path}: a CSV thresholds file needs the columns device_type,threshold"
            )
        items = []
        for r in rows:
            try:
                items.append((r["device_type"].strip(), float(r["threshold"])))
            except (TypeError, ValueError):
                raise ConfigError(f"{path}: threshold {r['threshold']!r} is not a number") from None
    return {str(k).strip(): _check_threshold(v, f"{path}: device type {k!r}") for k, v in items}


def card_threshold(model_path: str | Path) -> float | dict[str, float] | None:
    """The shipped threshold in a model's card: key `shipped_threshold` (a number, or an
    object of device type -> number) in the JSON beside the model (`<model>.json`, the
    config a checkpoint is saved with), or in an ONNX file's metadata. None: no card says."""
    path = Path(model_path)
    value: Any = None
    card = path.with_suffix(".json")
    if card.is_file():
        try:
            value = json.loads(card.read_text(encoding="utf-8")).get("shipped_threshold")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ConfigError(f"{card}: model card is not a JSON object ({exc})") from None
    if value is None and path.suffix.lower() == ".onnx":
        import onnx

        meta = {
            p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props
        }
        if "shipped_threshold" in meta:
            try:
                value = json.loads(meta["shipped_threshold"])
            except json.JSONDecodeError:
                raise ConfigError(f"{path}: metadata shipped_threshold is not JSON") from None
    if value is None:
        return None
    if isinstance(value, dict):
        return {
            str(k): _check_threshold(v, f"{path}: shipped_threshold[{k!r}]")
            for k, v in value.items()
        }
    return _check_threshold(value, f"{path}: shipped_threshold")


def _shipped_for(setting: float | dict[str, float] | None, device: str) -> float | None:
    if setting is None or isinstance(setting, float):
        return setting
    return setting.get(device, setting.get("*"))


# --------------------------------------------------------------------------------------
# Models and clips
# --------------------------------------------------------------------------------------


@dataclass
class _Models:
    scorers: dict[str, Any]  # model name -> scorer, the baseline first
    paths: dict[str, str]
    paired: dict[str, str]  # device type -> the name of the model paired with it
    unpaired: list[str]  # candidates scored on every device type


@dataclass
class _Clips:
    rows: list[ManifestRow]
    labels: np.ndarray
    devices: np.ndarray
    states: np.ndarray
    speakers: np.ndarray


@dataclass(eq=False)
class _Cell:
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


def _load_models(
    baseline_path: str | Path, specs: Sequence[CandidateSpec], devices: list[str]
) -> _Models:
    baseline = load_scorer(baseline_path)
    models = _Models({BASELINE: baseline}, {BASELINE: str(baseline_path)}, {}, [])
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


def _select_rows(
    rows: list[ManifestRow], split: str
) -> tuple[list[ManifestRow], list[ManifestRow]]:
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


def _clip_table(clips: list[ManifestRow]) -> _Clips:
    speakers = np.array([r.speaker for r in clips])
    return _Clips(
        clips,
        np.array([r.label for r in clips]),
        np.array([r.device_type for r in clips]),
        np.array([r.state for r in clips]),
        speakers,
    )


def _score_clips(
    models: _Models, clips: _Clips, manifest_dir: Path, st: EvalSettings
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


# --------------------------------------------------------------------------------------
# Operating points and clip figures
# --------------------------------------------------------------------------------------


def _baseline_thresholds(
    st: EvalSettings, baseline_path: str | Path, devices: list[str]
) -> dict[str, float] | None:
    """The baseline's shipped threshold per device type, or None to fit it to the target FR."""
    setting = st.threshold
    if st.at_shipped_threshold:
        if setting is not None:
            raise ConfigError(
                "--at-shipped-threshold takes the baseline card's threshold: do not "
                "also give --threshold or --thresholds"
            )
        setting = card_threshold(baseline_path)
        if setting is None:
            raise ConfigError(
                f"--at-shipped-threshold: the baseline {baseline_path} has no model card "
                "with a shipped_threshold (in its .json or ONNX metadata); give --threshold"
            )
    if setting is None:
        return None
    if not isinstance(setting, dict):
        setting = float(_check_threshold(setting, "--threshold"))
    out = {d: _shipped_for(setting, d) for d in devices}
    missing = [d for d, t in out.items() if t is None]
    if missing:
        raise ConfigError(
            f"no shipped threshold for device type(s) {', '.join(missing)}; name them "
            'in the thresholds file or give a "*" entry'
        )
    return {d: float(t) for d, t in out.items() if t is not None}


def _plan_cells(models: _Models, clips: _Clips, devices: list[str]) -> list[_Cell]:
    """The (scope, row candidate) cells: per device type every candidate evaluated there;
    pooled, every unpaired candidate and the paired models together."""
    cells = []
    for d in devices:
        names = [*models.unpaired, *([models.paired[d]] if d in models.paired else [])]
        cells += [_Cell(d, n, {d: n}, clips.devices == d) for n in names]
    cells += [
        _Cell(ALL, n, dict.fromkeys(devices, n), np.ones(len(clips.rows), bool))
        for n in models.unpaired
    ]
    if models.paired:
        cells.append(
            _Cell(ALL, PAIRED, dict(models.paired), np.isin(clips.devices, list(models.paired)))
        )
    return cells


def _cell_scores(cell: _Cell, scores: dict[str, np.ndarray], clips: _Clips) -> np.ndarray:
    out = np.full(len(clips.rows), np.nan)
    for d, name in cell.members.items():
        m = clips.devices == d
        out[m] = scores[name][m]
    return out[cell.mask]


def _pooled_threshold(shipped: dict[str, float], members: dict[str, str]) -> float | None:
    values = {shipped[d] for d in members}
    return values.pop() if len(values) == 1 else None


def _fill_cell(
    cell: _Cell,
    scores: dict[str, np.ndarray],
    clips: _Clips,
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
        _cell_scores(cell, scores, clips),
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


# --------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------


def stream_detections(
    scorer: Any, wave: np.ndarray, threshold: float, settings: EvalSettings
) -> list[float]:
    """Times (s) of the detections the edge runtime's streaming detector raises on `wave`
    (scored in batches; the same events bit for bit)."""
    post = stream_posteriors(
        scorer, wave, settings.hop_s, settings.smoothing, settings.refractory_s, settings.batch
    )
    return detection_times(post, threshold)


def _stream_posteriors(
    cells: list[_Cell],
    models: _Models,
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


# --------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------


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
    cell: _Cell,
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
    cell: _Cell,
    scores: dict[str, np.ndarray],
    clips: _Clips,
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
    base, cand = scores[BASELINE][cell.mask], _cell_scores(cell, scores, clips)
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
    cell: _Cell,
    state: str,
    clips: _Clips,
    streams: dict[str, Any],
    st: EvalSettings,
    models: _Models,
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


def _det_curves(
    cells: list[_Cell], scores: dict[str, np.ndarray], clips: _Clips
) -> tuple[dict, dict]:
    det: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    op_points: dict[str, dict[str, tuple[float, float]]] = {}
    for cell in cells:
        if cell.op is None:
            continue
        lab = clips.labels[cell.mask]
        base, cand = scores[BASELINE][cell.mask], _cell_scores(cell, scores, clips)
        curves, ops = det.setdefault(cell.scope, {}), op_points.setdefault(cell.scope, {})
        for name, s, t in (
            (BASELINE, base, cell.op.baseline_threshold),
            (cell.name, cand, cell.op.candidate_threshold),
        ):
            if name not in curves and (lab == 0).any():  # a DET curve needs negative clips
                curves[name] = det_curve(s[lab == 1], s[lab == 0])
                ops[name] = (fa_at(s[lab == 0], t), fr_at(s[lab == 1], t))
    return det, op_points


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
    clip_rows, streams = _select_rows(read_manifest(manifest_path), st.split)
    manifest_dir = manifest_path.resolve().parent
    clips = _clip_table(clip_rows)
    devices = sorted(set(clips.devices.tolist()))
    models = _load_models(baseline_path, specs, devices)
    shipped = _baseline_thresholds(st, baseline_path, devices)
    scores = _score_clips(models, clips, manifest_dir, st)

    cells: list[_Cell] = []
    skipped: list[str] = []
    for cell in _plan_cells(models, clips, devices):
        if _fill_cell(cell, scores, clips, shipped, st):
            cells.append(cell)
        else:
            skipped.append(cell.name)
    post = _stream_posteriors(cells, models, streams, manifest_dir, st)
    rows = _rows(cells, scores, clips, streams, post, st, models)
    det, op_points = _det_curves(cells, scores, clips)
    return EvalResult(
        rows=rows,
        det=det,
        operating_points=op_points,
        models=dict(models.paths),
        settings=st,
        manifest=str(manifest_path),
        summary=_summary(clip_rows, streams, devices, shipped, models, skipped),
    )


def _rows(
    cells: list[_Cell],
    scores: dict[str, np.ndarray],
    clips: _Clips,
    streams: list[ManifestRow],
    post: dict[tuple[str, str], StreamPosteriors],
    st: EvalSettings,
    models: _Models,
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


def _summary(
    clip_rows: list[ManifestRow],
    streams: list[ManifestRow],
    devices: list[str],
    shipped: dict[str, float] | None,
    models: _Models,
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
