"""Self-FL's client-side rules as small pure functions (docs/SELF_FL.md, "The client's
round" and "The server's round").

Each edge case the paper leaves open is decided here and stated in the docstring:
no variance yet, a client so certain that Eqn 16's logarithm is undefined, no other
client known, and non-finite numbers (always refused with `NonFiniteError`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch import Tensor

from wakefl.errors import ConfigError, NonFiniteError
from wakefl.sdk.selffl.checks import HyperparameterError, require_finite, require_finite_scalar
from wakefl.sdk.selffl.running_variance import RunningVariance


def precision(sigma0_sq: float, sigma_sq: float) -> float:
    """w = 1 / (sigma_0^2 + sigma_k^2); +inf when both are 0 (a perfectly certain client)."""
    total = require_finite_scalar(sigma0_sq, "sigma0^2") + require_finite_scalar(sigma_sq, "sigma_m^2")
    if total < 0.0:
        raise HyperparameterError(f"variances must be >= 0, got sigma0^2 + sigma_m^2 = {total}")
    return math.inf if total == 0.0 else 1.0 / total


def trace_variance(vectors: Iterable[Tensor]) -> float:
    """Trace (population) variance of a set of vectors in one streaming pass (Eqn 14).

    Holds one running mean, never the whole set. An empty set or a single vector gives 0.0.
    NaN/Inf in any vector raises `NonFiniteError`.
    """
    rv = RunningVariance()
    for v in vectors:
        rv.update(v)
    return rv.value


def initial_point(
    global_params: Tensor,
    personal_params: Tensor,
    sigma_m_sq: float,
    others_precision: float,
    *,
    sigma0_sq: float,
) -> Tensor:
    """Eqn 10: theta_init = theta - (w_m / S_-m) * (theta_m - theta), w_m = 1/(sigma0^2 + sigma_m^2).

    When `global_params` is the precision-weighted mean of all clients' models (including
    `personal_params` with weight w_m), this is the precision-weighted mean of the others.

    Edge cases:
    * `others_precision` == 0 (no other client known): no prior from others, the client
      starts from the global model (returns a copy of `global_params`).
    * `others_precision` == +inf (another client with zero total variance): the others'
      mean is exactly the global model -> copy of `global_params`.
    * w_m == +inf (sigma0^2 = sigma_m^2 = 0) with finite S_-m: the global model is then
      this client's own, the others' mean cannot be recovered from it -> copy of
      `global_params`.
    * NaN/Inf in the tensors or NaN in the scalars: `NonFiniteError`.
    """
    require_finite(global_params, "global parameters")
    require_finite(personal_params, "personal parameters")
    if global_params.shape != personal_params.shape:
        raise ConfigError(
            f"global and personal parameters differ in shape: {tuple(global_params.shape)} "
            f"vs {tuple(personal_params.shape)}"
        )
    s_others = require_finite_scalar(others_precision, "S_-m", allow_inf=True)
    if s_others < 0.0:
        raise HyperparameterError(f"S_-m must be >= 0, got {s_others}")
    if s_others == 0.0 or math.isinf(s_others):
        return global_params.clone()
    w_m = precision(sigma0_sq, sigma_m_sq)
    if math.isinf(w_m):
        return global_params.clone()
    out = global_params - (w_m / s_others) * (personal_params - global_params)
    require_finite(out, "initial point")
    return out


def local_steps(
    lr: float,
    batch_size: int,
    sigma_m_sq: float | None,
    others_precision: float,
    l_max: int,
    warmup_steps: int,
) -> int:
    """Eqn 16 (batch form): solve (1 - eta/(B sigma_m^2))^l = S_-m / (1/sigma_m^2 + S_-m).

    l = ln(S_-m / (1/sigma_m^2 + S_-m)) / ln(1 - eta/(B sigma_m^2)), rounded to the nearest
    integer and clipped to [1, l_max].

    Edge cases:
    * `sigma_m_sq` is None (t_m < 2: no variance yet): warm-up, returns
      min(warmup_steps, l_max) (at least 1).
    * eta/(B sigma_m^2) >= 1, including sigma_m^2 == 0: the client is very certain (and the
      logarithm is undefined) -> l_max.
    * S_-m == 0 (no other client known): no prior from others -> l_max.
    * S_-m == +inf: the others pin the model completely -> 1 (the minimum).
    * NaN in any input or Inf in sigma_m^2: `NonFiniteError`; negative values, lr <= 0,
      batch_size < 1 or l_max < 1: `HyperparameterError` (a `ConfigError`).
    * eta/(B sigma_m^2) so small (below ~1e-308) that the quotient of the two logarithms
      overflows: the step count is not a finite number -> `NonFiniteError`, like every
      other non-finite result.
    """
    lr = require_finite_scalar(lr, "learning rate")
    if lr <= 0.0 or batch_size < 1 or l_max < 1 or warmup_steps < 0:
        raise HyperparameterError(
            f"need lr > 0, batch_size >= 1, l_max >= 1, warmup_steps >= 0; got lr={lr}, "
            f"batch_size={batch_size}, l_max={l_max}, warmup_steps={warmup_steps}"
        )
    if sigma_m_sq is None:
        return max(1, min(int(warmup_steps), int(l_max)))
    sigma_m_sq = require_finite_scalar(sigma_m_sq, "sigma_m^2")
    s_others = require_finite_scalar(others_precision, "S_-m", allow_inf=True)
    if sigma_m_sq < 0.0 or s_others < 0.0:
        raise HyperparameterError(f"need sigma_m^2 >= 0 and S_-m >= 0, got {sigma_m_sq}, {s_others}")
    if math.isinf(s_others):
        return 1
    if s_others == 0.0:
        return int(l_max)
    rate = lr / (batch_size * sigma_m_sq) if sigma_m_sq > 0.0 else math.inf
    if rate >= 1.0:
        return int(l_max)
    ratio = s_others / (1.0 / sigma_m_sq + s_others)
    if ratio <= 0.0:  # 1/sigma_m^2 overflowed relative to S_-m: as certain as it gets
        return int(l_max)
    steps = math.log(ratio) / math.log1p(-rate)
    if not math.isfinite(steps):  # round(inf) would raise a bare OverflowError
        raise NonFiniteError(
            f"Eqn 16's step count overflows: eta/(B sigma_m^2) = {rate} is too small "
            f"(lr={lr}, batch_size={batch_size}, sigma_m^2={sigma_m_sq})"
        )
    return int(min(max(round(steps), 1), l_max))
