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

The metrics are built in three parts: rates, operating thresholds, relative FA at matched FR
and its bootstrap (`matched_fr`); the figures of an evaluation cell, DET curves and false
accepts per hour (`subset_metrics`); relative FR at matched FA (`matched_fa`). This module is
their one public face.
"""

from __future__ import annotations

from wakefl.sdk.matched_fa import (
    FaCurve,
    MatchedFaResult,
    clip_fa_curve,
    fr_grid,
    lowest_threshold_within,
    matched_fa_thresholds,
    relative_fr_at_matched_clip_fa,
    relative_fr_at_matched_fa,
)
from wakefl.sdk.matched_fr import (
    RelativeResult,
    baseline_threshold,
    bootstrap_relative_fa_by_subset,
    bootstrap_relative_fa_ci,
    fa_at,
    fr_at,
    matched_threshold,
    percentile_interval,
    relative_fa_fr,
    safe_ratio,
)
from wakefl.sdk.subset_metrics import (
    NO_CELL_NOTE,
    SATURATION_SHARE,
    CellFigures,
    OperatingPoint,
    det_curve,
    fa_per_hour_ceiling,
    false_accepts_per_hour,
    interval_record,
    is_saturated,
    local_relative_report,
    operating_point,
    relative_by_subset,
)

__all__ = [
    "CellFigures",
    "FaCurve",
    "MatchedFaResult",
    "NO_CELL_NOTE",
    "OperatingPoint",
    "RelativeResult",
    "SATURATION_SHARE",
    "baseline_threshold",
    "bootstrap_relative_fa_by_subset",
    "bootstrap_relative_fa_ci",
    "clip_fa_curve",
    "det_curve",
    "fa_at",
    "fa_per_hour_ceiling",
    "false_accepts_per_hour",
    "fr_at",
    "fr_grid",
    "interval_record",
    "is_saturated",
    "local_relative_report",
    "lowest_threshold_within",
    "matched_fa_thresholds",
    "matched_threshold",
    "operating_point",
    "percentile_interval",
    "relative_by_subset",
    "relative_fa_fr",
    "relative_fr_at_matched_clip_fa",
    "relative_fr_at_matched_fa",
    "safe_ratio",
]
