"""Server-side Self-FL aggregation (SELF_FL.md section 4): Eqn 11, smoothing with the
activity rate, and the cluster-level variant (Appendix G.4). Pure functions, O(d) memory
for the streaming forms."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from wakefl.errors import ConfigError
from wakefl.sdk.selffl.rules import (
    check_finite_scalar,
    check_finite_tensor,
    precision,
    trace_variance,
)


def _f64(x: Tensor) -> Tensor:
    # A float32 operand added into a float64 tensor takes torch's slow mixed-dtype path
    # (~25 ms per 3M entries on one core); converting first costs ~1.5 ms in all.
    return x.to(torch.float64)


def aggregate_stream(updates: Iterable[tuple[Tensor, float]], sigma0_sq: float) -> Tensor:
    """Eqn 11 over (params, sigma_m^2) pairs read one at a time:
    theta_hat = sum_m w_m theta_m / sum_m w_m with w_m = 1/(sigma0^2 + sigma_m^2).

    Accumulates in float64 and returns the dtype of the first update.

    Edge cases: no updates -> `ConfigError`; NaN/Inf in any update or uncertainty ->
    `NonFiniteError`; clients with sigma0^2 + sigma_m^2 == 0 have infinite precision: if any
    exist, the result is the plain mean of those clients (the limit of Eqn 11) and the others
    get no weight.
    """
    acc: Tensor | None = None
    acc_inf: Tensor | None = None
    total = 0.0
    n_inf = 0
    dtype = None
    for i, (params, sigma_sq) in enumerate(updates):
        check_finite_tensor(params, f"update {i}")
        flat = params.detach().reshape(-1)
        if dtype is None:
            dtype = flat.dtype
            acc = torch.zeros(flat.numel(), dtype=torch.float64)
        elif flat.numel() != acc.numel():  # type: ignore[union-attr]
            raise ConfigError(f"update {i} has {flat.numel()} entries, expected {acc.numel()}")  # type: ignore[union-attr]
        w = precision(sigma0_sq, sigma_sq)
        if math.isinf(w):
            acc_inf = flat.to(torch.float64).clone() if acc_inf is None else acc_inf.add_(_f64(flat))
            n_inf += 1
        else:
            acc.add_(_f64(flat), alpha=w)  # type: ignore[union-attr]
            total += w
    if acc is None:
        raise ConfigError("cannot aggregate an empty set of updates")
    if n_inf:
        out = acc_inf / n_inf  # type: ignore[operator]
    elif total <= 0.0:
        raise ConfigError("all aggregation weights are zero")
    else:
        out = acc / total
    check_finite_tensor(out, "aggregated parameters")
    return out.to(dtype)


def aggregate(params: Sequence[Tensor] | Tensor, sigma_sq: Sequence[float], sigma0_sq: float) -> Tensor:
    """Eqn 11, batch form: `params` is a sequence of vectors (or a [n, d] tensor) and
    `sigma_sq` their intra-client variances. Same edge cases as `aggregate_stream`."""
    rows = list(params.unbind(0)) if isinstance(params, Tensor) else list(params)
    sig = [float(s) for s in sigma_sq]
    if len(rows) != len(sig):
        raise ConfigError(f"{len(rows)} parameter vectors but {len(sig)} variances")
    return aggregate_stream(zip(rows, sig, strict=True), sigma0_sq)


def smooth(previous: Tensor, aggregated: Tensor, activity_rate: float) -> Tensor:
    """Section 4.1: theta^t = (1 - C) theta^(t-1) + C theta_hat, C in (0, 1]."""
    c = check_finite_scalar(activity_rate, "activity rate")
    if not 0.0 < c <= 1.0:
        raise ConfigError(f"activity rate must be in (0, 1], got {c}")
    check_finite_tensor(previous, "previous global parameters")
    check_finite_tensor(aggregated, "aggregated parameters")
    if previous.shape != aggregated.shape:
        raise ConfigError(f"shape mismatch {tuple(previous.shape)} vs {tuple(aggregated.shape)}")
    return torch.lerp(previous, aggregated.to(previous.dtype), c)


@dataclass(frozen=True)
class Representative:
    """A cluster's latest model and the intra-cluster variance that goes with it."""

    params: Tensor
    sigma_sq: float


def update_representatives(
    representatives: Mapping[str, Representative],
    updates: Iterable[tuple[str, Tensor, float]],
    sigma0_sq: float,
) -> dict[str, Representative]:
    """Cluster-level variant (Appendix G.4), step 1: replace the representative of every
    cluster that has active clients this round.

    A cluster's new representative is Eqn 11 over its active clients (weights
    1/(sigma0^2 + sigma_m^2)); its variance is that of the pooled estimate,
    1 / sum_m (1/sigma_m^2) (0 if any member has sigma_m^2 = 0). Inactive clusters keep
    their representative, so storage grows with the number of clusters, not clients.
    The updates are grouped in one pass holding one accumulator per active cluster.
    """
    sums: dict[str, tuple[Tensor, float, float, Tensor | None, int, torch.dtype]] = {}
    for group, params, sigma_sq in updates:
        check_finite_tensor(params, f"update of cluster '{group}'")
        flat = params.detach().reshape(-1)
        w = precision(sigma0_sq, sigma_sq)
        inv = math.inf if float(sigma_sq) == 0.0 else 1.0 / float(sigma_sq)
        if group not in sums:
            sums[group] = (torch.zeros(flat.numel(), dtype=torch.float64), 0.0, 0.0, None, 0, flat.dtype)
        acc, total, inv_sum, acc_inf, n_inf, dtype = sums[group]
        if math.isinf(w):
            acc_inf = flat.to(torch.float64).clone() if acc_inf is None else acc_inf.add_(_f64(flat))
            n_inf += 1
        else:
            acc.add_(_f64(flat), alpha=w)
            total += w
        sums[group] = (acc, total, inv_sum + inv, acc_inf, n_inf, dtype)
    out = dict(representatives)
    for group, (acc, total, inv_sum, acc_inf, n_inf, dtype) in sums.items():
        mean = acc_inf / n_inf if n_inf else acc / total  # type: ignore[operator]
        check_finite_tensor(mean, f"representative of cluster '{group}'")
        out[group] = Representative(mean.to(dtype), 0.0 if math.isinf(inv_sum) else 1.0 / inv_sum)
    return out


def aggregate_clusters(representatives: Mapping[str, Representative]) -> tuple[Tensor, float]:
    """Cluster-level variant, step 2: the global model is Eqn 11 over all clusters'
    representatives, with the inter-cluster variance (Eqn 14 over the representatives).
    Returns (global params, sigma0^2). No extra smoothing is applied: the stale
    representatives of inactive clusters already carry their past contribution."""
    if not representatives:
        raise ConfigError("no cluster representatives to aggregate")
    reps = [representatives[k] for k in sorted(representatives)]
    sigma0_sq = trace_variance(r.params for r in reps)
    return aggregate_stream(((r.params, r.sigma_sq) for r in reps), sigma0_sq), sigma0_sq
