"""Memory-bounded trace variance of a sequence of parameter vectors (Appendix E, Eqn 18-19).

The variance of vectors x_1..x_t is the trace (1/t) sum_i ||x_i - mean_t||^2, i.e. the sum of
the entry-wise population variances. Only the running mean (d numbers) and two scalars are
kept, so a device can track its intra-client uncertainty sigma_m^2 over any number of
rounds in O(d) memory.
"""

from __future__ import annotations

import math

from torch import Tensor

from wakefl.errors import ConfigError, NonFiniteError
from wakefl.finite import all_finite
from wakefl.sdk.selffl.checks import require_finite
from wakefl.sdk.selffl.float64_chunks import sq_norm


def _check_vector(x: Tensor, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ConfigError(f"{what} must be a floating-point tensor, got {x.dtype}")
    return require_finite(x.detach().reshape(-1), what)


class RunningVariance:
    """Trace variance of the vectors seen so far, updated one vector at a time.

    Recursion (docs/SELF_FL.md, "Memory-bounded recursive variance": the corrected
    Eqn 19, equal to Welford's update):
        mean_t = mean_{t-1} + (x_t - mean_{t-1}) / t
        var_t  = (t-1)/t * var_{t-1} + (t-1)/t * ||mean_t - mean_{t-1}||^2 + ||x_t - mean_t||^2 / t

    `value` is 0.0 after a single update (a population variance); callers that need "no
    variance yet" test `count < 2`. A non-finite input raises `NonFiniteError` and leaves the
    state unchanged. The mean keeps the dtype of the first vector; the scalars are float64.
    """

    def __init__(self) -> None:
        self._mean: Tensor | None = None
        self._count = 0
        self._value = 0.0

    @property
    def count(self) -> int:
        """Number of vectors folded in (the client's participation counter t_m)."""
        return self._count

    @property
    def value(self) -> float:
        """Current trace variance (0.0 before two updates)."""
        return self._value

    @property
    def mean(self) -> Tensor | None:
        """Running mean of the vectors (None before the first update)."""
        return self._mean

    def update(self, x: Tensor) -> float:
        """Fold in one vector; returns the new variance."""
        flat = _check_vector(x, "RunningVariance.update input")
        if self._mean is None:
            self._mean = flat.clone()
            self._count = 1
            self._value = 0.0
            return self._value
        if flat.numel() != self._mean.numel():
            raise ConfigError(
                f"RunningVariance expects vectors of {self._mean.numel()} entries, got {flat.numel()}"
            )
        t = self._count + 1
        delta = flat.to(self._mean.dtype) - self._mean  # x_t - mean_{t-1}
        # Both norms of the recursion follow from ||delta||^2, so one pass over d entries
        # suffices: mean_t - mean_{t-1} = delta / t and x_t - mean_t = delta (t-1) / t.
        delta_sq = sq_norm(delta)  # float64, whatever the dtype
        shift_sq = delta_sq / (t * t)  # ||mean_t - mean_{t-1}||^2
        resid_sq = delta_sq * ((t - 1) / t) ** 2  # ||x_t - mean_t||^2
        new_mean = self._mean.add(delta, alpha=1.0 / t)
        value = (t - 1) / t * self._value + (t - 1) / t * shift_sq + resid_sq / t
        if not math.isfinite(value) or not all_finite(new_mean):
            raise NonFiniteError("RunningVariance update overflowed (non-finite variance)")
        self._mean, self._count, self._value = new_mean, t, value
        return value

    def state_dict(self) -> dict[str, object]:
        """Persistable state: {'count': int, 'value': float, 'mean': Tensor | None}."""
        mean = None if self._mean is None else self._mean.clone()
        return {"count": self._count, "value": self._value, "mean": mean}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore from `state_dict()` output; refuses inconsistent or non-finite state."""
        count = int(state.get("count", 0))  # type: ignore[call-overload]
        value = float(state.get("value", 0.0))  # type: ignore[arg-type]
        mean = state.get("mean")
        if count < 0 or value < 0.0:
            raise ConfigError(f"RunningVariance state has count={count}, value={value}")
        if not math.isfinite(value):
            raise NonFiniteError("RunningVariance state has a non-finite variance")
        if count == 0:
            if mean is not None:
                raise ConfigError("RunningVariance state has a mean but count 0")
            self._mean, self._count, self._value = None, 0, 0.0
            return
        if not isinstance(mean, Tensor):
            raise ConfigError("RunningVariance state with count > 0 needs a mean tensor")
        self._mean = _check_vector(mean, "RunningVariance state mean").clone()
        self._count, self._value = count, value
