"""Wake-word metrics: FR/FA at a threshold, relative FA at matched FR against a baseline,
bootstrap confidence intervals, DET curves and false accepts per hour.

One implementation used by the offline evaluation, by a device's local report and by the
experiments. Pure numpy, no I/O.

Conventions (every function below follows them):

* A score is accepted as the wake word when ``score >= threshold``; ties with the threshold
  accept. FR = share of wake-word scores ``< threshold``; FA = share of other scores
  ``>= threshold``.
* FR on n wake-word utterances can only take the values k/n, so a target FR is usually not
  hit exactly. The baseline's operating threshold is the LARGEST threshold whose FR is
  ``<= target_fr``: it is always one of the baseline's positive scores (a threshold between
  two scores has the FR of the next score above it and a higher FA). FR is compared with the
  target on counts, ``k <= target_fr * n`` (with a 1e-9 slack for floating point).
* The candidate's threshold is the one whose FR is closest to the baseline's achieved FR.
  Among thresholds with the same FR the largest is taken (it has the lowest FA). When two
  FR values are equally close, the LOWER FR wins: the candidate is never allowed to buy
  false accepts with extra false rejects. A candidate that scores exactly like the baseline
  therefore gets the baseline's threshold and relative FA = relative FR = 1 exactly.
* Ratios never come out as NaN or inf. ``x / 0`` is reported as ``None`` with a note saying
  the baseline's rate is 0; ``0 / 0`` is 1.0 (both models make no such error, so there is no
  measurable difference), also with a note.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from wakefl.errors import NonFiniteError

# Slack when comparing k/n with a target given as a decimal (0.05 * 20 is not exactly 1).
_COUNT_SLACK = 1e-9
# Two FR values closer than this are "equally close" to the target.
_TIE_SLACK = 1e-12


def _scores(x: Sequence[float] | np.ndarray, name: str, allow_empty: bool = False) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64).reshape(-1)
    if arr.size == 0 and not allow_empty:
        raise ValueError(f"{name}: no scores")
    if not np.all(np.isfinite(arr)):
        raise NonFiniteError(
            f"{name}: {int(np.count_nonzero(~np.isfinite(arr)))} non-finite score(s)"
        )
    return arr


def _check_rate(value: float, name: str) -> float:
    if not (
        isinstance(value, (int, float, np.floating)) and math.isfinite(value) and 0.0 <= value < 1.0
    ):
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def fr_at(pos_scores: Sequence[float] | np.ndarray, thr: float) -> float:
    """False-reject rate: share of wake-word scores strictly below `thr`."""
    pos = _scores(pos_scores, "pos_scores")
    return float(np.count_nonzero(pos < thr)) / pos.size


def fa_at(neg_scores: Sequence[float] | np.ndarray, thr: float) -> float:
    """False-accept rate per utterance: share of non-wake-word scores at or above `thr`."""
    neg = _scores(neg_scores, "neg_scores")
    return float(np.count_nonzero(neg >= thr)) / neg.size


def baseline_threshold(pos_scores: Sequence[float] | np.ndarray, target_fr: float) -> float:
    """The largest threshold whose FR is <= `target_fr` (see the module docstring).

    It is always one of the positive scores; with target_fr = 0 it is the smallest one.
    """
    pos = np.sort(_scores(pos_scores, "pos_scores"))
    target_fr = _check_rate(target_fr, "target_fr")
    grid = np.unique(pos)
    rejected = np.searchsorted(pos, grid, side="left")  # k = #scores < threshold
    ok = rejected <= target_fr * pos.size + _COUNT_SLACK
    # grid[0] rejects nothing, so at least one threshold qualifies.
    return float(grid[np.flatnonzero(ok)[-1]])


def matched_threshold(cand_pos: Sequence[float] | np.ndarray, target_fr_value: float) -> float:
    """The candidate's threshold whose FR is closest to `target_fr_value` (the baseline's
    achieved FR). Equal FR: the largest threshold (lowest FA). Equally close FR values: the
    lower FR. The threshold just above the highest score (FR = 1) is a candidate too.
    """
    pos = np.sort(_scores(cand_pos, "cand_pos"))
    if not (math.isfinite(target_fr_value) and 0.0 <= target_fr_value <= 1.0):
        raise ValueError(f"target_fr_value must be in [0, 1], got {target_fr_value!r}")
    uniq = np.unique(pos)
    grid = np.append(uniq, np.nextafter(uniq[-1], np.inf))
    # FR strictly increases along the grid, so each FR value has one (the largest) threshold.
    fr = np.searchsorted(pos, grid, side="left") / pos.size
    dist = np.abs(fr - target_fr_value)
    best = np.flatnonzero(dist <= dist.min() + _TIE_SLACK)
    return float(grid[best[0]])  # the lowest FR among the equally close


def safe_ratio(num: float, den: float, what: str) -> tuple[float | None, str]:
    """num / den by the module's conventions: (None, note) when only den is 0, (1.0, note)
    when both are 0, (num / den, "") otherwise."""
    if den > 0:
        return num / den, ""
    if num == 0:
        return 1.0, f"baseline and candidate both have {what} = 0 (ratio set to 1)"
    return None, f"baseline {what} is 0 and candidate {what} is {num:.4g}: the ratio is unbounded"


@dataclass(frozen=True)
class RelativeResult:
    """Candidate vs baseline at the baseline's operating point (see the module docstring)."""

    target_fr: float
    baseline_threshold: float
    candidate_threshold: float
    baseline_fr: float
    baseline_fa: float
    candidate_fr: float
    candidate_fa: float
    relative_fa: float | None  # None: baseline FA is 0 and candidate's is not, see `note`
    relative_fr: float | None  # None: baseline FR is 0 and candidate's is not, see `note`
    n_positive: int
    n_negative: int
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def relative_fa_fr(
    base_pos: Sequence[float] | np.ndarray,
    base_neg: Sequence[float] | np.ndarray,
    cand_pos: Sequence[float] | np.ndarray,
    cand_neg: Sequence[float] | np.ndarray,
    target_fr: float,
) -> RelativeResult:
    """Relative FA and FR of a candidate against the baseline at matched FR.

    Both models score the same utterances (paired), so `base_pos`/`cand_pos` and
    `base_neg`/`cand_neg` must have equal lengths.
    """
    bp = _scores(base_pos, "base_pos")
    bn = _scores(base_neg, "base_neg")
    cp = _scores(cand_pos, "cand_pos")
    cn = _scores(cand_neg, "cand_neg")
    if bp.size != cp.size or bn.size != cn.size:
        raise ValueError(
            "baseline and candidate must score the same utterances: "
            f"{bp.size}/{cp.size} positives, {bn.size}/{cn.size} negatives"
        )
    tb = baseline_threshold(bp, target_fr)
    fr_b, fa_b = fr_at(bp, tb), fa_at(bn, tb)
    tc = matched_threshold(cp, fr_b)
    fr_c, fa_c = fr_at(cp, tc), fa_at(cn, tc)
    rel_fa, note_fa = safe_ratio(fa_c, fa_b, "FA")
    rel_fr, note_fr = safe_ratio(fr_c, fr_b, "FR")
    return RelativeResult(
        target_fr=float(target_fr),
        baseline_threshold=tb,
        candidate_threshold=tc,
        baseline_fr=fr_b,
        baseline_fa=fa_b,
        candidate_fr=fr_c,
        candidate_fa=fa_c,
        relative_fa=rel_fa,
        relative_fr=rel_fr,
        n_positive=int(bp.size),
        n_negative=int(bn.size),
        note="; ".join(n for n in (note_fa, note_fr) if n),
    )


def _group_members(ids: np.ndarray, keys: np.ndarray) -> list[np.ndarray]:
    return [np.flatnonzero(ids == k) for k in keys]


def percentile_interval(values: list[float], level: float) -> tuple[float | None, float | None]:
    """Percentile interval of bootstrap replicates at `level`; an infinite bound (a ratio
    over zero) and an empty list give None."""
    if not values:
        return None, None
    arr = np.sort(np.asarray(values))
    alpha = (1.0 - level) / 2.0
    lo_i = max(0, math.floor(alpha * (arr.size - 1)))
    hi_i = min(arr.size - 1, math.ceil((1.0 - alpha) * (arr.size - 1)))
    low, high = float(arr[lo_i]), float(arr[hi_i])
    return (None if math.isinf(low) else low), (None if math.isinf(high) else high)


def _resamples(
    rng: np.random.Generator,
    n_pos: int,
    n_neg: int,
    groups: tuple[Sequence[str], Sequence[str]] | None,
    n_boot: int,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(positive indices, negative indices) of each bootstrap replicate: utterances drawn
    with replacement, or whole groups (speakers) when `groups` is given; a replicate that
    draws no positive or no negative is skipped."""
    if groups is None:
        for _ in range(n_boot):
            yield rng.integers(0, n_pos, n_pos), rng.integers(0, n_neg, n_neg)
        return
    gp = np.asarray(groups[0], dtype=str).reshape(-1)
    gn = np.asarray(groups[1], dtype=str).reshape(-1)
    if gp.size != n_pos or gn.size != n_neg:
        raise ValueError("groups must give one speaker id per positive and per negative score")
    keys = np.unique(np.concatenate([gp, gn]))
    pos_members, neg_members = _group_members(gp, keys), _group_members(gn, keys)
    for _ in range(n_boot):
        drawn = rng.integers(0, keys.size, keys.size)
        ip = np.concatenate([pos_members[i] for i in drawn])
        ineg = np.concatenate([neg_members[i] for i in drawn])
        if ip.size and ineg.size:
            yield ip, ineg


def bootstrap_relative_fa_by_subset(
    base_pos: Sequence[float] | np.ndarray,
    base_neg: Sequence[float] | np.ndarray,
    cand_pos: Sequence[float] | np.ndarray,
    cand_neg: Sequence[float] | np.ndarray,
    target_fr: float,
    neg_subsets: dict[str, np.ndarray],
    groups: tuple[Sequence[str], Sequence[str]] | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    baseline_thr: float | None = None,
) -> dict[str, tuple[float | None, float | None]]:
    """Bootstrap intervals of the relative FA on subsets of the negatives (e.g. device
    states) whose operating point is set on the whole set, as in `bootstrap_relative_fa_ci`.

    Each replicate resamples the whole set, redoes the matching on it, and evaluates the
    relative FA of every subset (boolean mask over the negatives) at those thresholds; a
    subset with no negative in a replicate skips that replicate. `baseline_thr` fixes the
    baseline's threshold (a shipped one) instead of refitting it to `target_fr` in each
    replicate; the candidate is still rematched to the baseline's FR in the replicate.
    """
    bp = _scores(base_pos, "base_pos")
    bn = _scores(base_neg, "base_neg")
    cp = _scores(cand_pos, "cand_pos")
    cn = _scores(cand_neg, "cand_neg")
    if bp.size != cp.size or bn.size != cn.size:
        raise ValueError("baseline and candidate must score the same utterances")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    _check_rate(target_fr, "target_fr")
    masks = {}
    for name, m in neg_subsets.items():
        m = np.asarray(m, dtype=bool).reshape(-1)
        if m.size != bn.size:
            raise ValueError(f"subset {name!r}: mask of {m.size} entries for {bn.size} negatives")
        masks[name] = m
    values: dict[str, list[float]] = {name: [] for name in masks}
    for ip, ineg in _resamples(np.random.default_rng(seed), bp.size, bn.size, groups, n_boot):
        tb = baseline_threshold(bp[ip], target_fr) if baseline_thr is None else baseline_thr
        tc = matched_threshold(cp[ip], fr_at(bp[ip], tb))
        for name, m in masks.items():
            sel = ineg[m[ineg]]
            if sel.size == 0:
                continue
            ratio, _ = safe_ratio(fa_at(cn[sel], tc), fa_at(bn[sel], tb), "FA")
            values[name].append(math.inf if ratio is None else ratio)
    return {name: percentile_interval(v, level) for name, v in values.items()}


def bootstrap_relative_fa_ci(
    base_pos: Sequence[float] | np.ndarray,
    base_neg: Sequence[float] | np.ndarray,
    cand_pos: Sequence[float] | np.ndarray,
    cand_neg: Sequence[float] | np.ndarray,
    target_fr: float,
    groups: tuple[Sequence[str], Sequence[str]] | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float | None, float | None]:
    """Percentile bootstrap interval for the relative FA, paired between the two models.

    Each replicate resamples with replacement and redoes the whole matching (baseline
    threshold, matched candidate threshold), so the interval includes the threshold's own
    noise. `groups=None` resamples utterances; `groups=(pos_speakers, neg_speakers)`
    resamples speakers (all utterances of a drawn speaker come along), which respects the
    correlation between one speaker's utterances.

    A replicate whose baseline FA is 0 while the candidate's is not counts as +inf: a bound
    of +inf is returned as None ("unbounded"). Replicates without positives or without
    negatives are dropped; if none is left the interval is (None, None). The bounds are the
    order statistics just outside the nominal quantiles (no interpolation), so the interval
    is never narrower than the nominal level asks.
    """
    n_neg = np.asarray(base_neg).size
    out = bootstrap_relative_fa_by_subset(
        base_pos,
        base_neg,
        cand_pos,
        cand_neg,
        target_fr,
        {"all": np.ones(n_neg, dtype=bool)},
        groups=groups,
        n_boot=n_boot,
        seed=seed,
        level=level,
    )
    return out["all"]


# --------------------------------------------------------------------------------------
# One evaluation routine: the cell figures both `wakefl eval` and the paper study report
# --------------------------------------------------------------------------------------

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
    bp = _scores(base_pos, "base_pos")
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
    base = _scores(base_scores, "base_scores")
    cand = _scores(cand_scores, "cand_scores")
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
    p = np.sort(_scores(pos, "pos"))
    n = np.sort(_scores(neg, "neg"))
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
    times = _scores(event_times, "event_times", allow_empty=True)
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
    base = _scores(baseline_scores, "baseline_scores", allow_empty=True)
    cand = _scores(candidate_scores, "candidate_scores", allow_empty=True)
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
    target_fr = _check_rate(target_fr, "target_fr")
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


# --------------------------------------------------------------------------------------
# Relative FR at matched FA: how many fewer wake words a candidate misses at the false-accept
# rate the baseline has (the figure that matters when the baseline misses many)
# --------------------------------------------------------------------------------------

# thresholds (ascending) -> the FA at each: a rate per clip, or false accepts per hour
FaCurve = Callable[[np.ndarray], np.ndarray]
# Two FA values within this relative slack are equal (an FA/h is a count over hours).
_FA_SLACK = 1e-9


def fr_grid(pos_scores: Sequence[float] | np.ndarray) -> np.ndarray:
    """The thresholds at which FR changes: every distinct wake-word score, and one just above
    the highest (FR 1). Any other threshold has the FR of the next grid point above it and
    no fewer false accepts, so the grid holds every operating point worth taking."""
    uniq = np.unique(_scores(pos_scores, "pos_scores"))
    return np.append(uniq, np.nextafter(uniq[-1], np.inf))


def clip_fa_curve(neg_scores: Sequence[float] | np.ndarray) -> FaCurve:
    """FA per clip as a function of the threshold: share of `neg_scores` at or above it."""
    neg = np.sort(_scores(neg_scores, "neg_scores"))

    def curve(thresholds: np.ndarray) -> np.ndarray:
        t = np.asarray(thresholds, dtype=np.float64)
        return (neg.size - np.searchsorted(neg, t, side="left")) / neg.size

    return curve


def lowest_threshold_within(grid: np.ndarray, fa: np.ndarray, fa_level: float) -> int:
    """Index of the lowest threshold of the ascending `grid` from which on, upwards, the FA
    never exceeds `fa_level` (an FA that is not monotone in the threshold, such as event
    counts with a refractory period, is held to the level above the chosen point too). The
    highest grid point when even it exceeds the level."""
    over = np.flatnonzero(np.asarray(fa) > fa_level * (1.0 + _FA_SLACK) + _FA_SLACK)
    if over.size == 0:
        return 0
    return min(int(over[-1]) + 1, len(grid) - 1)


@dataclass(frozen=True)
class MatchedFaResult:
    """Candidate vs baseline at a matched false-accept level: both models at the lowest
    threshold whose FA is at most `fa_level` (the baseline's FA at its operating threshold),
    so each misses as few wake words as it can without more false accepts than the baseline
    makes. `relative_fr` = candidate FR / baseline FR there; None (and `unbounded`) when the
    baseline misses none and the candidate some. The interval bounds follow
    `percentile_interval` (None: unbounded)."""

    fa_level: float
    baseline_threshold: float
    candidate_threshold: float
    baseline_fa: float
    candidate_fa: float
    baseline_fr: float
    candidate_fr: float
    relative_fr: float | None
    relative_fr_ci: tuple[float | None, float | None]
    unbounded: bool
    n_positive: int
    replicates: int
    note: str = ""

    def as_record(self) -> dict:
        """JSON values, nothing implicit: an unbounded ratio or bound is "unbounded"."""
        lo, hi = self.relative_fr_ci
        rec = asdict(self)
        rec["relative_fr"] = "unbounded" if self.relative_fr is None else self.relative_fr
        rec["relative_fr_ci"] = (
            [None, None]
            if not self.replicates
            else ["unbounded" if lo is None else lo, "unbounded" if hi is None else hi]
        )
        return rec


def matched_fa_thresholds(
    bp: np.ndarray, cp: np.ndarray, fa_b: FaCurve, fa_c: FaCurve, fa_level: float
) -> tuple[float, float, float, float]:
    """(baseline threshold, candidate threshold, their FAs) at `fa_level`: each model at
    the lowest threshold of its FR grid whose FA stays within the level."""
    gb, gc = fr_grid(bp), fr_grid(cp)
    vb, vc = np.asarray(fa_b(gb), dtype=np.float64), np.asarray(fa_c(gc), dtype=np.float64)
    ib, ic = lowest_threshold_within(gb, vb, fa_level), lowest_threshold_within(gc, vc, fa_level)
    return float(gb[ib]), float(gc[ic]), float(vb[ib]), float(vc[ic])


def _fr_ratio(fr_c: float, fr_b: float) -> float:
    ratio, _ = safe_ratio(fr_c, fr_b, "FR")
    return math.inf if ratio is None else ratio


def _matched_result(
    bp: np.ndarray,
    cp: np.ndarray,
    fa_level: float,
    point: tuple[float, float, float, float],
    values: list[float],
    level: float,
) -> MatchedFaResult:
    tb, tc, fab, fac = point
    fr_b, fr_c = fr_at(bp, tb), fr_at(cp, tc)
    rel, note = safe_ratio(fr_c, fr_b, "FR at matched FA")
    if rel is None:
        note = (
            f"unbounded: the baseline misses no wake word at this FA and the candidate "
            f"misses {fr_c:.1%}"
        )
    return MatchedFaResult(
        fa_level=float(fa_level),
        baseline_threshold=tb,
        candidate_threshold=tc,
        baseline_fa=fab,
        candidate_fa=fac,
        baseline_fr=fr_b,
        candidate_fr=fr_c,
        relative_fr=rel,
        relative_fr_ci=percentile_interval(values, level),
        unbounded=rel is None,
        n_positive=int(bp.size),
        replicates=len(values),
        note=note,
    )


def relative_fr_at_matched_fa(
    base_pos: Sequence[float] | np.ndarray,
    cand_pos: Sequence[float] | np.ndarray,
    base_fa: FaCurve,
    cand_fa: FaCurve,
    fa_level: float,
    pos_units: Sequence[str] | np.ndarray | None = None,
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
) -> MatchedFaResult:
    """Relative FR at a matched FA measured on audio that is not resampled (the negative
    streams, with `base_fa`/`cand_fa` giving false accepts per hour at any threshold).

    Both models work at the lowest threshold whose FA is at most `fa_level` (see
    `lowest_threshold_within`). The thresholds depend on the streams only, so the
    interval resamples the wake-word clips alone, by `pos_units` (speakers; each clip its
    own unit when None), and reads each replicate's FR at those thresholds."""
    bp, cp = _scores(base_pos, "base_pos"), _scores(cand_pos, "cand_pos")
    if bp.size != cp.size:
        raise ValueError(f"baseline and candidate must score the same clips: {bp.size}/{cp.size}")
    if not (math.isfinite(fa_level) and fa_level >= 0):
        raise ValueError(f"fa_level must be a finite number >= 0, got {fa_level!r}")
    point = matched_fa_thresholds(bp, cp, base_fa, cand_fa, fa_level)
    units = np.arange(bp.size).astype(str) if pos_units is None else np.asarray(pos_units, str)
    if units.size != bp.size:
        raise ValueError("pos_units must give one unit per wake-word clip")
    keys, inverse = np.unique(units, return_inverse=True)
    members = _group_members(inverse, np.arange(keys.size))
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(n_boot):
        ip = np.concatenate([members[i] for i in rng.integers(0, keys.size, keys.size)])
        values.append(_fr_ratio(fr_at(cp[ip], point[1]), fr_at(bp[ip], point[0])))
    return _matched_result(bp, cp, fa_level, point, values, level)


def relative_fr_at_matched_clip_fa(
    base_pos: Sequence[float] | np.ndarray,
    base_neg: Sequence[float] | np.ndarray,
    cand_pos: Sequence[float] | np.ndarray,
    cand_neg: Sequence[float] | np.ndarray,
    target_fr: float,
    groups: tuple[Sequence[str], Sequence[str]] | None = None,
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
    baseline_thr: float | None = None,
) -> MatchedFaResult:
    """Relative FR at matched FA per clip: the FA level is the baseline's at its operating
    threshold (`baseline_thr`, else fitted to `target_fr`), and both models are held to it
    (see `relative_fr_at_matched_fa`). The paired bootstrap resamples `groups` (speakers of
    the wake-word and of the other clips; clips when None) and redoes the level and the
    matching in every replicate."""
    bp, bn = _scores(base_pos, "base_pos"), _scores(base_neg, "base_neg")
    cp, cn = _scores(cand_pos, "cand_pos"), _scores(cand_neg, "cand_neg")
    if bp.size != cp.size or bn.size != cn.size:
        raise ValueError("baseline and candidate must score the same utterances")
    _check_rate(target_fr, "target_fr")

    def fa_level_of(p: np.ndarray, n: np.ndarray) -> float:
        tb = baseline_threshold(p, target_fr) if baseline_thr is None else baseline_thr
        return fa_at(n, tb)

    fa_level = fa_level_of(bp, bn)
    point = matched_fa_thresholds(bp, cp, clip_fa_curve(bn), clip_fa_curve(cn), fa_level)
    values = []
    for ip, ineg in _resamples(np.random.default_rng(seed), bp.size, bn.size, groups, n_boot):
        lvl = fa_level_of(bp[ip], bn[ineg])
        tb, tc, _, _ = matched_fa_thresholds(
            bp[ip], cp[ip], clip_fa_curve(bn[ineg]), clip_fa_curve(cn[ineg]), lvl
        )
        values.append(_fr_ratio(fr_at(cp[ip], tc), fr_at(bp[ip], tb)))
    return _matched_result(bp, cp, fa_level, point, values, level)
