"""Streaming weighted averages over client results: O(d) memory, one pass.

`results` on the server may be a lazy, disk-backed view, so a strategy folds one update at
a time into an accumulator instead of collecting them."""

from __future__ import annotations

import torch
from torch import Tensor

from wakefl.errors import ProtocolError

from ..checks import require_choice, require_finite, require_finite_scalar, require_like
from ..strategy import ClientResult

WEIGHTINGS = ("samples", "equal")


class WeightedMean:
    """Running sum_k a_k x_k / sum_k a_k, accumulated in float64 for accuracy."""

    def __init__(self, like: Tensor) -> None:
        self._like = like
        self._acc = torch.zeros(like.shape, dtype=torch.float64, device=like.device)
        self._total = 0.0
        self.count = 0

    def add(self, vec: Tensor, weight: float, what: str = "client update") -> None:
        weight = require_finite_scalar(weight, f"{what}: aggregation weight")
        if weight <= 0:
            raise ProtocolError(f"{what}: aggregation weight must be > 0, got {weight}")
        require_like(vec, self._like, what)
        require_finite(vec, what)
        self._acc.add_(vec.detach().to(self._acc.device, self._acc.dtype), alpha=weight)
        self._total += weight
        self.count += 1

    @property
    def total_weight(self) -> float:
        return self._total

    def value(self) -> Tensor:
        """The weighted mean, in the dtype and device of the reference vector."""
        if self.count == 0:
            raise ValueError("no vectors were added")
        out = (self._acc / self._total).to(self._like.device, self._like.dtype)
        # Huge finite inputs can still overflow the float32 result.
        return require_finite(out, "aggregated parameters")


def fedavg_weight(result: ClientResult, weighting: str) -> float:
    """FedAvg's weight of one client: its sample count n_k (-w) or 1 (-e)."""
    if weighting == "equal":
        return 1.0
    n = result.num_samples
    if isinstance(n, bool) or int(n) != n or n <= 0:
        raise ProtocolError(
            f"client {result.client_id!r}: num_samples must be a positive integer, got {n!r}"
        )
    return float(n)


def check_weighting(weighting: str) -> str:
    return require_choice(weighting, WEIGHTINGS, "weighting")
