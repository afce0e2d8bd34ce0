"""The served-model gate's admission rule (sdk/gate_admission.py), row by row: each row is
the evidence one candidate brings (its figures against the served model and, where it
differs, the baseline) and the verdict the rule must give."""

from __future__ import annotations

from dataclasses import replace

import pytest

from wakefl.sdk.gate_admission import (
    MIN_POSITIVES,
    Comparison,
    GateRule,
    Verdict,
    admission,
)

ENOUGH = 40  # validation wake words: more than MIN_POSITIVES

TIE = Comparison(
    candidate="personalized",
    reference="served",
    relative_fa=1.0,
    relative_fa_ci=(1.0, 1.0),
    relative_fr=1.0,
    relative_fr_ci=(1.0, 1.0),
    reference_fa=0.0,
    candidate_fa=0.0,
    reference_fr=0.5,
    candidate_fr=0.5,
    reference_fa_count=0,
    candidate_fa_count=0,
    replicates=500,
    worse_beyond_noise=False,
    no_worse_point=True,
    better_point=False,
    relative_fr_matched_fa=1.0,
    relative_fr_matched_fa_ci=(1.0, 1.0),
    fewer_misses=False,
)


def _misses(point: float, lo: float | None, hi: float | None, **kw) -> Comparison:
    """Tied at matched FR (no false accept by either), `point` [lo, hi] at matched FA."""
    return replace(
        TIE,
        relative_fr_matched_fa=point,
        relative_fr_matched_fa_ci=(lo, hi),
        fewer_misses=point < 1,
        worse_beyond_noise=lo is None or lo > 1,
        **kw,
    )


def _fewer_fa(point: float, lo: float, hi: float | None) -> Comparison:
    """Fewer false accepts at matched FR (`point` [lo, hi]), tied at matched FA."""
    return replace(
        TIE,
        relative_fa=point,
        relative_fa_ci=(lo, hi),
        reference_fa_count=8,
        candidate_fa_count=round(8 * point),
        better_point=point < 1,
        no_worse_point=point <= 1,
    )


def _vs_baseline(c: Comparison) -> Comparison:
    return replace(c, reference="baseline")


KEEP, SWITCH = GateRule(), GateRule(ties="switch")

# (case, vs served, vs baseline, wake words, rule, verdict)
CASES = [
    ("no validation data", None, None, 0, KEEP, Verdict.NO_EVIDENCE),
    (
        "too few wake words, however good it looks",
        _misses(0.2, 0.0, 0.5),
        None,
        MIN_POSITIVES - 1,
        KEEP,
        Verdict.TOO_FEW_WAKE_WORDS,
    ),
    (
        "no bootstrap replicate",
        replace(_misses(0.5, 0.2, 0.8), replicates=0),
        None,
        ENOUGH,
        KEEP,
        Verdict.NO_INTERVAL,
    ),
    (
        "wide interval, better point figure: kept out (the fleet's E: 0.93 [0.38, 1.83])",
        _misses(0.93, 0.38, 1.83),
        None,
        ENOUGH,
        KEEP,
        Verdict.NOT_SHOWN_NO_WORSE,
    ),
    (
        "better point figure, unbounded upper end",
        _misses(0.6, 0.0, None),
        None,
        ENOUGH,
        KEEP,
        Verdict.NOT_SHOWN_NO_WORSE,
    ),
    ("clearly better: admitted", _misses(0.45, 0.2, 0.7), None, ENOUGH, KEEP, Verdict.ADMIT),
    (
        "upper end exactly at the bound: kept out (the fleet's E: 0.50 [0.14, 1.00])",
        _misses(0.5, 0.14, 1.0),
        None,
        ENOUGH,
        KEEP,
        Verdict.NOT_SHOWN_NO_WORSE,
    ),
    (
        "a looser bound admits a wider interval",
        _misses(0.8, 0.5, 1.1),
        None,
        ENOUGH,
        GateRule(upper_bound=1.2),
        Verdict.ADMIT,
    ),
    (
        "worse beyond the noise",
        _misses(1.6, 1.2, 2.4),
        None,
        ENOUGH,
        KEEP,
        Verdict.WORSE,
    ),
    (
        "worse point figure within the noise",
        _misses(1.2, 0.7, 1.9),
        None,
        ENOUGH,
        KEEP,
        Verdict.NOT_BETTER,
    ),
    (
        "fewer false accepts at matched FR, shown no worse",
        _fewer_fa(0.5, 0.2, 0.9),
        None,
        ENOUGH,
        KEEP,
        Verdict.ADMIT,
    ),
    (
        "fewer false accepts at matched FR, interval reaching above 1",
        _fewer_fa(0.6, 0.3, 1.4),
        None,
        ENOUGH,
        KEEP,
        Verdict.NOT_SHOWN_NO_WORSE,
    ),
    (
        "better than the served model, not shown no worse than the baseline",
        _misses(0.5, 0.3, 0.8),
        _vs_baseline(_misses(0.9, 0.5, 1.4)),
        ENOUGH,
        KEEP,
        Verdict.NOT_SHOWN_NO_WORSE,
    ),
    (
        "better than the served model, worse than the baseline beyond the noise",
        _misses(0.5, 0.3, 0.8),
        _vs_baseline(_misses(1.5, 1.1, 2.0)),
        ENOUGH,
        KEEP,
        Verdict.WORSE,
    ),
    (
        "shown no worse than both",
        _misses(0.5, 0.3, 0.8),
        _vs_baseline(_misses(0.7, 0.4, 0.95)),
        ENOUGH,
        KEEP,
        Verdict.ADMIT,
    ),
    ("a tie keeps the served model", TIE, None, ENOUGH, KEEP, Verdict.TIE),
    ("a tie switches under ties=switch", TIE, None, ENOUGH, SWITCH, Verdict.ADMIT),
    (
        "a tie not shown no worse keeps, even under ties=switch",
        replace(TIE, relative_fa_ci=(0.0, None), relative_fr_matched_fa_ci=(0.0, 2.0)),
        None,
        ENOUGH,
        SWITCH,
        Verdict.TIE,
    ),
]


@pytest.mark.parametrize(
    ("case", "vs_served", "vs_baseline", "n_positive", "rule", "verdict"),
    CASES,
    ids=[c[0] for c in CASES],
)
def test_admission(case, vs_served, vs_baseline, n_positive, rule, verdict):
    got = admission(vs_served, vs_baseline, n_positive, rule)
    assert got.verdict is verdict, got.why
    assert got.admitted == (verdict is Verdict.ADMIT)
    assert got.why


def test_every_verdict_is_covered_by_the_table():
    assert {c[5] for c in CASES} == set(Verdict)


def test_the_reason_names_the_interval_that_kept_it_out():
    got = admission(_misses(0.93, 0.38, 1.83), None, ENOUGH, KEEP)
    assert "0.93" in got.why and "[0.38, 1.83]" in got.why and "not below the bound 1.00" in got.why


@pytest.mark.parametrize(
    "bad",
    [
        {"ties": "maybe"},
        {"upper_bound": 0.0},
        {"upper_bound": float("inf")},
        {"min_positives": 0},
    ],
)
def test_bad_rules_are_refused(bad):
    with pytest.raises(ValueError):
        GateRule(**bad)
