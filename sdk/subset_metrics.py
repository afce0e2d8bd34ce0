"""The figures of one evaluation cell (a device type and state) that `wakefl eval` and the
paper study both report, DET curves, false accepts per hour with their ceiling, and a
device's local report. Conventions: sdk/wake_metrics.py."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from wakefl.sdk.matched_fr import (
    RelativeResult,
    baseline_threshold,
    bootstrap_relative_fa_by_subset,
    bootstrap_relative_fa_ci,
    check_rate,
    checked_scores,
    fa_at,
    fr_at,
    matched_threshold,
    relative_fa_fr,
    safe_ratio,
)

# Note of a set that has no wake-word or no other clips: no operating point can be set.
NO_CELL_NOTE = "no wake-word or no other clips in this cell"


@dataclass(frozen=True)
class OperatingPoint:
    """Both models' thresholds on one set: the baseline's (fitted to a target FR, or the
    shipped one) and the candidate's, matched to the baseline's FR on that set."""

    baseline_threshold: float
    candidate_threshold: float
    baseline_fr: float
    shipped: bool


def operating_point(
    base_pos: Sequence[float] | np.ndarray,
    cand_pos: Sequence[float] | np.ndarray,
    target_fr: float,
    baseline_thr: float | None = None,
) -> OperatingPoint:
    """The baseline's threshold (`baseline_thr` when given, else fitted to `target_fr`)
    and the candidate's threshold matched to the FR the baseline has there."""
    bp = checked_scores(base_pos, "base_pos")
    if baseline_thr is None:
        tb = baseline_threshold(bp, target_fr)
    elif not math.isfinite(baseline_thr):
        raise ValueError(f"baseline threshold must be finite, got {baseline_thr!r}")
    else:
        tb = float(baseline_thr)
    fr_b = fr_at(bp, tb)
    return OperatingPoint(tb, matched_threshold(cand_pos, fr_b), fr_b, baseline_thr is not None)


@dataclass(frozen=True)
class CellFigures:
    """Candidate vs baseline on one subset of a set, at the set's operating point. A
    figure is None where the subset has no clips to measure it on (`notes` says so)."""

    n_positive: int
    n_negative: int
    baseline_fr: float | None = None
    candidate_fr: float | None = None
    baseline_fa: float | None = None
    candidate_fa: float | None = None
    baseline_fa_count: int | None = None
    candidate_fa_count: int | None = None
    relative_fa: float | None = None
    relative_fr: float | None = None
    relative_fa_ci: tuple[float | None, float | None] = (None, None)
    notes: tuple[str, ...] = ()

    @property
    def note(self) -> str:
        return "; ".join(n for n in self.notes if n)


def _cell_figures(
    base: np.ndarray,
    cand: np.ndarray,
    pos: np.ndarray,
    neg: np.ndarray,
    op: OperatingPoint,
    ci: tuple[float | None, float | None],
) -> CellFigures:
    """Phase 2 of `relative_by_subset`: one subset's counts and ratios at `op`."""
    n_pos, n_neg = int(np.count_nonzero(pos)), int(np.count_nonzero(neg))
    tb, tc = op.baseline_threshold, op.candidate_threshold
    fig: dict = {"n_positive": n_pos, "n_negative": n_neg}
    notes = []
    if n_pos:
        fig["baseline_fr"], fig["candidate_fr"] = fr_at(base[pos], tb), fr_at(cand[pos], tc)
        fig["relative_fr"], note = safe_ratio(fig["candidate_fr"], fig["baseline_fr"], "FR")
        notes.append(note)
    else:
        notes.append("no wake-word clips here: FR not measured")
    if n_neg:
        fig["baseline_fa_count"] = int(np.count_nonzero(base[neg] >= tb))
        fig["candidate_fa_count"] = int(np.count_nonzero(cand[neg] >= tc))
        fig["baseline_fa"], fig["candidate_fa"] = fa_at(base[neg], tb), fa_at(cand[neg], tc)
        fig["relative_fa"], note = safe_ratio(fig["candidate_fa"], fig["baseline_fa"], "FA")
        fig["relative_fa_ci"] = ci
        notes.insert(0, note)
    else:
        notes.insert(0, "no negative clips here: FA not measured")
    return CellFigures(**fig, notes=tuple(n for n in notes if n))


def _subset_inputs(
    base_scores: Sequence[float] | np.ndarray,
    cand_scores: Sequence[float] | np.ndarray,
    labels: Sequence[int] | np.ndarray,
    units: Sequence[str] | np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The scores, labels and units as flat arrays; ValueError if their lengths differ."""
    base = checked_scores(base_scores, "base_scores")
    cand = checked_scores(cand_scores, "cand_scores")
    lab = np.asarray(labels).reshape(-1)
    grp = np.asarray(units, dtype=str).reshape(-1)
    if not (base.size == cand.size == lab.size == grp.size):
        raise ValueError(
            f"scores, labels and units differ in length: {base.size}, {cand.size}, "
            f"{lab.size}, {grp.size}"
        )
    return base, cand, lab, grp


def relative_by_subset(
    base_scores: Sequence[float] | np.ndarray,
    cand_scores: Sequence[float] | np.ndarray,
    labels: Sequence[int] | np.ndarray,
    units: Sequence[str] | np.ndarray,
    subsets: dict[str, np.ndarray],
    target_fr: float,
    n_boot: int,
    seed: int,
    baseline_thr: float | None = None,
) -> tuple[OperatingPoint | None, dict[str, CellFigures]]:
    """Relative FA/FR of a candidate against the baseline on subsets of one set of clips
    (e.g. the device states of a device type), the one routine behind `wakefl eval` and
    the paper study.

    Both models work at one operating point set on the whole set (see `operating_point`),
    as a device ships one threshold, not one per subset; each subset (a boolean mask over
    the clips) counts its false accepts and rejects at those thresholds, so its relative
    FR shows how well the match holds within it. The interval of each subset's relative
    FA is the paired bootstrap over `units` (`bootstrap_relative_fa_by_subset`), redoing
    the operating point in every replicate. Without wake-word clips in the whole set no
    operating point exists: (None, figures with counts only); without other clips it is
    set on the wake-word clips and no clip FA is measured.
    """
    base, cand, lab, grp = _subset_inputs(base_scores, cand_scores, labels, units)
    pos, neg = lab == 1, lab == 0
    masks = {k: np.asarray(m, dtype=bool).reshape(-1) for k, m in subsets.items()}
    # Negatives recorded as streams only: the operating point needs the wake-word clips alone.
    if not pos.any():
        return None, {
            k: CellFigures(
                int(np.count_nonzero(pos & m)),
                int(np.count_nonzero(neg & m)),
                notes=(NO_CELL_NOTE,),
            )
            for k, m in masks.items()
        }
    op = operating_point(base[pos], cand[pos], target_fr, baseline_thr)
    with_neg = {k: m[neg] for k, m in masks.items() if (neg & m).any()}
    if not with_neg:
        return op, {
            k: _cell_figures(base, cand, pos & m, neg & m, op, (None, None))
            for k, m in masks.items()
        }
    cis = bootstrap_relative_fa_by_subset(
        base[pos],
        base[neg],
        cand[pos],
        cand[neg],
        target_fr,
        with_neg,
        groups=(grp[pos], grp[neg]),
        n_boot=n_boot,
        seed=seed,
        baseline_thr=baseline_thr,
    )
    return op, {
        k: _cell_figures(base, cand, pos & m, neg & m, op, cis.get(k, (None, None)))
        for k, m in masks.items()
    }


def fa_per_hour_ceiling(hop_s: float, refractory_s: float) -> float:
    """The most detection events an hour can hold: events lie on the hop grid at least one
    refractory period apart, so one per ceil(refractory / hop) hops."""
    if not (hop_s > 0 and refractory_s >= 0):
        raise ValueError(f"hop_s must be > 0 and refractory_s >= 0, got {hop_s}, {refractory_s}")
    spacing = max(1, math.ceil(refractory_s / hop_s - 1e-9)) * hop_s
    return 3600.0 / spacing


# FA/hour within this share of its ceiling is reported as saturated.
SATURATION_SHARE = 0.8


def is_saturated(fa_per_hour: float | None, ceiling: float) -> bool:
    """Whether a FA/hour figure sits within 20% of its ceiling: the refractory period then
    caps the count, and the real rate of false triggers may be higher."""
    return fa_per_hour is not None and fa_per_hour >= SATURATION_SHARE * ceiling


def interval_record(ci: Sequence[float | None], point: float | None, measured: bool = True) -> dict:
    """A bootstrap interval as JSON with nothing left implicit: a bound that the
    bootstrap found infinite is the string "unbounded", and the note says why.
    `measured=False`: the subset has no clips to measure FA on."""
    lo, hi = ci
    if not measured:
        return {"lower": None, "upper": None, "note": "not measured: no negative clips here"}
    if lo is None and hi is None:
        if point is None:
            return {
                "lower": "unbounded",
                "upper": "unbounded",
                "note": "unbounded: the baseline makes no false accept here",
            }
        return {"lower": None, "upper": None, "note": "no interval: no resample could be evaluated"}
    rec: dict = {"lower": lo, "upper": hi, "note": ""}
    if hi is None:
        rec["upper"] = "unbounded"
        rec["note"] = (
            "upper bound unbounded: in some resamples the baseline makes no false "
            "accept while the candidate does"
        )
    return rec


def det_curve(
    pos: Sequence[float] | np.ndarray, neg: Sequence[float] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Detection error trade-off: (fa_rates, fr_rates) at every distinct score used as a
    threshold, plus one just above the highest score; ordered by increasing threshold, so FA
    falls and FR rises along the arrays.
    """
    p = np.sort(checked_scores(pos, "pos"))
    n = np.sort(checked_scores(neg, "neg"))
    uniq = np.unique(np.concatenate([p, n]))
    thr = np.append(uniq, np.nextafter(uniq[-1], np.inf))
    fr = np.searchsorted(p, thr, side="left") / p.size
    fa = (n.size - np.searchsorted(n, thr, side="left")) / n.size
    return fa, fr


def false_accepts_per_hour(event_times: Sequence[float] | np.ndarray, hours: float) -> float:
    """False accepts per hour of negative audio: detection events / hours.

    `event_times` are the detections (seconds) on audio that holds no wake word; the
    streaming detector's refractory period already merges the hits of one event.
    """
    times = checked_scores(event_times, "event_times", allow_empty=True)
    if not (math.isfinite(hours) and hours > 0):
        raise ValueError(f"hours must be a positive finite number, got {hours!r}")
    if np.any(times < 0):
        raise ValueError("event_times must be >= 0 s")
    return float(times.size) / float(hours)


def _uncertainty_statement(
    res: RelativeResult, ci: tuple[float | None, float | None], target_fr: float
) -> tuple[str, str]:
    """A plain-language statement of how far the figure can be trusted, and a level."""
    n_pos, n_neg = res.n_positive, res.n_negative
    parts = [f"Based on {n_pos} wake-word and {n_neg} other clips."]
    level = "low"
    if 1.0 / n_pos > target_fr:
        parts.append(
            f"With {n_pos} wake-word clips FR moves in steps of {1.0 / n_pos:.1%}, coarser "
            f"than the {target_fr:.1%} target, so the operating point is only approximate."
        )
        level = "high"
    fa_count = round(res.baseline_fa * n_neg)
    if fa_count == 0:
        parts.append(
            f"The baseline made no false accepts on these clips; with {n_neg} negatives a "
            f"false-accept rate up to {min(1.0, 3.0 / n_neg):.1%} cannot be ruled out."
        )
        level = "high"
    elif fa_count < 10:
        parts.append(f"The relative FA rests on only {fa_count} baseline false accept(s).")
        level = "high"
    low, high = ci
    if low is None and high is None:
        parts.append("No confidence interval could be computed.")
        level = "high"
    else:
        lo_txt = "unbounded" if low is None else f"{low:.2f}"
        hi_txt = "unbounded" if high is None else f"{high:.2f}"
        parts.append(f"95% bootstrap interval for relative FA: {lo_txt} to {hi_txt}.")
        if high is None or (low is not None and low <= 1.0 <= high):
            parts.append("The interval includes 1: the data cannot tell the two models apart.")
            if high is None or high - (low or 0.0) > 1.0:
                level = "high"
            elif level == "low":
                level = "moderate"
        elif high < 1.0:
            parts.append("The personal model makes fewer false accepts than the baseline.")
        else:
            parts.append("The personal model makes more false accepts than the baseline.")
    return " ".join(parts), level


def _paired_inputs(
    baseline_scores: Sequence[float] | np.ndarray,
    candidate_scores: Sequence[float] | np.ndarray,
    labels: Sequence[int] | np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Baseline scores, candidate scores and 0/1 labels of the same clips, checked."""
    base = checked_scores(baseline_scores, "baseline_scores", allow_empty=True)
    cand = checked_scores(candidate_scores, "candidate_scores", allow_empty=True)
    lab = np.asarray(labels).reshape(-1)
    if not (base.size == cand.size == lab.size):
        raise ValueError(
            f"baseline_scores, candidate_scores and labels differ in length: "
            f"{base.size}, {cand.size}, {lab.size}"
        )
    if not np.all(np.isin(lab, (0, 1))):
        raise ValueError("labels must be 0 or 1")
    return base, cand, lab


def local_relative_report(
    baseline_scores: Sequence[float] | np.ndarray,
    candidate_scores: Sequence[float] | np.ndarray,
    labels: Sequence[int] | np.ndarray,
    target_fr: float = 0.05,
    n_boot: int = 200,
    seed: int = 0,
) -> dict:
    """A device's report of its personal model against the baseline on local validation
    clips: relative FA/FR at matched FR, a bootstrap interval over clips, and a plain
    statement of how uncertain the figure is (local data is small). JSON-serialisable.

    Never raises for too little data: without positives or negatives the figures are None
    and `statement` says why.
    """
    base, cand, lab = _paired_inputs(baseline_scores, candidate_scores, labels)
    target_fr = check_rate(target_fr, "target_fr")
    is_pos = lab == 1
    n_pos, n_neg = int(np.count_nonzero(is_pos)), int(np.count_nonzero(~is_pos))
    report: dict = {
        "target_fr": target_fr,
        "relative_fa": None,
        "relative_fr": None,
        "ci": [None, None],
        "n_positive": n_pos,
        "n_negative": n_neg,
    }
    if n_pos == 0 or n_neg == 0:
        missing = "wake-word" if n_pos == 0 else "non-wake-word"
        report.update(
            uncertainty="undefined",
            note="",
            statement=f"No {missing} clips in the local validation data: relative FA/FR cannot be computed.",
        )
        return report
    bp, bn, cp, cn = base[is_pos], base[~is_pos], cand[is_pos], cand[~is_pos]
    res = relative_fa_fr(bp, bn, cp, cn, target_fr)
    ci = bootstrap_relative_fa_ci(bp, bn, cp, cn, target_fr, n_boot=n_boot, seed=seed)
    statement, level = _uncertainty_statement(res, ci, target_fr)
    report.update(
        relative_fa=res.relative_fa,
        relative_fr=res.relative_fr,
        ci=[ci[0], ci[1]],
        baseline_threshold=res.baseline_threshold,
        candidate_threshold=res.candidate_threshold,
        baseline_fr=res.baseline_fr,
        baseline_fa=res.baseline_fa,
        candidate_fr=res.candidate_fr,
        candidate_fa=res.candidate_fa,
        uncertainty=level,
        note=res.note,
        statement=statement,
    )
    return report
