"""The served-model gate ("do no harm"): which model a device serves after a round.

After each round a device holds the model it serves now and new candidates (the new
personalized model, the global model). It scores all of them on its local validation
clips and switches only to a candidate that is better there and whose bootstrap interval
shows it no worse than the served model and the shipped baseline; otherwise it keeps
serving the model it has. docs/SELF_FL.md ("The served-model gate") states the rule; pure numpy,
no I/O.

Conventions are wake_metrics' (module docstring there): a clip is accepted when
``score >= threshold``; the reference's threshold is the largest whose FR is <= the
target FR, the candidate's is matched to the FR the reference has there; ratios over a
zero rate follow `safe_ratio` (0/0 = 1, x/0 unbounded).

The rule, for each candidate C against the served model S (and against the baseline B,
the model the device shipped with, when its scores are given):

1. Point figures on all clips: relative FA = FA(C) / FA(S) at matched FR, relative FR
   = FR(C) / FR(S) at those thresholds, and relative FR at matched FA: the FA level is
   S's FA at its threshold, both models work at the lowest threshold whose FA stays
   within it (wake_metrics.relative_fr_at_matched_clip_fa), and the ratio is C's FR over
   S's there: below 1, C misses fewer wake words at no more false accepts.
2. A paired bootstrap over units (speakers; each clip its own unit when none are given):
   every replicate draws units with replacement, refits S's threshold to the target FR on
   the drawn clips, rematches C, and computes the three ratios (unbounded counts as +inf).
   Percentile intervals at `level` (the bounds are the order statistics just outside the
   nominal quantiles, as in wake_metrics).
3. C is *worse beyond the noise* than a reference when the lower bound of its relative
   FA interval, of its relative FR interval or of its relative FR at matched FA interval
   is > 1 (an unbounded lower bound counts as > 1): more false accepts, or more misses,
   than the noise explains.
4. C is *admissible* (gate_admission.admission, where the rule is a pure function of
   these figures) when the device has at least `min_positives` validation wake words,
   C is not worse beyond the noise than S nor than B, and in one view C is better than S
   in the point figures and *better beyond the noise* than S and than B: the upper end of
   that view's interval lies below `upper_bound` (1 by default). The views: fewer misses
   at matched FA (relative FR at matched FA), or at matched FR relative FA <= 1 and
   relative FR <= 1 with one of them < 1 (both intervals' upper ends below the bound). A
   tie keeps S (`ties="switch"` admits a tie whose upper ends are at most the bound).
   Checking B as well stops a chain of switches from drifting away from the shipped model.
5. The device serves the admissible candidate with the lowest point relative FA against S,
   then the lowest relative FR at matched FA (ties: the first in the order given, e.g.
   personalized before global); with none, it
   keeps serving S.

Without local validation clips, without wake-word clips or without other clips nothing
can be compared: S is kept and the reason says why. NaN or Inf scores raise
`NonFiniteError`; a comparison whose every replicate drew no wake-word or no other clip
has no interval and is not admissible.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from wakefl.errors import NonFiniteError
from wakefl.sdk.gate_admission import (
    MIN_POSITIVES,
    TIE_RULES,
    UPPER_BOUND,
    Admission,
    Comparison,
    GateRule,
    admission,
)
from wakefl.sdk.wake_metrics import (
    baseline_threshold,
    clip_fa_curve,
    fa_at,
    fr_at,
    matched_fa_thresholds,
    matched_threshold,
    percentile_interval,
    relative_fa_fr,
    safe_ratio,
)

if TYPE_CHECKING:
    from wakefl.protocol.records import RecordSchema

ArrayLike = Sequence[float] | np.ndarray
KEEP_REASON_NO_CLIPS = "no local validation clips: nothing to compare on, the served model is kept"


@dataclass(frozen=True)
class GateDecision:
    """Which model to serve, and the evidence. `serve` is `served_name` (keep) or the
    name of the chosen candidate; `comparisons` holds every candidate's comparisons, in
    the order given, each against the served model and then (if given) the baseline."""

    serve: str
    served_name: str
    switched: bool
    reason: str
    target_fr: float
    level: float
    n_boot: int
    seed: int
    n_positive: int
    n_negative: int
    n_units: int
    rule: GateRule = GateRule()
    comparisons: tuple[Comparison, ...] = ()
    admissible: tuple[str, ...] = ()
    # (candidate, gate_admission.Verdict value) for every candidate judged, in order
    verdicts: tuple[tuple[str, str], ...] = ()

    def as_dict(self) -> dict:
        """A small JSON-serialisable dict (no NaN or Inf: unbounded figures are
        "unbounded") for the device's summary and report."""
        return {
            "serve": self.serve,
            "served_before": self.served_name,
            "switched": self.switched,
            "reason": self.reason,
            "target_fr": self.target_fr,
            "level": self.level,
            "n_boot": self.n_boot,
            "seed": self.seed,
            "n_positive": self.n_positive,
            "n_negative": self.n_negative,
            "n_units": self.n_units,
            "rule": {
                "upper_bound": self.rule.upper_bound,
                "min_positives": self.rule.min_positives,
                "ties": self.rule.ties,
            },
            "admissible": list(self.admissible),
            "verdicts": dict(self.verdicts),
            "comparisons": [c.as_dict() for c in self.comparisons],
        }

    def uplink_scalars(self, prefix: str = "gate_") -> dict[str, float]:
        """Flat finite scalars for an uplink's scalar map: `gate_switched` (0/1),
        `gate_choice` (0: kept the served model, k: the k-th candidate given), and per
        candidate against the served model `gate_<name>_relative_fa`, `_fa_lower`,
        `_fa_upper`, `_relative_fr` and `_admissible`. A figure that is unbounded or was not
        measured is left out."""
        out: dict[str, float] = {f"{prefix}switched": 1.0 if self.switched else 0.0}
        names: list[str] = []
        for c in self.comparisons:
            if c.candidate not in names:
                names.append(c.candidate)
        out[f"{prefix}choice"] = float(names.index(self.serve) + 1) if self.serve in names else 0.0
        for c in self.comparisons:
            if c.reference != self.served_name:
                continue
            key = f"{prefix}{c.candidate}_"
            for name, value in (
                ("relative_fa", c.relative_fa),
                ("fa_lower", c.relative_fa_ci[0]),
                ("fa_upper", c.relative_fa_ci[1]),
                ("relative_fr", c.relative_fr),
            ):
                if value is not None and math.isfinite(value):
                    out[key + name] = float(value)
            out[key + "admissible"] = 1.0 if c.candidate in self.admissible else 0.0
        return out


def decide_served_model(
    labels: Sequence[int] | np.ndarray,
    served_scores: ArrayLike,
    candidates: Mapping[str, ArrayLike],
    *,
    units: Sequence[str] | np.ndarray | None = None,
    baseline_scores: ArrayLike | None = None,
    served_name: str = "served",
    target_fr: float = 0.05,
    n_boot: int = 500,
    seed: int = 0,
    level: float = 0.95,
    ties: str = "keep",
    upper_bound: float = UPPER_BOUND,
    min_positives: int = MIN_POSITIVES,
) -> GateDecision:
    """Decide which model a device serves (the rule is in the module docstring).

    `labels` (1 = wake word, 0 = other) and every score array cover the same local
    validation clips in the same order: `served_scores` of the model served now,
    `candidates` name -> scores (in order of preference on ties, e.g. {"personalized": ...,
    "global": ...}), `baseline_scores` of the shipped model (optional; skipped when equal
    to the served model's). `units` gives each clip's bootstrap unit (its speaker); None
    makes each clip its own unit. `ties` is "keep" (a candidate must be better than the
    served model in the point figures) or "switch" (no worse suffices); `upper_bound` and
    `min_positives` are `GateRule`'s. Deterministic for a `seed`.
    """
    _check_gate_settings(n_boot, level, target_fr)
    rule = GateRule(upper_bound=upper_bound, min_positives=min_positives, ties=ties)
    lab = np.asarray(labels).reshape(-1)
    served, cands, base, grp = _gate_inputs(
        lab, served_scores, candidates, baseline_scores, units, served_name
    )
    pos, neg = lab == 1, lab == 0
    common: dict[str, Any] = {
        "served_name": served_name,
        "target_fr": float(target_fr),
        "level": float(level),
        "n_boot": n_boot,
        "seed": int(seed),
        "n_positive": int(pos.sum()),
        "n_negative": int(neg.sum()),
        "n_units": int(np.unique(grp).size),
        "rule": rule,
    }
    nothing_to_compare = _nothing_to_compare(lab, pos, neg, bool(cands))
    if nothing_to_compare:
        return GateDecision(serve=served_name, switched=False, reason=nothing_to_compare, **common)
    references = {served_name: served}
    if base is not None and not np.array_equal(base, served):
        references["baseline"] = base
    draws = list(unit_draws(np.random.default_rng(seed), grp, pos, neg, n_boot))
    comparisons = _compare_all(cands, references, pos, neg, float(target_fr), draws, float(level))
    verdicts = _admissions(cands, comparisons, served_name, int(pos.sum()), rule)
    return _decision(comparisons, verdicts, common)


def _compare_all(
    cands: Mapping[str, np.ndarray],
    references: Mapping[str, np.ndarray],
    pos: np.ndarray,
    neg: np.ndarray,
    target_fr: float,
    draws: list,
    level: float,
) -> list[Comparison]:
    """Each candidate against each reference (served model, then baseline), on the same
    bootstrap draws."""
    return [
        _compare(cname, cands[cname], rname, references[rname], pos, neg, target_fr, draws, level)
        for cname in cands
        for rname in references
    ]


def _decision(
    comparisons: list[Comparison], verdicts: dict[str, Admission], common: dict[str, Any]
) -> GateDecision:
    """Keep the served model when no candidate is admissible, else switch to the
    admissible candidate with the lowest relative FA against it (first given on ties)."""
    served_name = common["served_name"]
    admissible = [name for name, v in verdicts.items() if v.admitted]
    judged = tuple((name, v.verdict.value) for name, v in verdicts.items())
    if not admissible:
        return GateDecision(
            serve=served_name,
            switched=False,
            reason="the served model is kept: " + "; ".join(v.why for v in verdicts.values()),
            comparisons=tuple(comparisons),
            admissible=(),
            verdicts=judged,
            **common,
        )
    point = {
        c.candidate: (_inf(c.relative_fa), _inf(c.relative_fr_matched_fa))
        for c in comparisons
        if c.reference == served_name
    }
    best = min(admissible, key=lambda n: (*point[n], admissible.index(n)))
    c = next(x for x in comparisons if x.candidate == best and x.reference == served_name)
    against_baseline = any(x.reference == "baseline" for x in comparisons)
    return GateDecision(
        serve=best,
        switched=True,
        reason=(
            f"{best} is served: relative FA {_fmt(c.relative_fa)} (interval "
            f"{_fmt_ci(c.relative_fa_ci)}) and relative FR {_fmt(c.relative_fr)} against "
            f"{served_name}; it misses {_fmt(c.relative_fr_matched_fa)} times as many wake "
            f"words at no more false accepts (interval {_fmt_ci(c.relative_fr_matched_fa_ci)}, "
            f"upper end below the bound {common['rule'].upper_bound:.2f}); better beyond the "
            "noise" + (" than the baseline too" if against_baseline else "")
        ),
        comparisons=tuple(comparisons),
        admissible=tuple(admissible),
        **common,
    )


def _nothing_to_compare(
    lab: np.ndarray, pos: np.ndarray, neg: np.ndarray, any_candidate: bool
) -> str:
    """Why the served model is kept without any comparison ("" when there is something
    to compare)."""
    if lab.size == 0:
        return KEEP_REASON_NO_CLIPS
    if not pos.any() or not neg.any():
        missing = "wake-word" if not pos.any() else "other (non-wake-word)"
        return f"no {missing} clips in the local validation set: the served model is kept"
    if not any_candidate:
        return "no candidate model: the served model is kept"
    return ""


def _check_gate_settings(n_boot: Any, level: Any, target_fr: Any) -> None:
    if not isinstance(n_boot, int) or isinstance(n_boot, bool) or n_boot < 1:
        raise ValueError(f"n_boot must be an integer >= 1, got {n_boot!r}")
    if not (isinstance(level, int | float) and 0.0 < level < 1.0):
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if not (
        isinstance(target_fr, int | float) and math.isfinite(target_fr) and 0.0 <= target_fr < 1.0
    ):
        raise ValueError(f"target_fr must be a number in [0, 1), got {target_fr!r}")


def _gate_inputs(
    lab: np.ndarray,
    served_scores: ArrayLike,
    candidates: Mapping[str, ArrayLike],
    baseline_scores: ArrayLike | None,
    units: Sequence[str] | np.ndarray | None,
    served_name: str,
) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None, np.ndarray]:
    """The served, candidate and baseline scores and each clip's unit, checked against
    the labels (same length, 0/1 labels, unique candidate names)."""
    served = _scores(served_scores, served_name, lab.size)
    cands = {}
    for name, scores in candidates.items():
        if name == served_name or name in cands:
            raise ValueError(f"candidate name {name!r} is not unique")
        cands[str(name)] = _scores(scores, name, lab.size)
    base = None if baseline_scores is None else _scores(baseline_scores, "baseline", lab.size)
    if lab.size and not np.all(np.isin(lab, (0, 1))):
        raise ValueError("labels must be 0 or 1")
    grp = (
        np.arange(lab.size).astype(str)
        if units is None
        else np.asarray(units, dtype=str).reshape(-1)
    )
    if grp.size != lab.size:
        raise ValueError(f"{grp.size} units for {lab.size} clips")
    return served, cands, base, grp


def _admissions(
    cands: Mapping[str, np.ndarray],
    comparisons: list[Comparison],
    served_name: str,
    n_positive: int,
    rule: GateRule,
) -> dict[str, Admission]:
    """Each candidate's verdict under `rule` (gate_admission.admission), in the order
    given."""
    out = {}
    for cname in cands:
        vs_served = next(
            c for c in comparisons if c.candidate == cname and c.reference == served_name
        )
        vs_base = next(
            (c for c in comparisons if c.candidate == cname and c.reference == "baseline"), None
        )
        out[cname] = admission(vs_served, vs_base, n_positive, rule)
    return out


def gate_uplink_schema(
    candidates: Sequence[str] = ("personalized", "global"), prefix: str = "gate_"
) -> RecordSchema:
    """The scalars `GateDecision.uplink_scalars` may put into an uplink, for the given
    candidate names, and the served model's relative FA/FR against the baseline
    (`<prefix>served_relative_fa`, `_fr`), all optional: merged into a strategy's
    `uplink_schema` (`with_gate_schema`), they let the decision travel in the uplink's
    scalar map."""
    # Imported here: the gate itself needs numpy only, the schema types live with torch's.
    from wakefl.protocol.records import MAX_RECORD_ABS, ScalarSpec

    schema: dict[str, ScalarSpec] = {
        f"{prefix}switched": ScalarSpec(0.0, 1.0, integer=True, required=False),
        f"{prefix}choice": ScalarSpec(0.0, float(len(candidates)), integer=True, required=False),
    }
    for name in candidates:
        for field in ("relative_fa", "fa_lower", "fa_upper", "relative_fr"):
            schema[f"{prefix}{name}_{field}"] = ScalarSpec(0.0, MAX_RECORD_ABS, required=False)
        schema[f"{prefix}{name}_admissible"] = ScalarSpec(0.0, 1.0, integer=True, required=False)
    # The model served after the decision against the baseline (the device adds these).
    for field in ("relative_fa", "relative_fr"):
        schema[f"{prefix}served_{field}"] = ScalarSpec(0.0, MAX_RECORD_ABS, required=False)
    return schema


def with_gate_schema(uplink_schema: RecordSchema) -> RecordSchema:
    """A strategy's uplink schema with the gate's scalars merged in (the strategy's own
    declarations win on a name clash): what a server decodes device uplinks with."""
    return {**gate_uplink_schema(), **uplink_schema}


# ----------------------------------------------------------------------------- helpers


def _scores(x: ArrayLike, name: str, size: int) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64).reshape(-1)
    if arr.size != size:
        raise ValueError(f"{name}: {arr.size} scores for {size} labels")
    if not np.all(np.isfinite(arr)):
        raise NonFiniteError(
            f"{name}: {int(np.count_nonzero(~np.isfinite(arr)))} non-finite score(s)"
        )
    return arr


def unit_draws(
    rng: np.random.Generator, units: np.ndarray, pos: np.ndarray, neg: np.ndarray, n_boot: int
):
    """(positive indices, negative indices) of each replicate: units drawn with
    replacement, all clips of a drawn unit along; replicates without a positive or a
    negative are skipped. One set of draws serves every comparison (paired)."""
    keys, inverse = np.unique(units, return_inverse=True)
    members = [np.flatnonzero(inverse == k) for k in range(keys.size)]
    for _ in range(n_boot):
        drawn = np.concatenate([members[i] for i in rng.integers(0, keys.size, keys.size)])
        ip, ineg = drawn[pos[drawn]], drawn[neg[drawn]]
        if ip.size and ineg.size:
            yield ip, ineg


def _ratios(
    ref: np.ndarray, cand: np.ndarray, ip: np.ndarray, ineg: np.ndarray, target_fr: float
) -> tuple[float, float, float]:
    """Relative FA and FR at matched FR, and relative FR at matched FA, of the clips
    `ip` (wake words) and `ineg` (others); unbounded is +inf."""
    tr = baseline_threshold(ref[ip], target_fr)
    fr_r = fr_at(ref[ip], tr)
    tc = matched_threshold(cand[ip], fr_r)
    fa, _ = safe_ratio(fa_at(cand[ineg], tc), fa_at(ref[ineg], tr), "FA")
    fr, _ = safe_ratio(fr_at(cand[ip], tc), fr_r, "FR")
    mr, mc, _, _ = matched_fa_thresholds(
        ref[ip],
        cand[ip],
        clip_fa_curve(ref[ineg]),
        clip_fa_curve(cand[ineg]),
        fa_at(ref[ineg], tr),
    )
    mfa, _ = safe_ratio(fr_at(cand[ip], mc), fr_at(ref[ip], mr), "FR")
    return tuple(math.inf if x is None else x for x in (fa, fr, mfa))  # type: ignore[return-value]


def _compare(
    cname: str,
    cand: np.ndarray,
    rname: str,
    ref: np.ndarray,
    pos: np.ndarray,
    neg: np.ndarray,
    target_fr: float,
    draws: list,
    level: float,
) -> Comparison:
    res = relative_fa_fr(ref[pos], ref[neg], cand[pos], cand[neg], target_fr)
    point = _ratios(ref, cand, np.flatnonzero(pos), np.flatnonzero(neg), target_fr)
    mfa = None if math.isinf(point[2]) else point[2]
    values = [_ratios(ref, cand, ip, ineg, target_fr) for ip, ineg in draws]
    fa_ci, fr_ci, mfa_ci = (percentile_interval([v[k] for v in values], level) for k in range(3))
    worse = bool(draws) and any(_above_one(ci[0]) for ci in (fa_ci, fr_ci, mfa_ci))
    no_worse = (
        res.relative_fa is not None
        and res.relative_fa <= 1.0
        and res.relative_fr is not None
        and res.relative_fr <= 1.0
    )
    better = no_worse and (
        (res.relative_fa is not None and res.relative_fa < 1.0)
        or (res.relative_fr is not None and res.relative_fr < 1.0)
    )
    return Comparison(
        candidate=cname,
        reference=rname,
        relative_fa=res.relative_fa,
        relative_fa_ci=fa_ci,
        relative_fr=res.relative_fr,
        relative_fr_ci=fr_ci,
        reference_fa=res.baseline_fa,
        candidate_fa=res.candidate_fa,
        reference_fr=res.baseline_fr,
        candidate_fr=res.candidate_fr,
        reference_fa_count=int(np.count_nonzero(ref[neg] >= res.baseline_threshold)),
        candidate_fa_count=int(np.count_nonzero(cand[neg] >= res.candidate_threshold)),
        replicates=len(draws),
        worse_beyond_noise=worse,
        no_worse_point=no_worse,
        better_point=better,
        relative_fr_matched_fa=mfa,
        relative_fr_matched_fa_ci=mfa_ci,
        fewer_misses=mfa is not None and mfa < 1.0,
    )


def _inf(x: float | None) -> float:
    return math.inf if x is None else x


def _above_one(lower: float | None) -> bool:
    # A lower bound of None is +inf (every ratio >= 0), so it lies above 1.
    return lower is None or lower > 1.0


def _fmt(x: float | None) -> str:
    return "unbounded" if x is None else f"{x:.2f}"


def _fmt_ci(ci: tuple[float | None, float | None]) -> str:
    return f"[{_fmt(ci[0])}, {_fmt(ci[1])}]"


__all__ = [
    "UPPER_BOUND",
    "KEEP_REASON_NO_CLIPS",
    "MIN_POSITIVES",
    "TIE_RULES",
    "Comparison",
    "GateDecision",
    "GateRule",
    "decide_served_model",
    "gate_uplink_schema",
    "unit_draws",
    "with_gate_schema",
]
