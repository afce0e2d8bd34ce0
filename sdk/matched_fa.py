"""Relative FR at matched FA: how many fewer wake words a candidate misses at the
false-accept rate the baseline has (the figure that matters when the baseline misses many),
with its bootstrap interval: `MatchedFaResult`. Its counterpart, relative FA at matched FR
(`RelativeResult`), is in sdk/matched_fr.py. Conventions: sdk/wake_metrics.py."""

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from wakefl.sdk.matched_fr import (
    baseline_threshold,
    check_rate,
    checked_scores,
    fa_at,
    fr_at,
    group_members,
    paired_resamples,
    percentile_interval,
    safe_ratio,
)

# thresholds (ascending) -> the FA at each: a rate per clip, or false accepts per hour
FaCurve = Callable[[np.ndarray], np.ndarray]
# Two FA values within this relative slack are equal (an FA/h is a count over hours).
_FA_SLACK = 1e-9


def fr_grid(pos_scores: Sequence[float] | np.ndarray) -> np.ndarray:
    """The thresholds at which FR changes: every distinct wake-word score, and one just above
    the highest (FR 1). Any other threshold has the FR of the next grid point above it and
    no fewer false accepts, so the grid holds every operating point worth taking."""
    uniq = np.unique(checked_scores(pos_scores, "pos_scores"))
    return np.append(uniq, np.nextafter(uniq[-1], np.inf))


def clip_fa_curve(neg_scores: Sequence[float] | np.ndarray) -> FaCurve:
    """FA per clip as a function of the threshold: share of `neg_scores` at or above it."""
    neg = np.sort(checked_scores(neg_scores, "neg_scores"))

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
    bp, cp = checked_scores(base_pos, "base_pos"), checked_scores(cand_pos, "cand_pos")
    if bp.size != cp.size:
        raise ValueError(f"baseline and candidate must score the same clips: {bp.size}/{cp.size}")
    if not (math.isfinite(fa_level) and fa_level >= 0):
        raise ValueError(f"fa_level must be a finite number >= 0, got {fa_level!r}")
    point = matched_fa_thresholds(bp, cp, base_fa, cand_fa, fa_level)
    units = np.arange(bp.size).astype(str) if pos_units is None else np.asarray(pos_units, str)
    if units.size != bp.size:
        raise ValueError("pos_units must give one unit per wake-word clip")
    keys, inverse = np.unique(units, return_inverse=True)
    members = group_members(inverse, np.arange(keys.size))
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
    bp, bn = checked_scores(base_pos, "base_pos"), checked_scores(base_neg, "base_neg")
    cp, cn = checked_scores(cand_pos, "cand_pos"), checked_scores(cand_neg, "cand_neg")
    if bp.size != cp.size or bn.size != cn.size:
        raise ValueError("baseline and candidate must score the same utterances")
    check_rate(target_fr, "target_fr")

    def fa_level_of(p: np.ndarray, n: np.ndarray) -> float:
        tb = baseline_threshold(p, target_fr) if baseline_thr is None else baseline_thr
        return fa_at(n, tb)

    fa_level = fa_level_of(bp, bn)
    point = matched_fa_thresholds(bp, cp, clip_fa_curve(bn), clip_fa_curve(cn), fa_level)
    values = []
    for ip, ineg in paired_resamples(np.random.default_rng(seed), bp.size, bn.size, groups, n_boot):
        lvl = fa_level_of(bp[ip], bn[ineg])
        tb, tc, _, _ = matched_fa_thresholds(
            bp[ip], cp[ip], clip_fa_curve(bn[ineg]), clip_fa_curve(cn[ineg]), lvl
        )
        values.append(_fr_ratio(fr_at(cp[ip], tc), fr_at(bp[ip], tb)))
    return _matched_result(bp, cp, fa_level, point, values, level)
