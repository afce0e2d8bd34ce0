"""The wake-word metrics on hand-computed examples: ties, thresholds between scores, the
discreteness of FR when matching, and the ratio conventions."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from wakefl.errors import NonFiniteError
from wakefl.sdk.wake_metrics import (
    baseline_threshold,
    bootstrap_relative_fa_by_subset,
    bootstrap_relative_fa_ci,
    clip_fa_curve,
    det_curve,
    fa_at,
    false_accepts_per_hour,
    fr_at,
    fr_grid,
    local_relative_report,
    lowest_threshold_within,
    matched_threshold,
    relative_fa_fr,
    relative_fr_at_matched_clip_fa,
    relative_fr_at_matched_fa,
)

POS = [0.1, 0.4, 0.4, 0.7, 0.9]
NEG = [0.05, 0.4, 0.5, 0.8]


def test_fr_fa_at_a_score_accepts_ties():
    # 0.1 is below 0.4; both 0.4 are accepted.
    assert fr_at(POS, 0.4) == pytest.approx(1 / 5)
    assert fa_at(NEG, 0.4) == pytest.approx(3 / 4)


def test_fr_fa_between_scores():
    assert fr_at(POS, 0.55) == pytest.approx(3 / 5)
    assert fa_at(NEG, 0.55) == pytest.approx(1 / 4)
    assert fr_at(POS, 0.0) == 0.0
    assert fa_at(NEG, 0.95) == 0.0


@pytest.mark.parametrize(
    ("target", "expected"),
    [(0.0, 0.1), (0.19, 0.1), (0.2, 0.4), (0.59, 0.4), (0.6, 0.7), (0.8, 0.9), (0.99, 0.9)],
)
def test_baseline_threshold_is_largest_with_fr_not_above_target(target, expected):
    thr = baseline_threshold(POS, target)
    assert thr == expected
    assert fr_at(POS, thr) <= target + 1e-12


def test_baseline_threshold_counts_not_floats():
    # 1 reject out of 20 is exactly the 5 % target.
    pos = np.arange(1, 21) / 100.0
    assert baseline_threshold(pos, 0.05) == pytest.approx(0.02)
    assert fr_at(pos, baseline_threshold(pos, 0.05)) == pytest.approx(0.05)


def test_baseline_threshold_rejects_bad_target():
    with pytest.raises(ValueError):
        baseline_threshold(POS, 1.0)
    with pytest.raises(ValueError):
        baseline_threshold(POS, -0.1)
    with pytest.raises(NonFiniteError):
        baseline_threshold([0.1, float("nan")], 0.05)


@pytest.mark.parametrize(
    ("target_value", "expected"),
    [
        (0.0, 0.2),  # FR 0
        (0.2, 0.3),  # nearest FR is 0.25
        (0.125, 0.2),  # 0 and 0.25 are equally close: the lower FR wins
        (0.4, 0.6),  # nearest FR is 0.5
        (0.625, 0.6),  # 0.5 and 0.75 equally close: 0.5
        (1.0, None),  # only the threshold above every score rejects everything
    ],
)
def test_matched_threshold(target_value, expected):
    cand = [0.8, 0.2, 0.6, 0.3]  # FR grid: 0.2->0, 0.3->.25, 0.6->.5, 0.8->.75, above->1
    thr = matched_threshold(cand, target_value)
    if expected is None:
        assert thr > 0.8
        assert fr_at(cand, thr) == 1.0
    else:
        assert thr == expected


def test_matched_threshold_with_tied_scores():
    # Ties give FR steps of 2/3: grid 0.3->0, 0.5->2/3, above->1; 1/3 sits between 0 and 2/3.
    assert matched_threshold([0.3, 0.3, 0.5], 1 / 3) == 0.3
    assert matched_threshold([0.3, 0.3, 0.5], 0.5) == 0.5


def test_relative_fa_fr_hand_computed():
    base_pos, base_neg = [0.2, 0.4, 0.6, 0.8], [0.1, 0.3, 0.5, 0.7]
    cand_pos, cand_neg = [0.5, 0.6, 0.9, 0.95], [0.1, 0.2, 0.3, 0.65]
    res = relative_fa_fr(base_pos, base_neg, cand_pos, cand_neg, 0.25)
    assert res.baseline_threshold == 0.4
    assert res.baseline_fr == 0.25 and res.baseline_fa == 0.5
    assert res.candidate_threshold == 0.6
    assert res.candidate_fr == 0.25 and res.candidate_fa == 0.25
    assert res.relative_fa == 0.5 and res.relative_fr == 1.0
    assert (res.n_positive, res.n_negative) == (4, 4)
    assert res.note == ""


def test_identical_candidate_gives_exactly_one():
    rng = np.random.default_rng(3)
    for _ in range(20):
        pos = np.round(rng.beta(5, 2, size=37), 2)  # rounding makes ties
        neg = np.round(rng.beta(2, 5, size=53), 2)
        for target in (0.0, 0.03, 0.05, 0.1, 0.3):
            res = relative_fa_fr(pos, neg, pos.copy(), neg.copy(), target)
            assert res.relative_fa == 1.0
            assert res.relative_fr == 1.0
            assert res.candidate_threshold == res.baseline_threshold


def test_monotone_rescoring_gives_exactly_one():
    # Matching depends on the ranking only, not on the score scale.
    rng = np.random.default_rng(4)
    pos, neg = rng.normal(1, 1, 200), rng.normal(-1, 1, 300)
    res = relative_fa_fr(pos, neg, 1 / (1 + np.exp(-pos)), 1 / (1 + np.exp(-neg)), 0.05)
    assert res.relative_fa == 1.0 and res.relative_fr == 1.0


def test_strictly_better_scorer_has_relative_fa_below_one():
    rng = np.random.default_rng(5)
    pos, neg = rng.normal(1, 1, 400), rng.normal(-1, 1, 600)
    res = relative_fa_fr(pos, neg, pos, neg - 0.8, 0.05)
    assert res.relative_fr == 1.0
    assert res.baseline_fa > 0
    assert res.relative_fa < 1.0


def test_zero_baseline_fa_is_explicit():
    pos, neg = [0.6, 0.7, 0.8], [0.1, 0.2]
    res = relative_fa_fr(pos, neg, pos, [0.1, 0.9], 0.0)
    assert res.baseline_fa == 0.0 and res.candidate_fa == 0.5
    assert res.relative_fa is None
    assert "baseline FA is 0" in res.note
    both = relative_fa_fr(pos, neg, pos, neg, 0.0)
    assert both.relative_fa == 1.0 and "both" in both.note
    json.dumps(res.as_dict(), allow_nan=False)


def test_unpaired_scores_are_refused():
    with pytest.raises(ValueError, match="same utterances"):
        relative_fa_fr([0.1, 0.2], [0.3], [0.1], [0.3], 0.05)


def test_det_curve_hand_computed():
    fa, fr = det_curve([0.2, 0.6], [0.4])
    # thresholds 0.2, 0.4, 0.6, just above 0.6
    np.testing.assert_allclose(fr, [0.0, 0.5, 0.5, 1.0])
    np.testing.assert_allclose(fa, [1.0, 1.0, 0.0, 0.0])


def test_det_curve_is_monotone():
    rng = np.random.default_rng(6)
    fa, fr = det_curve(rng.normal(1, 1, 100), rng.normal(0, 1, 100))
    assert np.all(np.diff(fa) <= 0) and np.all(np.diff(fr) >= 0)
    assert fa[0] == 1.0 and fr[0] == 0.0 and fa[-1] == 0.0 and fr[-1] == 1.0


def test_false_accepts_per_hour():
    assert false_accepts_per_hour([12.0, 700.5, 1799.0], 0.5) == 6.0
    assert false_accepts_per_hour([], 2.0) == 0.0
    with pytest.raises(ValueError):
        false_accepts_per_hour([1.0], 0.0)
    with pytest.raises(ValueError):
        false_accepts_per_hour([-1.0], 1.0)


def _separable(seed: int, n_pos: int = 150, n_neg: int = 300):
    rng = np.random.default_rng(seed)
    pos, neg = rng.normal(1.5, 1, n_pos), rng.normal(-0.5, 1, n_neg)
    return pos, neg, pos + rng.normal(0, 0.2, n_pos), neg - 0.5 + rng.normal(0, 0.2, n_neg)


def test_bootstrap_ci_contains_point_estimate():
    bp, bn, cp, cn = _separable(7)
    point = relative_fa_fr(bp, bn, cp, cn, 0.05).relative_fa
    low, high = bootstrap_relative_fa_ci(bp, bn, cp, cn, 0.05, n_boot=300, seed=1)
    assert low is not None and high is not None
    assert low <= point <= high
    assert high - low > 0
    # Reproducible for a seed.
    assert bootstrap_relative_fa_ci(bp, bn, cp, cn, 0.05, n_boot=300, seed=1) == (low, high)


def test_bootstrap_ci_by_speaker_is_wider_when_speakers_differ():
    # Every speaker shifts all of their scores: utterances of one speaker are correlated, so
    # resampling speakers must give a wider interval than resampling utterances.
    rng = np.random.default_rng(8)
    n_spk, per = 10, 30
    spk_pos = np.repeat([f"s{i}" for i in range(n_spk)], per)
    spk_neg = np.repeat([f"s{i}" for i in range(n_spk)], 2 * per)
    gain = rng.normal(0, 0.8, n_spk)
    bp = rng.normal(1.5, 1, spk_pos.size)
    bn = rng.normal(-0.5, 1, spk_neg.size)
    cp = bp.copy()
    cn = bn - np.repeat(gain, 2 * per)
    point = relative_fa_fr(bp, bn, cp, cn, 0.05).relative_fa
    lo_u, hi_u = bootstrap_relative_fa_ci(bp, bn, cp, cn, 0.05, n_boot=200, seed=2)
    lo_s, hi_s = bootstrap_relative_fa_ci(
        bp, bn, cp, cn, 0.05, groups=(spk_pos, spk_neg), n_boot=200, seed=2
    )
    assert lo_s <= point <= hi_s
    assert hi_s - lo_s > hi_u - lo_u


def test_bootstrap_identical_is_degenerate_at_one():
    bp, bn, _, _ = _separable(9, 40, 60)
    assert bootstrap_relative_fa_ci(bp, bn, bp, bn, 0.05, n_boot=50) == (1.0, 1.0)


def test_bootstrap_unbounded_upper_is_none():
    pos, neg = [0.6, 0.7, 0.8, 0.9], [0.1, 0.2, 0.3]
    low, high = bootstrap_relative_fa_ci(pos, neg, pos, [0.95, 0.95, 0.95], 0.0, n_boot=20)
    assert low is None and high is None
    _, high = bootstrap_relative_fa_ci(pos, neg, pos, [0.1, 0.2, 0.95], 0.0, n_boot=100)
    assert high is None


def test_local_report_on_small_data_says_it_is_uncertain():
    rng = np.random.default_rng(10)
    labels = np.array([1] * 8 + [0] * 30)
    base = np.where(labels == 1, rng.normal(1, 1, labels.size), rng.normal(0, 1, labels.size))
    cand = base - 0.3 * (labels == 0)
    rep = local_relative_report(base, cand, labels, target_fr=0.05, n_boot=100, seed=0)
    assert rep["n_positive"] == 8 and rep["n_negative"] == 30
    assert rep["relative_fr"] == 1.0
    assert rep["relative_fa"] is not None and rep["relative_fa"] <= 1.0
    assert rep["uncertainty"] == "high"
    assert "steps of 12.5%" in rep["statement"]
    low, high = rep["ci"]
    assert low <= rep["relative_fa"] <= high
    json.dumps(rep, allow_nan=False)


def test_local_report_identical_and_empty():
    labels = [1, 1, 0, 0, 0]
    scores = [0.9, 0.8, 0.85, 0.1, 0.2]
    rep = local_relative_report(scores, scores, labels, n_boot=20)
    assert rep["relative_fa"] == 1.0 and rep["relative_fr"] == 1.0
    empty = local_relative_report([0.1, 0.2], [0.1, 0.3], [0, 0])
    assert empty["relative_fa"] is None
    assert "No wake-word clips" in empty["statement"]
    assert not math.isnan(empty["n_positive"])
    with pytest.raises(ValueError):
        local_relative_report([0.1], [0.1, 0.2], [0, 1])


def test_bootstrap_by_subset_keeps_each_subset_apart():
    # Same positives -> same thresholds in every replicate; only subset "x" gets better.
    rng = np.random.default_rng(11)
    pos, neg = rng.normal(1.5, 1, 200), rng.normal(0, 1, 400)
    in_x = np.arange(400) < 200
    cand_neg = np.where(in_x, neg - 1.0, neg)
    cis = bootstrap_relative_fa_by_subset(
        pos,
        neg,
        pos,
        cand_neg,
        0.05,
        {"x": in_x, "y": ~in_x, "all": np.ones(400, bool)},
        n_boot=100,
        seed=3,
    )
    assert cis["y"] == (1.0, 1.0)
    assert cis["x"][1] < 1.0
    assert cis["all"] == bootstrap_relative_fa_ci(pos, neg, pos, cand_neg, 0.05, n_boot=100, seed=3)


def test_relative_by_subset_at_a_shipped_threshold():
    from wakefl.sdk.wake_metrics import relative_by_subset

    rng = np.random.default_rng(4)
    labels = np.repeat([1, 0], 200)
    base = rng.normal(size=400) + 2.0 * labels
    cand = np.where(labels == 0, base - 0.5, base)  # same positives, lower negatives
    units = np.array([f"s{i % 20}" for i in range(400)])
    subsets = {"all": np.ones(400, bool), "half": np.arange(400) % 2 == 0}
    op, cells = relative_by_subset(
        base, cand, labels, units, subsets, 0.05, 50, 0, baseline_thr=1.3
    )
    # Not refitted: the baseline stays at its threshold, the candidate is matched to its FR.
    assert op.shipped and op.baseline_threshold == 1.3
    # Identical positives: the candidate's FR there is the baseline's, at the lowest FA.
    assert op.candidate_threshold == base[:200][base[:200] >= 1.3].min()
    assert fr_at(cand[:200], op.candidate_threshold) == op.baseline_fr
    assert cells["all"].baseline_fr == fr_at(base[:200], 1.3) == op.baseline_fr
    assert cells["all"].relative_fa == pytest.approx(
        fa_at(cand[200:], op.candidate_threshold) / fa_at(base[200:], 1.3)
    )
    assert cells["all"].relative_fa_ci[1] < 1.0
    assert cells["half"].n_negative == 100
    fitted, _ = relative_by_subset(base, cand, labels, units, subsets, 0.05, 10, 0)
    assert not fitted.shipped and fitted.baseline_threshold == baseline_threshold(base[:200], 0.05)


def test_saturation_and_explicit_unbounded_intervals():
    from wakefl.sdk.wake_metrics import fa_per_hour_ceiling, interval_record, is_saturated

    assert fa_per_hour_ceiling(0.1, 1.0) == pytest.approx(3600.0)
    assert fa_per_hour_ceiling(0.25, 1.1) == pytest.approx(3600.0 / 1.25)  # next hop on the grid
    assert fa_per_hour_ceiling(0.1, 0.0) == pytest.approx(36000.0)
    assert is_saturated(2900.0, 3600.0) and not is_saturated(2800.0, 3600.0)
    assert not is_saturated(None, 3600.0)
    rec = interval_record((0.8, None), 1.2)
    assert rec["lower"] == 0.8 and rec["upper"] == "unbounded" and "no false accept" in rec["note"]
    assert interval_record((None, None), None)["upper"] == "unbounded"
    assert interval_record((0.5, 0.9), 0.7) == {"lower": 0.5, "upper": 0.9, "note": ""}
    assert interval_record((None, None), None, measured=False)["upper"] is None


# --- relative FR at matched FA ---------------------------------------------------------


def test_relative_fr_at_matched_fa_is_one_for_identical_models():
    rng = np.random.default_rng(4)
    pos, neg = rng.random(40), rng.random(60) * 0.8
    units = [f"s{i % 8}" for i in range(40)]
    curve = clip_fa_curve(neg)
    res = relative_fr_at_matched_fa(pos, pos.copy(), curve, curve, 0.05, units, n_boot=100)
    assert res.relative_fr == 1.0 and res.relative_fr_ci == (1.0, 1.0)
    assert res.baseline_threshold == res.candidate_threshold and not res.unbounded
    clip = relative_fr_at_matched_clip_fa(pos, neg, pos.copy(), neg.copy(), 0.1, n_boot=100)
    assert clip.relative_fr == 1.0 and clip.relative_fr_ci == (1.0, 1.0)


def test_relative_fr_at_matched_clip_fa_on_a_known_pair():
    # The baseline ships 0.6 and false-accepts nothing there: FA level 0. Its lowest
    # threshold without a false accept is 0.6 (0.3 would accept the 0.5 negative): it
    # misses 0.2 and 0.3, FR 1/2. The candidate's negatives stop at 0.4, so it may go down
    # to 0.55 and misses only 0.3: FR 1/4, relative FR 0.5.
    res = relative_fr_at_matched_clip_fa(
        [0.2, 0.3, 0.6, 0.8],
        [0.5, 0.1, 0.1, 0.1],
        [0.55, 0.7, 0.9, 0.3],
        [0.4, 0.1, 0.2, 0.2],
        target_fr=0.05,
        baseline_thr=0.6,
        n_boot=50,
    )
    assert res.fa_level == 0.0 and res.baseline_fa == res.candidate_fa == 0.0
    assert (res.baseline_threshold, res.candidate_threshold) == (0.6, 0.55)
    assert (res.baseline_fr, res.candidate_fr, res.relative_fr) == (0.5, 0.25, 0.5)


def test_relative_fr_at_matched_fa_per_hour_on_a_known_pair():
    # FA/h on streams: the baseline makes 10/h below 0.5, the candidate below 0.25. Held to
    # the baseline's 0/h, the baseline must work at 0.6 (4 of 8 missed), the candidate at
    # 0.3 (2 of 8 missed): relative FR 0.5, and each clip its own unit.
    pos = np.array([0.1, 0.2, 0.3, 0.4, 0.6, 0.7, 0.8, 0.9])
    res = relative_fr_at_matched_fa(
        pos,
        pos.copy(),
        lambda t: np.where(t < 0.5, 10.0, 0.0),
        lambda t: np.where(t < 0.25, 10.0, 0.0),
        fa_level=0.0,
        n_boot=300,
        seed=1,
    )
    assert (res.baseline_threshold, res.candidate_threshold) == (0.6, 0.3)
    assert (res.baseline_fr, res.candidate_fr, res.relative_fr) == (0.5, 0.25, 0.5)
    lo, hi = res.relative_fr_ci
    assert lo is not None and hi is not None and lo <= 0.5 <= hi <= 1.0
    rec = res.as_record()
    json.dumps(rec, allow_nan=False)
    assert rec["relative_fr"] == 0.5 and not rec["unbounded"]


def test_relative_fr_at_matched_fa_is_unbounded_and_flagged_when_the_baseline_misses_none():
    pos = np.array([0.6, 0.7, 0.8, 0.9])
    res = relative_fr_at_matched_fa(
        pos,
        np.array([0.2, 0.7, 0.8, 0.9]),
        lambda t: np.zeros(np.shape(t)),
        lambda t: np.where(t < 0.5, 10.0, 0.0),
        fa_level=0.0,
        n_boot=50,
    )
    assert res.baseline_fr == 0.0 and res.candidate_fr == 0.25
    assert res.relative_fr is None and res.unbounded and "unbounded" in res.note
    rec = res.as_record()
    assert rec["relative_fr"] == "unbounded" and rec["unbounded"] is True
    json.dumps(rec, allow_nan=False)
    # Both missing nothing is no difference: 1, not unbounded.
    same = relative_fr_at_matched_fa(
        pos, pos.copy(), lambda t: np.zeros(np.shape(t)), lambda t: np.zeros(np.shape(t)), 0.0
    )
    assert same.relative_fr == 1.0 and not same.unbounded


def test_lowest_threshold_within_holds_the_level_above_the_point():
    grid = np.array([0.1, 0.2, 0.3, 0.4])
    # Not monotone: 0.2 is within the level but 0.3 above it is not.
    assert lowest_threshold_within(grid, np.array([5.0, 0.0, 3.0, 0.0]), 1.0) == 3
    assert lowest_threshold_within(grid, np.array([0.0, 0.0, 0.0, 0.0]), 0.0) == 0
    assert lowest_threshold_within(grid, np.array([5.0, 5.0, 5.0, 5.0]), 1.0) == 3
    assert list(fr_grid([0.3, 0.1, 0.3])[:2]) == [0.1, 0.3]
