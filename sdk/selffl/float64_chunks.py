"""Float64 sums over float32 model vectors, a chunk at a time.

Self-FL's server sums (Eqn 11's weighted mean, Eqn 14's trace variance, the screening
distance) are taken in float64: a float32 sum over millions of entries loses the small
round-to-round differences they measure. Converting a whole 3M-entry vector first costs a
23 MB allocation with its page faults, about 7 ms per vector on one core; a chunk of 64 Ki
entries stays in cache and the same arithmetic takes about 1.5 ms. The results are the
same float64 operations on the same values, so they are exact to the same rounding as the
whole-vector forms (docs/SCALE.md, "Server CPU per update").
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 1 << 16  # entries per step: 512 KiB of float64, within a core's cache


def _flat(x: Tensor) -> Tensor:
    return x.detach().reshape(-1)


def sq_norm(x: Tensor) -> float:
    """sum_i x_i^2, each term and the sum in float64."""
    a = _flat(x)
    buf = torch.empty(min(CHUNK, a.numel()), dtype=torch.float64)
    total = 0.0
    for start in range(0, a.numel(), CHUNK):
        part = buf[: min(CHUNK, a.numel() - start)]
        part.copy_(a[start : start + CHUNK])
        total += float(torch.dot(part, part))
    return total


def sq_distance(x: Tensor, y: Tensor) -> float:
    """||x - y||^2 with the differences and the sum in float64 (float32 differences of
    entries near 3e38 would overflow)."""
    a, b = _flat(x), _flat(y)
    if a.numel() != b.numel():
        raise ValueError(f"vectors of {a.numel()} and {b.numel()} entries")
    buf = torch.empty(min(CHUNK, a.numel()), dtype=torch.float64)
    total = 0.0
    for start in range(0, a.numel(), CHUNK):
        part = buf[: min(CHUNK, a.numel() - start)]
        part.copy_(a[start : start + CHUNK])
        part.sub_(b[start : start + CHUNK])
        total += float(torch.dot(part, part))
    return total


def add_scaled_(acc: Tensor, x: Tensor, alpha: float = 1.0) -> Tensor:
    """acc += alpha * x in place, acc a flat float64 vector; x of any float dtype is
    widened a chunk at a time. Returns acc."""
    a = _flat(x)
    if acc.dtype != torch.float64 or acc.dim() != 1 or acc.numel() != a.numel():
        raise ValueError(f"acc must be a flat float64 vector of {a.numel()} entries")
    buf = torch.empty(min(CHUNK, a.numel()), dtype=torch.float64)
    for start in range(0, a.numel(), CHUNK):
        part = buf[: min(CHUNK, a.numel() - start)]
        part.copy_(a[start : start + CHUNK])
        acc[start : start + CHUNK].add_(part, alpha=alpha)
    return acc


def widened(x: Tensor) -> Tensor:
    """A new flat float64 copy of x (for the accumulators' first vector)."""
    return add_scaled_(torch.zeros(_flat(x).numel(), dtype=torch.float64), x)


def move_mean_(mean: Tensor, x: Tensor, step: float) -> float:
    """One Welford step in place: with delta = x - mean (float64), mean += step * delta;
    returns ||delta||^2."""
    a = _flat(x)
    if mean.dtype != torch.float64 or mean.dim() != 1 or mean.numel() != a.numel():
        raise ValueError(f"mean must be a flat float64 vector of {a.numel()} entries")
    buf = torch.empty(min(CHUNK, a.numel()), dtype=torch.float64)
    total = 0.0
    for start in range(0, a.numel(), CHUNK):
        part = buf[: min(CHUNK, a.numel() - start)]
        part.copy_(a[start : start + CHUNK])
        part.sub_(mean[start : start + CHUNK])
        total += float(torch.dot(part, part))
        mean[start : start + CHUNK].add_(part, alpha=step)
    return total


def add_difference_(acc: Tensor, x: Tensor, y: Tensor, alpha: float = 1.0) -> float:
    """acc += alpha * (x - y) in place, the differences taken in float64; returns
    ||x - y||^2."""
    a, b = _flat(x), _flat(y)
    if acc.dtype != torch.float64 or acc.dim() != 1 or not acc.numel() == a.numel() == b.numel():
        raise ValueError(f"acc must be a flat float64 vector of {a.numel()} entries, like y")
    buf = torch.empty(min(CHUNK, a.numel()), dtype=torch.float64)
    total = 0.0
    for start in range(0, a.numel(), CHUNK):
        part = buf[: min(CHUNK, a.numel() - start)]
        part.copy_(a[start : start + CHUNK])
        part.sub_(b[start : start + CHUNK])
        total += float(torch.dot(part, part))
        acc[start : start + CHUNK].add_(part, alpha=alpha)
    return total


def add_scaled_norm_(acc: Tensor, x: Tensor, alpha: float = 1.0) -> float:
    """`add_scaled_` that also returns ||x||^2 (float64), from the same widened chunks."""
    a = _flat(x)
    if acc.dtype != torch.float64 or acc.dim() != 1 or acc.numel() != a.numel():
        raise ValueError(f"acc must be a flat float64 vector of {a.numel()} entries")
    buf = torch.empty(min(CHUNK, a.numel()), dtype=torch.float64)
    total = 0.0
    for start in range(0, a.numel(), CHUNK):
        part = buf[: min(CHUNK, a.numel() - start)]
        part.copy_(a[start : start + CHUNK])
        total += float(torch.dot(part, part))
        acc[start : start + CHUNK].add_(part, alpha=alpha)
    return total
