"""The served-model gate: a device switches only to a model that is better on its validation
clips and shown no worse by its bootstrap interval (sdk/served_model_gate.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from wakefl.errors import NonFiniteError
from wakefl.sdk.gate_admission import VIEWS
from wakefl.sdk.served_model_gate import (
    KEEP_REASON_NO_CLIPS,
    decide_served_model,
    gate_uplink_schema,
)


def _clips(
    rng: np.random.Generator, n_units: int = 12, pos_per_unit: int = 3, neg_per_unit: int = 8
):
    """A device's validation clips: per unit (speaker) some wake words and other clips,
    with a latent per-clip feature that every model's score is built from."""
    labels, units = [], []
    for u in range(n_units):
        labels += [1] * pos_per_unit + [0] * neg_per_unit
        units += [f"spk{u}"] * (pos_per_unit + neg_per_unit)
    labels = np.array(labels)
    feature = rng.normal(size=labels.size) + 1.6 * labels  # separates classes, imperfectly
    return labels, np.array(units), feature


def _model(
    feature: np.ndarray,
    labels: np.ndarray,
    rng: np.random.Generator,
    skill: float,
    noise: float = 0.5,
) -> np.ndarray:
    """A model's scores: the shared feature, plus `skill` times the label (a better
    model separates more), plus its own noise; squashed into (0, 1)."""
    z = feature + skill * labels + noise * rng.normal(size=feature.size)
    return 1.0 / (1.0 + np.exp(-z))


def _label_flipped_scores(
    labels: np.ndarray, feature: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Scores of a logistic model trained (by gradient descent) on the clips' features with
    the labels flipped: the sabotage the issue names."""
    x = np.stack([feature, rng.normal(size=feature.size), np.ones(feature.size)], axis=1)
    y = 1 - labels
    w = np.zeros(3)
    for _ in range(300):
        p = 1.0 / (1.0 + np.exp(-x @ w))
        w -= 0.5 * x.T @ (p - y) / y.size
    return 1.0 / (1.0 + np.exp(-x @ w))


def test_a_sabotaged_personalized_model_is_never_served():
    for seed in range(25):
        rng = np.random.default_rng(seed)
        labels, units, feature = _clips(rng)
        served = _model(feature, labels, rng, skill=0.0)
        flipped = _label_flipped_scores(labels, feature, rng)
        anti = 1.0 - served  # anti-correlated with the served model
        glob = _model(feature, labels, rng, skill=-0.8)  # a global model that is worse too
        for bad in (flipped, anti):
            d = decide_served_model(
                labels,
                served,
                {"personalized": bad, "global": glob},
                units=units,
                n_boot=200,
                seed=seed,
            )
            assert d.serve != "personalized", d.reason
            cmp_ = next(c for c in d.comparisons if c.candidate == "personalized")
            assert cmp_.worse_beyond_noise
            assert not d.switched or d.serve == "global"


def test_a_clearly_better_model_is_served():
    rng = np.random.default_rng(3)
    labels, units, feature = _clips(rng, n_units=15)
    served = _model(feature, labels, rng, skill=0.0)
    better = _model(feature, labels, rng, skill=2.5, noise=0.2)
    d = decide_served_model(labels, served, {"personalized": better}, units=units, n_boot=300)
    assert d.switched and d.serve == "personalized" and d.admissible == ("personalized",)
    c = d.comparisons[0]
    assert c.relative_fa < 1.0 and c.relative_fa_ci[1] is not None
    assert "personalized is served" in d.reason


def test_the_better_of_two_candidates_is_served_and_ties_go_to_the_first():
    rng = np.random.default_rng(5)
    labels, units, feature = _clips(rng, n_units=15)
    served = _model(feature, labels, rng, skill=0.0)
    good = _model(feature, labels, rng, skill=1.5, noise=0.2)
    best = _model(feature, labels, rng, skill=3.0, noise=0.2)
    d = decide_served_model(labels, served, {"personalized": good, "global": best}, units=units)
    assert d.serve == "global" and set(d.admissible) == {"personalized", "global"}
    twin = decide_served_model(
        labels, served, {"personalized": best, "global": best.copy()}, units=units
    )
    assert twin.serve == "personalized"


def test_a_noisy_equal_model_follows_the_documented_rule_and_is_deterministic():
    switched = 0
    for seed in range(12):
        rng = np.random.default_rng(100 + seed)
        labels, units, feature = _clips(rng)
        served = _model(feature, labels, rng, skill=0.5)
        equal = _model(feature, labels, rng, skill=0.5)  # same skill, its own noise
        d = decide_served_model(
            labels, served, {"personalized": equal}, units=units, n_boot=200, seed=seed
        )
        again = decide_served_model(
            labels, served, {"personalized": equal}, units=units, n_boot=200, seed=seed
        )
        assert d == again
        c = d.comparisons[0]
        # The rule: switch iff not worse beyond the noise and, in one view, better in the
        # point figures with the upper end of that view's interval at most 1.
        shown = [
            v
            for v in VIEWS
            if c.better_in(v)
            and all(u is not None and u <= 1.0 for u in c.uppers(v))
            and any(u is not None and u < 1.0 for u in c.uppers(v))
        ]
        assert d.switched == (not c.worse_beyond_noise and bool(shown))
        assert c.fewer_misses == (
            c.relative_fr_matched_fa is not None and c.relative_fr_matched_fa < 1
        )
        assert c.no_worse_point == (
            c.relative_fa is not None
            and c.relative_fa <= 1
            and c.relative_fr is not None
            and c.relative_fr <= 1
        )
        assert c.better_point == (c.no_worse_point and (c.relative_fa < 1 or c.relative_fr < 1))
        switched += d.switched
    # An equal model is better on the device's own clips by chance about half the time;
    # the interval seldom shows it no worse as well.
    assert switched <= 2


def _units_of(per_unit: list[float], n_units: int) -> tuple[np.ndarray, np.ndarray]:
    return np.tile(per_unit, n_units), np.repeat([f"spk{u}" for u in range(n_units)], len(per_unit))


@pytest.mark.parametrize(
    ("served_neg", "cand_neg", "switches", "why"),
    [
        # The served model misses "0.3" at its operating point (target FR 1/4: threshold
        # 0.5, no false accept) and must keep missing it, or accept its 0.4 negative. The
        # candidate scores its negatives lower: at the same false-accept rate (none) it
        # may go down to 0.3 and miss nothing. At matched FR the two tie (0/0 false
        # accepts, same FR): only the misses at matched FA show the gain.
        ([0.4, 0.1, 0.2], [0.1, 0.1, 0.2], True, "misses 0.00 times as many"),
        # The same positives, and negatives at least as high: no fewer misses, kept.
        ([0.4, 0.1, 0.2], [0.45, 0.1, 0.2], False, "no better than served"),
        # Everything the same: a tie, kept.
        ([0.4, 0.1, 0.2], [0.4, 0.1, 0.2], False, "no better than served"),
    ],
)
def test_fewer_misses_at_equal_false_accepts_switches(served_neg, cand_neg, switches, why):
    pos = [0.3, 0.5, 0.6, 0.8]
    labels, units = _units_of([1, 1, 1, 1, 0, 0, 0], 10)
    served, _ = _units_of([*pos, *served_neg], 10)
    cand, _ = _units_of([*pos, *cand_neg], 10)
    d = decide_served_model(
        labels, served, {"personalized": cand}, units=units, target_fr=0.25, n_boot=50
    )
    c = d.comparisons[0]
    assert c.relative_fa == 1.0 and c.relative_fr == 1.0 and not c.better_point
    assert d.switched == switches and c.fewer_misses == switches, d.reason
    assert why in d.reason
    if switches:
        assert c.relative_fr_matched_fa == 0.0 and c.relative_fr_matched_fa_ci == (0.0, 0.0)
        assert d.as_dict()["comparisons"][0]["fewer_misses"] is True


def test_fewer_misses_bought_with_false_accepts_beyond_the_noise_keeps_the_served_model():
    for seed in range(8):
        rng = np.random.default_rng(seed)
        labels, units = _units_of([1, 1, 1, 1] + [0] * 8, 15)
        n = labels.size
        # The served model scores half the wake words low, yet above every negative: at
        # its operating point it false-accepts nothing. The candidate scores every wake
        # word high, but a third of the negatives among them: its false accepts rise.
        served = np.where(
            labels == 1, rng.choice([0.2, 0.8], n) + 0.1 * rng.random(n), 0.15 * rng.random(n)
        )
        high = rng.random(n) < 1 / 3
        cand = np.where(labels == 1, 0.7 + 0.2 * rng.random(n), np.where(high, 0.95, 0.1))
        d = decide_served_model(
            labels, served, {"personalized": cand}, units=units, n_boot=200, seed=seed
        )
        c = d.comparisons[0]
        assert c.worse_beyond_noise and not d.switched and d.serve == "served"
        assert c.relative_fa_ci[0] is None or c.relative_fa_ci[0] > 1.0
        assert "worse than served beyond the noise" in d.reason


def test_a_tie_keeps_the_served_model_unless_ties_switch():
    rng = np.random.default_rng(11)
    labels, units, feature = _clips(rng, n_units=10)
    # Every other clip far below every wake word: neither model false-accepts (0/0).
    served = np.where(labels == 1, 0.6 + 0.3 * rng.random(labels.size), 0.01)
    cand = np.where(labels == 1, 0.6 + 0.3 * rng.random(labels.size), 0.02)
    kept = decide_served_model(labels, served, {"personalized": cand}, units=units, seed=2)
    c = kept.comparisons[0]
    assert c.candidate_fa_count == c.reference_fa_count == 0 and c.relative_fa == 1.0
    assert c.no_worse_point and not c.better_point and not c.worse_beyond_noise
    assert not kept.switched and kept.serve == "served"
    assert "no better than served" in kept.reason
    switched = decide_served_model(
        labels, served, {"personalized": cand}, units=units, seed=2, ties="switch"
    )
    assert switched.switched and switched.serve == "personalized"
    assert switched.comparisons == kept.comparisons  # the same evidence, another rule
    with pytest.raises(ValueError, match="ties"):
        decide_served_model(labels, served, {"personalized": cand}, ties="maybe")


def test_the_baseline_guard_stops_drift_away_from_the_shipped_model():
    rng = np.random.default_rng(7)
    labels, units, feature = _clips(rng, n_units=15)
    baseline = _model(feature, labels, rng, skill=2.5, noise=0.2)
    served = _model(feature, labels, rng, skill=-0.3)  # an earlier switch that drifted
    cand = _model(feature, labels, rng, skill=0.2)  # better than served, worse than baseline
    free = decide_served_model(labels, served, {"personalized": cand}, units=units, seed=1)
    guarded = decide_served_model(
        labels, served, {"personalized": cand}, units=units, seed=1, baseline_scores=baseline
    )
    vs_base = next(c for c in guarded.comparisons if c.reference == "baseline")
    assert vs_base.worse_beyond_noise
    assert not guarded.switched
    assert free.comparisons[0] == guarded.comparisons[0]  # the same draws against the served
    # the baseline equal to the served model adds no comparison
    same = decide_served_model(
        labels, served, {"personalized": cand}, units=units, baseline_scores=served.copy()
    )
    assert {c.reference for c in same.comparisons} == {"served"}


def test_edge_cases_keep_the_served_model_with_a_reason():
    d = decide_served_model([], [], {"personalized": []})
    assert d.serve == "served" and not d.switched and d.reason == KEEP_REASON_NO_CLIPS
    d = decide_served_model([0, 0, 0], [0.1, 0.2, 0.3], {"personalized": [0.0, 0.0, 0.0]})
    assert not d.switched and "no wake-word clips" in d.reason
    d = decide_served_model([1, 1], [0.9, 0.8], {"personalized": [0.1, 0.2]})
    assert not d.switched and "no other" in d.reason
    d = decide_served_model([1, 0], [0.9, 0.1], {})
    assert not d.switched and "no candidate" in d.reason
    # all-equal scores: the served model accepts everything at its threshold
    labels = np.array([1, 1, 0, 0, 0, 1, 0, 0])
    flat = np.full(8, 0.5)
    d = decide_served_model(labels, flat, {"personalized": flat.copy()}, n_boot=50)
    assert d.comparisons[0].relative_fa == 1.0 and not d.switched  # equal: no evidence
    good = np.where(labels == 1, 0.9, 0.1)
    d = decide_served_model(labels, flat, {"personalized": good}, n_boot=50)
    assert not d.switched and "3 validation wake words, fewer than the 10" in d.reason
    d = decide_served_model(labels, flat, {"personalized": good}, n_boot=50, min_positives=3)
    assert d.switched and d.comparisons[0].relative_fa == 0.0
    d = decide_served_model(labels, good, {"personalized": flat}, n_boot=50)
    assert not d.switched and d.comparisons[0].relative_fa is None  # unbounded: 0 FA -> some
    assert d.comparisons[0].worse_beyond_noise


def test_bad_input_is_refused():
    labels = [1, 0, 1, 0]
    with pytest.raises(NonFiniteError):
        decide_served_model(labels, [0.1, math.nan, 0.3, 0.4], {"personalized": [0.1] * 4})
    with pytest.raises(NonFiniteError):
        decide_served_model(labels, [0.1] * 4, {"personalized": [0.1, 0.2, math.inf, 0.1]})
    with pytest.raises(NonFiniteError):
        decide_served_model(labels, [0.1] * 4, {"p": [0.1] * 4}, baseline_scores=[math.nan] * 4)
    with pytest.raises(ValueError, match="scores for"):
        decide_served_model(labels, [0.1] * 3, {"p": [0.1] * 4})
    with pytest.raises(ValueError, match="labels"):
        decide_served_model([1, 0, 2, 0], [0.1] * 4, {"p": [0.1] * 4})
    with pytest.raises(ValueError, match="units"):
        decide_served_model(labels, [0.1] * 4, {"p": [0.1] * 4}, units=["a"])
    with pytest.raises(ValueError, match="unique"):
        decide_served_model(labels, [0.1] * 4, {"served": [0.1] * 4})
    with pytest.raises(ValueError):
        decide_served_model(labels, [0.1] * 4, {"p": [0.1] * 4}, n_boot=0)


def test_the_decision_serialises_for_the_uplink_and_the_summary():
    rng = np.random.default_rng(11)
    labels, units, feature = _clips(rng)
    served = _model(feature, labels, rng, skill=0.0)
    d = decide_served_model(
        labels,
        served,
        {"personalized": 1.0 - served, "global": _model(feature, labels, rng, skill=2.0)},
        units=units,
        baseline_scores=_model(feature, labels, rng, skill=0.3),
        n_boot=100,
    )
    doc = d.as_dict()
    text = json.dumps(doc, allow_nan=False)
    assert len(text) < 4000
    assert doc["serve"] == d.serve and doc["served_before"] == "served"
    assert len(doc["comparisons"]) == 4
    scalars = d.uplink_scalars()
    assert all(isinstance(v, float) and math.isfinite(v) for v in scalars.values())
    assert scalars["gate_switched"] == float(d.switched)
    assert scalars["gate_choice"] == (
        0.0 if not d.switched else 1.0 + ["personalized", "global"].index(d.serve)
    )
    assert scalars["gate_personalized_admissible"] == 0.0
    from wakefl.protocol.records import check_record

    assert check_record(scalars, gate_uplink_schema(), "uplink scalars") == scalars
