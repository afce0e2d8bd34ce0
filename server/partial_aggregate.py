"""Self-FL's round aggregation split into partial sums over shards of the round's updates,
and their exact merge. Pure functions on tensors, no I/O (docs/SCALE.md, "Sharded
aggregation").

A round's aggregation (server/aggregation_server.py with sdk/selffl/selffl_strategy.py)
reads three things from the updates, each a sum over clients:

1. the distance ||theta_m - theta_global|| of each update, for screening (one number per
   update; the medians of screening need them all, so they are gathered, not summed);
2. Eqn 14's sigma0^2, the trace variance of the screened models: per shard a count, a mean
   and the sum of squared deviations (Welford), merged exactly with Chan's formula;
3. Eqn 11's precision-weighted mean, given sigma0^2: per shard the weighted sum and the sum
   of weights (`PrecisionSum`), merged by adding them.

Phase 3 needs the merged phase 2, and phase 2 needs the screening verdicts of phase 1, so a
sharded round takes three passes over its shards, as one process takes three reads of each
update. Every partial is O(d) whatever the number of updates; merging them gives the same
state as one process up to float64 summation order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from wakefl.errors import ConfigError
from wakefl.sdk.selffl.aggregation import PrecisionSum
from wakefl.sdk.selffl.checks import require_finite
from wakefl.sdk.selffl.float64_chunks import move_mean_, widened
from wakefl.sdk.selffl.selffl_strategy import ReportedUncertainty, SelfFL
from wakefl.sdk.selffl.strategy import Strategy
from wakefl.sdk.selffl.update_screening import Verdict, apply_scale, delta_norm


@dataclass
class Spread:
    """Count, float64 mean and sum of squared deviations (trace) of a shard's vectors."""

    count: int = 0
    mean: Tensor | None = None
    m2: float = 0.0

    def add(self, x: Tensor) -> None:
        """Welford's update with one vector."""
        if self.mean is None:
            self.count, self.mean, self.m2 = 1, widened(x), 0.0
            return
        self.count += 1
        delta_sq = move_mean_(self.mean, x, 1.0 / self.count)
        # x - new mean = delta (n-1)/n: one dot product instead of a second difference
        self.m2 += delta_sq * (self.count - 1) / self.count

    @property
    def value(self) -> float:
        """The population trace variance (Eqn 14; 0 for fewer than two vectors)."""
        return self.m2 / self.count if self.count >= 2 else 0.0


def merge_spreads(parts: Iterable[Spread]) -> Spread:
    """Chan et al.'s pairwise merge: m2 = m2_a + m2_b + ||mean_b - mean_a||^2 n_a n_b / n."""
    out = Spread()
    for p in parts:
        if p.mean is None or p.count == 0:
            continue
        if out.mean is None:
            out = Spread(p.count, p.mean.clone(), p.m2)
            continue
        n = out.count + p.count
        delta = p.mean - out.mean
        shift = float(torch.dot(delta, delta)) * out.count * p.count / n
        out.mean.add_(delta, alpha=p.count / n)
        out.m2 += p.m2 + shift
        out.count = n
    return out


def merge_sums(parts: Iterable[PrecisionSum]) -> PrecisionSum:
    """Eqn 11's partial numerators and denominators added up."""
    out: PrecisionSum | None = None
    for p in parts:
        if out is None:
            out = PrecisionSum(p.numel, p.dtype)
        if p.numel != out.numel:
            raise ConfigError(f"partial sums of {p.numel} and {out.numel} entries")
        out.weighted.add_(p.weighted)
        out.weight += p.weight
        if p.certain is not None:
            out.certain = p.certain.clone() if out.certain is None else out.certain.add_(p.certain)
        out.certain_count += p.certain_count
        out.inverse_variance += p.inverse_variance
    if out is None:
        raise ConfigError("cannot aggregate an empty set of updates")
    return out


# ---- one shard's passes (what an aggregation worker computes) --------------------------
def shard_norms(updates: Iterable[Tensor], global_params: Tensor) -> list[float]:
    """Phase 1: each update's distance from the global model, in order."""
    return [delta_norm(x, global_params) for x in updates]


def shard_spread(
    updates: Iterable[Tensor], scales: Sequence[float], global_params: Tensor
) -> Spread:
    """Phase 2: the spread of the shard's screened (clipped) models."""
    out = Spread()
    for x, scale in zip(updates, scales, strict=True):
        out.add(apply_scale(x, global_params, scale))
    return out


def shard_sum(
    updates: Iterable[Tensor],
    scales: Sequence[float],
    sigmas: Sequence[float],
    sigma0_sq: float,
    global_params: Tensor,
) -> PrecisionSum:
    """Phase 3: Eqn 11's partial sums over the shard's screened models."""
    out = PrecisionSum(global_params.numel(), torch.float32)
    for i, (x, scale, sig) in enumerate(zip(updates, scales, sigmas, strict=True)):
        flat = apply_scale(x, global_params, scale).detach().reshape(-1)
        require_finite(flat, f"update {i}")
        out.add(flat, sig, sigma0_sq, f"update {i}")
    return out


# ---- the coordinator's side --------------------------------------------------------------
def require_shardable(strategy: Strategy) -> SelfFL:
    """Sharded aggregation merges Self-FL's sums; other strategies and cluster mode are
    refused (docs/SCALE.md says why)."""
    if not isinstance(strategy, SelfFL):
        raise ConfigError(
            f"sharded aggregation supports the Self-FL strategies only, not {strategy.name!r}; "
            "run one server process (--role single)"
        )
    if strategy.cluster_by_group:
        raise ConfigError(
            "sharded aggregation does not support cluster mode (--group-by device_type); "
            "run one server process (--role single)"
        )
    return strategy


def reported_uncertainties(
    rows: Sequence[dict[str, Any]], verdicts: Sequence[Verdict], variance_key: str | None
) -> list[ReportedUncertainty]:
    """What Self-FL's first pass reads from each kept update, taken from the recorded
    rows: the variance as screening floored it, whether the client has one, its group."""
    out = []
    for row, v in zip(rows, verdicts, strict=True):
        record = json.loads(row["record"])
        sig = v.sigma_sq if variance_key is not None else float(record.get("sigma_sq", 0.0))
        out.append(
            ReportedUncertainty(
                row["device_id"],
                float(sig),
                float(record.get("has_variance", 1.0)) > 0,
                row["device_type"],
            )
        )
    return out
