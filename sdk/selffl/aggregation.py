"""Server-side Self-FL aggregation (docs/SELF_FL.md, "The server's round" and "Cluster-level
aggregation"): Eqn 11, smoothing with the activity rate, and the cluster-level variant
(Appendix G.4). Pure functions, O(d) memory for the streaming forms."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from wakefl.errors import ConfigError
from wakefl.sdk.selffl.checks import require_activity_rate, require_finite
from wakefl.sdk.selffl.float64_chunks import add_scaled_
from wakefl.sdk.selffl.rules import precision, trace_variance

# Adds alpha times one client's vector into a flat float64 accumulator (`add_folded`).
Fold = Callable[[Tensor, float], object]


@dataclass
class PrecisionSum:
    """Running numerator and denominator of Eqn 11, sum_m w_m theta_m / sum_m w_m, over flat
    vectors of `numel` entries, accumulated in float64.

    Clients with infinite precision (sigma0^2 + sigma_m^2 == 0) are summed apart: if any
    exist, the mean is their plain mean (the limit of Eqn 11) and the others get no weight.
    `inverse_variance` sums 1/sigma_m^2, for the variance of the pooled estimate."""

    numel: int
    dtype: torch.dtype  # of the first vector added: the mean comes back in it
    weighted: Tensor = field(init=False)
    weight: float = 0.0
    certain: Tensor | None = None  # sum of the infinite-precision vectors
    certain_count: int = 0
    inverse_variance: float = 0.0

    def __post_init__(self) -> None:
        self.weighted = torch.zeros(self.numel, dtype=torch.float64)

    @classmethod
    def like(cls, flat: Tensor) -> PrecisionSum:
        return cls(numel=flat.numel(), dtype=flat.dtype)

    def add(self, flat: Tensor, sigma_sq: float, sigma0_sq: float, what: str) -> None:
        """Fold in one client's flat parameters with weight 1/(sigma0^2 + sigma_m^2)."""
        if flat.numel() != self.numel:
            raise ConfigError(f"{what} has {flat.numel()} entries, expected {self.numel}")
        self.add_folded(lambda acc, alpha: add_scaled_(acc, flat, alpha), sigma_sq, sigma0_sq)

    def add_folded(self, fold: Fold, sigma_sq: float, sigma0_sq: float) -> None:
        """`add` for a client whose vector is never built whole: `fold(acc, alpha)` adds
        alpha times it into a flat float64 accumulator of `numel` entries (a packed update
        decoded on the fly)."""
        w = precision(sigma0_sq, sigma_sq)
        if math.isinf(w):
            if self.certain is None:
                self.certain = torch.zeros(self.numel, dtype=torch.float64)
            fold(self.certain, 1.0)
            self.certain_count += 1
        else:
            fold(self.weighted, w)
            self.weight += w
        self.inverse_variance += math.inf if float(sigma_sq) == 0.0 else 1.0 / float(sigma_sq)

    def mean(self, what: str) -> Tensor:
        """The weighted mean in the first vector's dtype; `NonFiniteError` if it overflowed."""
        if self.certain is not None:
            out = self.certain / self.certain_count
        elif self.weight <= 0.0:
            raise ConfigError("all aggregation weights are zero")
        else:
            out = self.weighted / self.weight
        require_finite(out, what)
        return out.to(self.dtype)

    def pooled_variance(self) -> float:
        """1 / sum_m 1/sigma_m^2, the variance of the pooled estimate (0 if any is 0)."""
        return 0.0 if math.isinf(self.inverse_variance) else 1.0 / self.inverse_variance


def aggregate_stream(updates: Iterable[tuple[Tensor, float]], sigma0_sq: float) -> Tensor:
    """Eqn 11 over (params, sigma_m^2) pairs read one at a time:
    theta_hat = sum_m w_m theta_m / sum_m w_m with w_m = 1/(sigma0^2 + sigma_m^2).

    Accumulates in float64 and returns the dtype of the first update.

    Edge cases: no updates -> `ConfigError`; NaN/Inf in any update or uncertainty ->
    `NonFiniteError`; clients with sigma0^2 + sigma_m^2 == 0 have infinite precision: if any
    exist, the result is the plain mean of those clients (the limit of Eqn 11) and the others
    get no weight.
    """
    total: PrecisionSum | None = None
    for i, (params, sigma_sq) in enumerate(updates):
        require_finite(params, f"update {i}")
        flat = params.detach().reshape(-1)
        total = PrecisionSum.like(flat) if total is None else total
        total.add(flat, sigma_sq, sigma0_sq, f"update {i}")
    if total is None:
        raise ConfigError("cannot aggregate an empty set of updates")
    return total.mean("aggregated parameters")


def aggregate(
    params: Sequence[Tensor] | Tensor, sigma_sq: Sequence[float], sigma0_sq: float
) -> Tensor:
    """Eqn 11, batch form: `params` is a sequence of vectors (or a [n, d] tensor) and
    `sigma_sq` their intra-client variances. Same edge cases as `aggregate_stream`."""
    rows = list(params.unbind(0)) if isinstance(params, Tensor) else list(params)
    sig = [float(s) for s in sigma_sq]
    if len(rows) != len(sig):
        raise ConfigError(f"{len(rows)} parameter vectors but {len(sig)} variances")
    return aggregate_stream(zip(rows, sig, strict=True), sigma0_sq)


def weight_shares(sigma_sq: Sequence[float], sigma0_sq: float) -> list[float]:
    """Each member's share of Eqn 11's weighted mean, w_m / sum_k w_k (summing to 1), with
    the same infinite-precision limit as `PrecisionSum`: if any member has sigma0^2 +
    sigma_m^2 = 0, those share equally and the others get 0. NaN: `NonFiniteError`."""
    weights = [precision(sigma0_sq, s) for s in sigma_sq]
    if not weights:
        return []
    certain = [math.isinf(w) for w in weights]
    if any(certain):
        n = sum(certain)
        return [1.0 / n if c else 0.0 for c in certain]
    total = math.fsum(weights)
    if total <= 0.0:
        raise ConfigError("all aggregation weights are zero")
    return [w / total for w in weights]


def smooth(previous: Tensor, aggregated: Tensor, activity_rate: float) -> Tensor:
    """Section 4.1: theta^t = (1 - C) theta^(t-1) + C theta_hat, C in (0, 1]."""
    c = require_activity_rate(activity_rate)
    require_finite(previous, "previous global parameters")
    require_finite(aggregated, "aggregated parameters")
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
    sums: dict[str, PrecisionSum] = {}
    for group, params, sigma_sq in updates:
        what = f"update of cluster '{group}'"
        require_finite(params, what)
        flat = params.detach().reshape(-1)
        if group not in sums:
            sums[group] = PrecisionSum.like(flat)
        sums[group].add(flat, sigma_sq, sigma0_sq, what)
    out = dict(representatives)
    for group, total in sums.items():
        mean = total.mean(f"representative of cluster '{group}'")
        out[group] = Representative(mean, total.pooled_variance())
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
