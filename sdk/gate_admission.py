"""The served-model gate's admission rule, as a pure function of the evidence.

`sdk/served_model_gate.py` measures one candidate against the served model S and the
shipped baseline B on the device's validation data (point figures and paired bootstrap
intervals: `Comparison`); `admission` decides from those figures alone whether the
candidate may be served. No I/O and no numpy, so every branch is a row of
tests/test_gate_admission.py. docs/SELF_FL.md ("The served-model gate") states the rule.

Why a candidate needs evidence that it is better, not merely no evidence that it is worse:
on the 43 validation wake words of a fleet demo device the interval of relative FR at
matched FA spans 0.4 to 1.8, so a rule that keeps out only candidates whose whole interval
lies above 1 serves a model whose better point figure is noise, and the fleet demo served
such a model that then missed more wake words on its test streams. Here a candidate is
admitted only in a view where it is better by its point figures *and* the upper end of that view's
interval lies below `GateRule.upper_bound` (1 by default) against the served model and
the baseline: the wider the interval (the less evidence), the better the point figure has
to be for its upper end to stay under the bound, so caution grows as evidence shrinks.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# Fewer wake-word clips than this and a bootstrap over them cannot resolve a miss rate
# (one miss moves it by more than a tenth): the gate keeps the served model.
MIN_POSITIVES = 10
# The bound the upper end of a view's interval must lie below: at 1.0 a candidate is served
# only when the whole interval says it misses fewer wake words than the reference at the
# same false accepts (or makes fewer false accepts at the same misses). An upper end of
# exactly 1 is not enough: the fleet demo's device E served a model admitted at 0.50
# [0.14, 1.00] on validation that missed more on its test streams, 1.17 [1.00, 1.42].
UPPER_BOUND = 1.0
TIE_RULES = ("keep", "switch")
# The two views of one comparison: fewer misses at the reference's false accepts, or, at
# the reference's miss rate, fewer false accepts (or fewer misses) than it.
MISSES = "misses at matched FA"
MATCHED_FR = "FA and FR at matched FR"
VIEWS = (MISSES, MATCHED_FR)


@dataclass(frozen=True)
class GateRule:
    """The gate's settings: the bound an interval's upper end must lie below, the
    fewest validation wake words it decides on, and what a tie does ("keep": a switch
    needs a better point figure; "switch": no worse suffices)."""

    upper_bound: float = UPPER_BOUND
    min_positives: int = MIN_POSITIVES
    ties: str = "keep"

    def __post_init__(self) -> None:
        if self.ties not in TIE_RULES:
            raise ValueError(f"ties must be one of {', '.join(TIE_RULES)}, got {self.ties!r}")
        if not (isinstance(self.upper_bound, int | float) and math.isfinite(self.upper_bound)):
            raise ValueError(f"upper_bound must be a finite number, got {self.upper_bound!r}")
        if self.upper_bound <= 0:
            raise ValueError(f"upper_bound must be > 0, got {self.upper_bound!r}")
        if not isinstance(self.min_positives, int) or self.min_positives < 1:
            raise ValueError(f"min_positives must be an integer >= 1, got {self.min_positives!r}")


Interval = tuple[float | None, float | None]


@dataclass(frozen=True)
class Comparison:
    """One candidate against one reference model on the device's validation data.

    Ratios are None where unbounded (the reference makes no such error, the candidate
    does); an interval bound of None is unbounded too (+inf: ratios are never negative).
    `replicates` counts the bootstrap replicates that could be evaluated."""

    candidate: str
    reference: str
    relative_fa: float | None
    relative_fa_ci: Interval
    relative_fr: float | None
    relative_fr_ci: Interval
    reference_fa: float
    candidate_fa: float
    reference_fr: float
    candidate_fr: float
    reference_fa_count: int
    candidate_fa_count: int
    replicates: int
    worse_beyond_noise: bool
    no_worse_point: bool  # point relative FA <= 1 and relative FR <= 1
    better_point: bool = False  # no worse, and relative FA < 1 or relative FR < 1
    # FR(C) / FR(S) with both at the lowest threshold keeping S's FA (None: unbounded)
    relative_fr_matched_fa: float | None = 1.0
    relative_fr_matched_fa_ci: Interval = (None, None)
    fewer_misses: bool = False  # relative FR at matched FA < 1

    def uppers(self, view: str) -> tuple[float | None, ...]:
        """The upper ends of the intervals of `view` (None: unbounded or no replicate):
        MISSES, relative FR at matched FA; MATCHED_FR, relative FA and relative FR at
        matched FR."""
        if not self.replicates:
            return (None,) if view == MISSES else (None, None)
        if view == MISSES:
            return (self.relative_fr_matched_fa_ci[1],)
        return self.relative_fa_ci[1], self.relative_fr_ci[1]

    def better_in(self, view: str) -> bool:
        """Better than the reference in the point figures of `view`."""
        return self.fewer_misses if view == MISSES else self.better_point

    def as_dict(self) -> dict:
        """JSON values: an unbounded figure is "unbounded"; an interval without any
        evaluable replicate is [null, null]."""
        fa_ci = _interval(self.relative_fa_ci) if self.replicates else [None, None]
        fr_ci = _interval(self.relative_fr_ci) if self.replicates else [None, None]
        mfa_ci = _interval(self.relative_fr_matched_fa_ci) if self.replicates else [None, None]
        return {
            "candidate": self.candidate,
            "reference": self.reference,
            "relative_fa": _num(self.relative_fa),
            "relative_fa_ci": fa_ci,
            "relative_fr": _num(self.relative_fr),
            "relative_fr_ci": fr_ci,
            "reference_fa": _num(self.reference_fa),
            "candidate_fa": _num(self.candidate_fa),
            "reference_fr": _num(self.reference_fr),
            "candidate_fr": _num(self.candidate_fr),
            "reference_fa_count": self.reference_fa_count,
            "candidate_fa_count": self.candidate_fa_count,
            "replicates": self.replicates,
            "worse_beyond_noise": self.worse_beyond_noise,
            "no_worse_point": self.no_worse_point,
            "better_point": self.better_point,
            "relative_fr_matched_fa": _num(self.relative_fr_matched_fa),
            "relative_fr_matched_fa_ci": mfa_ci,
            "fewer_misses": self.fewer_misses,
        }


class Verdict(enum.Enum):
    ADMIT = "admit"
    NO_EVIDENCE = "no_evidence"  # nothing was compared (no validation data)
    TOO_FEW_WAKE_WORDS = "too_few_wake_words"  # fewer than `min_positives`
    NO_INTERVAL = "no_interval"  # no bootstrap replicate could be evaluated
    WORSE = "worse_beyond_noise"  # an interval lies wholly above 1
    NOT_SHOWN_NO_WORSE = "not_shown_no_worse"  # better by its point figure, not beyond the noise
    NOT_BETTER = "not_better"  # worse in a point figure
    TIE = "tie"  # the same errors: nothing shows that a switch helps


@dataclass(frozen=True)
class Admission:
    """Whether a candidate may be served, the verdict and the words saying why."""

    admitted: bool
    verdict: Verdict
    why: str


def admission(
    vs_served: Comparison | None,
    vs_baseline: Comparison | None,
    n_positive: int,
    rule: GateRule,
) -> Admission:
    """May the candidate of `vs_served` (and `vs_baseline`, None when the baseline is the
    served model or unknown) be served? In order: evidence enough (compared at all, at
    least `min_positives` wake words, a bootstrap interval against every reference); not
    worse beyond the noise against any reference (an interval wholly above 1); then, in
    one of the two views, better than S in the point figures *and* the upper end of that
    view's interval(s) below `upper_bound` against every reference (the gain shown beyond
    the noise): MISSES, fewer misses at matched FA; MATCHED_FR, at matched FR no more false
    accepts and no more misses with one of them fewer. A tie in both views keeps S, or
    under `ties="switch"` is admitted when its upper ends are at most the bound in a view."""
    if vs_served is None:
        return Admission(False, Verdict.NO_EVIDENCE, "nothing was compared")
    refs = [c for c in (vs_served, vs_baseline) if c is not None]
    lacking = _lacking_evidence(refs, n_positive, rule)
    if lacking is not None:
        return lacking
    who = vs_served.candidate
    shown = [v for v in VIEWS if all(_shown_better(c.uppers(v), rule.upper_bound) for c in refs)]
    claimed = [v for v in VIEWS if vs_served.better_in(v)]
    for v in claimed:
        if v in shown:
            return Admission(
                True,
                Verdict.ADMIT,
                f"{who} is better than {vs_served.reference} in {v}, beyond the noise",
            )
    if claimed:
        v = claimed[0]
        worst = next(r for r in refs if not _shown_better(r.uppers(v), rule.upper_bound))
        return Admission(
            False,
            Verdict.NOT_SHOWN_NO_WORSE,
            f"{who} is better than {vs_served.reference} in {v} on the local clips but not "
            f"shown better than {worst.reference} there: {_view_figures(worst, v)}, not "
            f"below the bound {rule.upper_bound:.2f}",
        )
    tie_shown = any(all(_at_most(c.uppers(v), rule.upper_bound) for c in refs) for v in VIEWS)
    return _no_better(vs_served, tie_shown, rule)


def _lacking_evidence(refs: list[Comparison], n_positive: int, rule: GateRule) -> Admission | None:
    """Why the evidence cannot admit the candidate at all (None: it may): too few wake
    words, no interval, or worse beyond the noise against a reference."""
    who = refs[0].candidate
    if n_positive < rule.min_positives:
        return Admission(
            False,
            Verdict.TOO_FEW_WAKE_WORDS,
            f"{n_positive} validation wake words, fewer than the {rule.min_positives} the "
            "gate decides on",
        )
    for c in refs:
        if c.replicates == 0:
            return Admission(
                False,
                Verdict.NO_INTERVAL,
                f"{who} vs {c.reference}: no bootstrap replicate could be evaluated",
            )
    for c in refs:
        if c.worse_beyond_noise:
            return Admission(
                False, Verdict.WORSE, f"{who} is worse than {c.reference} {_beyond(c)}"
            )
    return None


def _no_better(c: Comparison, shown: bool, rule: GateRule) -> Admission:
    """The verdict on a candidate better than S in neither view: worse in a point figure,
    or a tie (admitted only under `ties="switch"`, its upper ends at most the bound)."""
    who, mfa = c.candidate, c.relative_fr_matched_fa
    if not c.no_worse_point or mfa is None or mfa > 1.0:
        return Admission(
            False,
            Verdict.NOT_BETTER,
            f"{who} is not as good as {c.reference} on the local clips (relative FA "
            f"{_fmt(c.relative_fa)}, relative FR {_fmt(c.relative_fr)}, relative FR at "
            f"matched FA {_fmt(mfa)})",
        )
    if rule.ties == "switch" and shown:
        return Admission(True, Verdict.ADMIT, f"{who} ties with {c.reference}; ties switch")
    return Admission(
        False,
        Verdict.TIE,
        f"{who} is no better than {c.reference} on the local clips ({c.candidate_fa_count} "
        f"against {c.reference_fa_count} false accepts, relative FR {_fmt(c.relative_fr)}, "
        f"relative FR at matched FA {_fmt(mfa)}): nothing shows that a switch helps",
    )


def _at_most(uppers: tuple[float | None, ...], bound: float) -> bool:
    return all(u is not None and u <= bound for u in uppers)


def _shown_better(uppers: tuple[float | None, ...], bound: float) -> bool:
    """Every upper end at most the bound and one below it: at matched FR the misses are
    matched by construction (relative FR's interval sits at 1), so the gain there is in
    false accepts."""
    return _at_most(uppers, bound) and any(u is not None and u < bound for u in uppers)


def _view_figures(c: Comparison, view: str) -> str:
    if view == MISSES:
        return (
            f"relative FR at matched FA {_fmt(c.relative_fr_matched_fa)}, interval "
            f"{_fmt_ci(c.relative_fr_matched_fa_ci)}"
        )
    return (
        f"relative FA {_fmt(c.relative_fa)}, interval {_fmt_ci(c.relative_fa_ci)}, relative "
        f"FR {_fmt(c.relative_fr)}, interval {_fmt_ci(c.relative_fr_ci)}"
    )


def _beyond(c: Comparison) -> str:
    return (
        f"beyond the noise (relative FA {_fmt(c.relative_fa)}, interval "
        f"{_fmt_ci(c.relative_fa_ci)}; relative FR {_fmt(c.relative_fr)}, interval "
        f"{_fmt_ci(c.relative_fr_ci)}; relative FR at matched FA "
        f"{_fmt(c.relative_fr_matched_fa)}, interval {_fmt_ci(c.relative_fr_matched_fa_ci)})"
    )


def _num(x: float | None) -> float | str | None:
    if x is None:
        return "unbounded"
    return round(float(x), 6)


def _interval(ci: Interval) -> list:
    return [_num(ci[0]), _num(ci[1])]


def _fmt(x: float | None) -> str:
    return "unbounded" if x is None else f"{x:.2f}"


def _fmt_ci(ci: Interval) -> str:
    return f"[{_fmt(ci[0])}, {_fmt(ci[1])}]"


__all__ = [
    "UPPER_BOUND",
    "MIN_POSITIVES",
    "MATCHED_FR",
    "MISSES",
    "TIE_RULES",
    "VIEWS",
    "Admission",
    "Comparison",
    "GateRule",
    "Verdict",
    "admission",
]
