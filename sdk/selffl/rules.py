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
from wakefl.sdk.selffl.checks import (
    HyperparameterError,
    require_activity_rate,
    require_finite,
    require_finite_scalar,
)
from wakefl.sdk.selffl.running_variance import RunningVariance


def precision(sigma0_sq: float, sigma_sq: float) -> float:
    """w = 1 / (sigma_0^2 + sigma_k^2); +inf when both are 0 (a perfectly certain client)."""
    total = require_finite_scalar(sigma0_sq, "sigma0^2") + require_finite_scalar(
        sigma_sq, "sigma_m^2"
    )
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


def eqn10_factor(
    sigma_m_sq: float,
    others_precision: float,
    *,
    sigma0_sq: float,
    share: float | None = None,
    max_factor: float | None = None,
) -> float:
    """The factor f of Eqn 10, theta_init = theta - f (theta_m - theta), bounded to
    [0, max_factor] (docs/SELF_FL.md, "Initial point").

    * `share` None (the paper's form): f = w_m / S_-m with w_m = 1/(sigma0^2 + sigma_m^2).
      It removes the client's own share exactly when the global model is the
      precision-weighted mean of every client, m included.
    * `share` = a in [0, 1], the weight the server actually gave the client's last upload in
      the current global model (Eqn 11's weight times the smoothing factors of the rounds
      since, or the representative's weight in cluster mode): f = a / (1 - a), which removes
      exactly that share, whatever the aggregation was (sampling, smoothing, clusters). With
      full participation and unchanged variances it equals w_m / S_-m.
    * `max_factor` (None: unbounded, the paper): f is clipped to it. With 1, the initial point
      is never further from the global model than the client's own model is, so an error
      in the global model or in the anchor is never amplified.

    Edge cases (f = 0, start from the global model): S_-m = 0 (no other client known) or
    +inf (the others' mean is the global model), w_m = +inf with finite S_-m (the global
    model is the client's own). A share of 1 (the global model is the client's own upload)
    gives f = +inf: max_factor if set, else 0. NaN: `NonFiniteError`; a negative S_-m or
    max_factor, or a share outside [0, 1]: `HyperparameterError`.
    """
    if max_factor is not None:
        max_factor = require_finite_scalar(max_factor, "Eqn 10 factor bound")
        if max_factor < 0.0:
            raise HyperparameterError(f"the Eqn 10 factor bound must be >= 0, got {max_factor}")
    if share is not None:
        a = require_finite_scalar(share, "share of the global model")
        if not 0.0 <= a <= 1.0:
            raise HyperparameterError(f"a share of the global model must be in [0, 1], got {a}")
        factor = math.inf if a >= 1.0 else a / (1.0 - a)
    else:
        s_others = require_finite_scalar(others_precision, "S_-m", allow_inf=True)
        if s_others < 0.0:
            raise HyperparameterError(f"S_-m must be >= 0, got {s_others}")
        if s_others == 0.0 or math.isinf(s_others):
            return 0.0
        w_m = precision(sigma0_sq, sigma_m_sq)
        if math.isinf(w_m):
            return 0.0
        factor = w_m / s_others
    if max_factor is not None:
        return min(factor, max_factor)
    return 0.0 if math.isinf(factor) else factor


def initial_point(
    global_params: Tensor,
    personal_params: Tensor,
    sigma_m_sq: float,
    others_precision: float,
    *,
    sigma0_sq: float,
    share: float | None = None,
    max_factor: float | None = None,
) -> Tensor:
    """Eqn 10: theta_init = theta - f * (theta_m - theta), f from `eqn10_factor`
    (the paper: f = w_m / S_-m, w_m = 1/(sigma0^2 + sigma_m^2); `share` and `max_factor` as
    there).

    When `global_params` is the precision-weighted mean of all clients' models (including
    `personal_params` with weight w_m), the paper's f gives the precision-weighted mean of
    the others.

    Edge cases (a copy of `global_params`): `others_precision` == 0 (no other client known)
    or +inf (another client with zero total variance: the others' mean is the global model);
    w_m == +inf (sigma0^2 = sigma_m^2 = 0) with finite S_-m (the global model is this
    client's own, the others' mean cannot be recovered from it). NaN/Inf in the tensors or
    NaN in the scalars: `NonFiniteError`.
    """
    require_finite(global_params, "global parameters")
    require_finite(personal_params, "personal parameters")
    if global_params.shape != personal_params.shape:
        raise ConfigError(
            f"global and personal parameters differ in shape: {tuple(global_params.shape)} "
            f"vs {tuple(personal_params.shape)}"
        )
    factor = eqn10_factor(
        sigma_m_sq, others_precision, sigma0_sq=sigma0_sq, share=share, max_factor=max_factor
    )
    if factor == 0.0:
        return global_params.clone()
    out = global_params - factor * (personal_params - global_params)
    require_finite(out, "initial point")
    return out


LOSS_SCALINGS = ("mean", "sum")


def step_rate(lr: float, batch_size: int, sigma_m_sq: float, loss: str = "mean") -> float:
    """The contraction rate r of one local step in Eqn 16, (1 - r)^l = S_-m / (1/sigma_m^2 + S_-m).

    On the quadratic model whose full local loss has curvature 1/sigma_m^2, a step
    theta <- theta - eta g contracts the distance to the local optimum by 1 - eta kappa,
    where kappa is the curvature of the loss the minibatch gradient g differentiates:
    * loss="mean" (wakefl's oracles: the Gaussian problem's minibatch gradient
      (theta - batch mean) / sigma_m^2 and the CNN's mean cross-entropy over the
      minibatch): the gradient's scale does not grow with B, kappa = 1/sigma_m^2 and
      r = eta / sigma_m^2, whatever B is;
    * loss="sum" (Algorithm 2's printed rate): r = eta / (B sigma_m^2). It equals the
      mean form at B = 1 only.
    sigma_m^2 = 0 gives +inf (as certain as it gets).
    """
    if loss not in LOSS_SCALINGS:
        raise HyperparameterError(f"loss scaling must be one of {LOSS_SCALINGS}, got {loss!r}")
    if sigma_m_sq <= 0.0:
        return math.inf
    scale = batch_size if loss == "sum" else 1
    return lr / (scale * sigma_m_sq)


def data_step_cap(num_samples: int, batch_size: int, max_epochs: float | None) -> int | None:
    """The most local steps a client's data supports: `max_epochs` passes over its
    n_m samples in minibatches of B, i.e. ceil(max_epochs * ceil(n_m / B)), at least 1. A client with 40 clips and B = 32 gets 4 steps at 2 epochs, not 20
    full-batch steps on the same clips. None (no cap) when `max_epochs` is None."""
    if max_epochs is None:
        return None
    epochs = require_finite_scalar(max_epochs, "max_local_epochs")
    if epochs <= 0.0 or num_samples < 1 or batch_size < 1:
        raise HyperparameterError(
            f"need max_local_epochs > 0, num_samples >= 1 and batch_size >= 1; got {epochs}, "
            f"{num_samples}, {batch_size}"
        )
    per_epoch = math.ceil(num_samples / batch_size)
    return max(1, math.ceil(epochs * per_epoch - 1e-9))


def step_count_words(
    steps: int,
    sigma_m_sq: float | None,
    others_precision: float,
    l_max: int,
    data_cap: int | None,
    warmup_steps: int,
) -> str:
    """Why `local_steps` gave `steps`, for the device's progress line: the rule that set it,
    its inputs and the cap, e.g. "Eqn 16 from sigma_m^2=0.0123 and S_-m=45.6, cap
    l_max=20". A count that falls from 20 to 3 is the warm-up ending, not a fault.
    `data_cap` is `data_step_cap`'s (None: no cap by the data)."""
    cap = f"cap l_max={l_max}"
    if data_cap is not None and data_cap < l_max:
        cap = f"cap {data_cap} by its data's epochs, l_max={l_max}"
    if sigma_m_sq is None:
        return f"warm-up until it has a variance of its own (warmup_steps={warmup_steps}, {cap})"
    if others_precision == 0.0:
        return f"the {cap}: no precision S_-m of other devices yet for Eqn 16"
    if math.isinf(others_precision):
        return f"Eqn 16's minimum: S_-m is infinite (the others pin the model), {cap}"
    at_cap = steps >= min(l_max, data_cap or l_max)
    return (
        f"Eqn 16 from sigma_m^2={sigma_m_sq:.4g} and S_-m={others_precision:.4g}, "
        + ("held at the " if at_cap else "")
        + cap
    )


# floor(C M) compared on a slack: 0.29 * 100 is 28.999999999999996 in floating point.
_SAMPLING_SLACK = 1e-9


def sampled_count(activity_rate: float, n_clients: int) -> int:
    """Clients sampled per round (Section 4.1): floor(C * M), at least 1 and at most M.

    The one rule of the simulation, the studies and the MQTT server (which samples among
    the devices online and may raise the count to its quorum)."""
    rate = require_activity_rate(activity_rate)
    if isinstance(n_clients, bool) or int(n_clients) != n_clients or n_clients < 1:
        raise HyperparameterError(
            f"the number of clients must be an integer >= 1, got {n_clients!r}"
        )
    n = int(n_clients)
    return max(1, min(n, math.floor(rate * n + _SAMPLING_SLACK)))


def _require_step_settings(lr: float, batch_size: int, l_max: int, warmup_steps: int) -> float:
    """The learning rate as a finite float; HyperparameterError for lr <= 0, batch_size < 1,
    l_max < 1 or warmup_steps < 0."""
    lr = require_finite_scalar(lr, "learning rate")
    if lr <= 0.0 or batch_size < 1 or l_max < 1 or warmup_steps < 0:
        raise HyperparameterError(
            f"need lr > 0, batch_size >= 1, l_max >= 1, warmup_steps >= 0; got lr={lr}, "
            f"batch_size={batch_size}, l_max={l_max}, warmup_steps={warmup_steps}"
        )
    return lr


def _require_variances(sigma_m_sq: float, others_precision: float) -> tuple[float, float]:
    """(sigma_m^2, S_-m) as floats: sigma_m^2 finite, S_-m possibly +inf, both >= 0."""
    sigma_m_sq = require_finite_scalar(sigma_m_sq, "sigma_m^2")
    s_others = require_finite_scalar(others_precision, "S_-m", allow_inf=True)
    if sigma_m_sq < 0.0 or s_others < 0.0:
        raise HyperparameterError(
            f"need sigma_m^2 >= 0 and S_-m >= 0, got {sigma_m_sq}, {s_others}"
        )
    return sigma_m_sq, s_others


def local_steps(
    lr: float,
    batch_size: int,
    sigma_m_sq: float | None,
    others_precision: float,
    l_max: int,
    warmup_steps: int,
    *,
    loss: str = "mean",
) -> int:
    """Eqn 16: solve (1 - r)^l = S_-m / (1/sigma_m^2 + S_-m) with r = `step_rate`
    (eta / sigma_m^2 for the mean minibatch loss wakefl's oracles differentiate; the
    paper's eta/(B sigma_m^2) with loss="sum").

    l = ln(S_-m / (1/sigma_m^2 + S_-m)) / ln(1 - r), rounded to the nearest integer and
    clipped to [1, l_max].

    Edge cases:
    * `sigma_m_sq` is None (no variance yet): warm-up, returns min(warmup_steps, l_max)
      (at least 1).
    * r >= 1, including sigma_m^2 == 0: the client is very certain (and the logarithm is
      undefined) -> l_max.
    * S_-m == 0 (no other client known): no prior from others -> l_max.
    * S_-m == +inf: the others pin the model completely -> 1 (the minimum).
    * NaN in any input or Inf in sigma_m^2: `NonFiniteError`; negative values, lr <= 0,
      batch_size < 1 or l_max < 1: `HyperparameterError` (a `ConfigError`).
    * r so small (below ~1e-308) that the quotient of the two logarithms overflows: the
      step count is not a finite number -> `NonFiniteError`, like every other non-finite
      result.
    """
    lr = _require_step_settings(lr, batch_size, l_max, warmup_steps)
    if sigma_m_sq is None:
        return max(1, min(int(warmup_steps), int(l_max)))
    sigma_m_sq, s_others = _require_variances(sigma_m_sq, others_precision)
    if math.isinf(s_others):
        return 1
    if s_others == 0.0:
        return int(l_max)
    rate = step_rate(lr, batch_size, sigma_m_sq, loss)
    if rate >= 1.0:
        return int(l_max)
    ratio = s_others / (1.0 / sigma_m_sq + s_others)
    if ratio <= 0.0:  # 1/sigma_m^2 overflowed relative to S_-m: as certain as it gets
        return int(l_max)
    steps = math.log(ratio) / math.log1p(-rate)
    if not math.isfinite(steps):  # round(inf) would raise a bare OverflowError
        raise NonFiniteError(
            f"Eqn 16's step count overflows: the step rate {rate} is too small "
            f"(lr={lr}, batch_size={batch_size}, sigma_m^2={sigma_m_sq}, loss={loss})"
        )
    return int(min(max(round(steps), 1), l_max))
