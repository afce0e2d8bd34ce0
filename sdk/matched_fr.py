"""Rates at a threshold, the operating thresholds, relative FA at matched FR of a candidate
against a baseline (`RelativeResult`: both at the FR the baseline has) and the bootstrap of
it over speakers. The conventions are stated in sdk/wake_metrics.py, the public face of the
metrics; relative FR at matched FA (the other direction, `MatchedFaResult`) is in
sdk/matched_fa.py."""

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from wakefl.errors import NonFiniteError

# Slack when comparing k/n with a target given as a decimal (0.05 * 20 is not exactly 1).
_COUNT_SLACK = 1e-9
# Two FR values closer than this are "equally close" to the target.
_TIE_SLACK = 1e-12


def checked_scores(
    x: Sequence[float] | np.ndarray, name: str, allow_empty: bool = False
) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64).reshape(-1)
    if arr.size == 0 and not allow_empty:
        raise ValueError(f"{name}: no scores")
    if not np.all(np.isfinite(arr)):
        raise NonFiniteError(
            f"{name}: {int(np.count_nonzero(~np.isfinite(arr)))} non-finite score(s)"
        )
    return arr


def check_rate(value: float, name: str) -> float:
    if not (
        isinstance(value, (int, float, np.floating)) and math.isfinite(value) and 0.0 <= value < 1.0
    ):
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def fr_at(pos_scores: Sequence[float] | np.ndarray, thr: float) -> float:
    """False-reject rate: share of wake-word scores strictly below `thr`."""
    pos = checked_scores(pos_scores, "pos_scores")
    return float(np.count_nonzero(pos < thr)) / pos.size


def fa_at(neg_scores: Sequence[float] | np.ndarray, thr: float) -> float:
    """False-accept rate per utterance: share of non-wake-word scores at or above `thr`."""
    neg = checked_scores(neg_scores, "neg_scores")
    return float(np.count_nonzero(neg >= thr)) / neg.size


def baseline_threshold(pos_scores: Sequence[float] | np.ndarray, target_fr: float) -> float:
    """The largest threshold whose FR is <= `target_fr` (see the module docstring).

    It is always one of the positive scores; with target_fr = 0 it is the smallest one.
    """
    pos = np.sort(checked_scores(pos_scores, "pos_scores"))
    target_fr = check_rate(target_fr, "target_fr")
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
    pos = np.sort(checked_scores(cand_pos, "cand_pos"))
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
    bp = checked_scores(base_pos, "base_pos")
    bn = checked_scores(base_neg, "base_neg")
    cp = checked_scores(cand_pos, "cand_pos")
    cn = checked_scores(cand_neg, "cand_neg")
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


def group_members(ids: np.ndarray, keys: np.ndarray) -> list[np.ndarray]:
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


def paired_resamples(
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
    pos_members, neg_members = group_members(gp, keys), group_members(gn, keys)
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
    bp = checked_scores(base_pos, "base_pos")
    bn = checked_scores(base_neg, "base_neg")
    cp = checked_scores(cand_pos, "cand_pos")
    cn = checked_scores(cand_neg, "cand_neg")
    if bp.size != cp.size or bn.size != cn.size:
        raise ValueError("baseline and candidate must score the same utterances")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    check_rate(target_fr, "target_fr")
    masks = {}
    for name, m in neg_subsets.items():
        m = np.asarray(m, dtype=bool).reshape(-1)
        if m.size != bn.size:
            raise ValueError(f"subset {name!r}: mask of {m.size} entries for {bn.size} negatives")
        masks[name] = m
    values: dict[str, list[float]] = {name: [] for name in masks}
    for ip, ineg in paired_resamples(np.random.default_rng(seed), bp.size, bn.size, groups, n_boot):
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
