"""Screening of one round's client updates before aggregation: bounds on what a broken or
malicious minority of devices can do to the global model. Pure functions, no I/O.

Precision weighting (Eqn 11, w_m = 1/(sigma0^2 + sigma_m^2)) trusts two things a device
reports: its model theta_m and its intra-client variance sigma_m^2. A device that sends a
huge theta_m, or claims sigma_m^2 = 0 to take almost all the weight, can move the global
model anywhere. The rules below use only the round's own statistics (and, when the round
is too small to have robust ones, the previous round's), so they need no tuning per model:

1. **Variance floor.** sigma_m^2 is raised to `sigma_floor_frac * S`, S = the median of
   the sigma_m^2 reported in the round. With `sigma_floor_frac = 0.1`, no device gets more
   than ~10x the weight of a typical one by claiming a small variance.
2. **Distance bound.** With Delta_m = theta_m - theta_global and R = the median of the
   round's ||Delta_m|| (L2), an update with ||Delta_m|| > `clip_factor * R` is scaled back
   onto that sphere (theta_global + Delta_m * clip_factor * R / ||Delta_m||), and one with
   ||Delta_m|| > `refuse_factor * R` is refused outright (reason given).
3. **Absolute bound.** Independently of R, an update with
   ||Delta_m|| > `abs_factor * max(||theta_global||, 1)` is refused: no real training step
   moves a model by a thousand times its own size. This is what protects a round too small
   for a median and with no earlier reference.

The medians are robust while fewer than half of a round's updates are hostile: R and S
come from the round itself when it has at least `min_reference_updates` (3) updates, so one
hostile update among three or more cannot shift them; a smaller round uses the references
of the last round that had enough (`previous_*`), or, without any, only rule 3.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from wakefl.errors import ConfigError
from wakefl.sdk.selffl.float64_chunks import sq_distance


@dataclass(frozen=True)
class ScreeningRules:
    sigma_floor_frac: float = 0.1
    clip_factor: float = 10.0
    refuse_factor: float = 100.0
    abs_factor: float = 1e3
    min_reference_updates: int = 3

    def __post_init__(self) -> None:
        if not self.sigma_floor_frac >= 0.0:  # NaN too
            raise ConfigError("sigma_floor_frac must be >= 0")
        if not 1.0 <= self.clip_factor <= self.refuse_factor:
            raise ConfigError("need 1 <= clip_factor <= refuse_factor")
        if self.abs_factor <= 0 or self.min_reference_updates < 1:
            raise ConfigError("abs_factor must be > 0 and min_reference_updates >= 1")


@dataclass(frozen=True)
class Verdict:
    """What happens to one update: `action` is "keep", "clip" or "refuse"; `scale`
    multiplies Delta_m (1 for keep); `sigma_sq` is the variance to aggregate with."""

    action: str
    scale: float
    sigma_sq: float
    norm: float
    reason: str = ""


@dataclass(frozen=True)
class Screening:
    verdicts: list[Verdict]
    reference_norm: float | None  # R used this round (None: none available)
    reference_sigma_sq: float | None  # S used this round
    sigma_floor: float
    clip_bound: float  # inf when no R
    refuse_bound: float  # min of the relative and the absolute bound


def delta_norm(params: Tensor, global_params: Tensor) -> float:
    """||theta_m - theta_global||_2 in float64 (float32 would overflow for 3e38 entries)."""
    if params.shape != global_params.shape:
        raise ConfigError(
            f"update of shape {tuple(params.shape)} against a global model of "
            f"shape {tuple(global_params.shape)}"
        )
    # Exact float64 differences a chunk at a time: no float64 copy of either vector.
    return math.sqrt(sq_distance(params, global_params))


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def screen_updates(
    norms: Sequence[float],
    sigmas_sq: Sequence[float],
    global_norm: float,
    rules: ScreeningRules | None = None,
    *,
    previous_norm: float | None = None,
    previous_sigma_sq: float | None = None,
) -> Screening:
    """Verdicts for one round's updates given their distances from the global model
    (`delta_norm`), reported variances and ||theta_global||. See the module docstring."""
    rules = rules or ScreeningRules()
    if len(norms) != len(sigmas_sq):
        raise ConfigError(f"{len(norms)} norms but {len(sigmas_sq)} variances")
    for v in (*norms, *sigmas_sq, global_norm):
        if not math.isfinite(v) or v < 0:
            raise ConfigError(f"screening needs finite non-negative inputs, got {v}")
    enough = len(norms) >= rules.min_reference_updates
    ref_norm = _median(norms) if enough else previous_norm
    ref_sigma = (
        _median(sigmas_sq)
        if enough
        else (
            previous_sigma_sq
            if previous_sigma_sq is not None
            else (_median(sigmas_sq) if sigmas_sq else None)
        )
    )
    floor = rules.sigma_floor_frac * ref_sigma if ref_sigma is not None else 0.0
    abs_bound = rules.abs_factor * max(global_norm, 1.0)
    if ref_norm is not None and ref_norm > 0:
        clip_bound = rules.clip_factor * ref_norm
        refuse_bound = min(rules.refuse_factor * ref_norm, abs_bound)
    else:
        # R = 0 (every update equals the global model) or no reference: only rule 3.
        clip_bound, refuse_bound = math.inf, abs_bound
    verdicts = [
        _verdict(n, max(s, floor), clip_bound, refuse_bound, abs_bound, ref_norm, rules)
        for n, s in zip(norms, sigmas_sq, strict=True)
    ]
    return Screening(verdicts, ref_norm, ref_sigma, floor, clip_bound, refuse_bound)


def _verdict(
    n: float,
    sigma: float,
    clip_bound: float,
    refuse_bound: float,
    abs_bound: float,
    ref_norm: float | None,
    rules: ScreeningRules,
) -> Verdict:
    """Refuse an update farther than `refuse_bound` from the global model, clip one
    farther than `clip_bound`, keep the others; `sigma` is its floored variance."""
    if n > refuse_bound:
        why = (
            "absolute bound"
            if refuse_bound == abs_bound
            else f"{rules.refuse_factor:g}x the round's median distance {ref_norm:.4g}"
        )
        return Verdict(
            "refuse",
            0.0,
            sigma,
            n,
            f"distance {n:.4g} from the global model exceeds {refuse_bound:.4g} ({why})",
        )
    if n > clip_bound:
        return Verdict(
            "clip", clip_bound / n, sigma, n, f"distance {n:.4g} clipped to {clip_bound:.4g}"
        )
    return Verdict("keep", 1.0, sigma, n)


def apply_scale(params: Tensor, global_params: Tensor, scale: float) -> Tensor:
    """theta_global + scale * (theta_m - theta_global), computed in float64 (the difference
    of two float32 vectors near 3e38 overflows in float32), returned in params' dtype."""
    if scale == 1.0:
        return params
    g = global_params.double()
    return (g + (params.double() - g) * scale).to(params.dtype)
