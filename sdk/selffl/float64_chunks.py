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

from collections.abc import Iterator

import torch
from torch import Tensor

CHUNK = 1 << 16  # entries per step: 512 KiB of float64, within a core's cache


def _flat(x: Tensor) -> Tensor:
    return x.detach().reshape(-1)


def _chunks(x: Tensor, minus: Tensor | None = None) -> Iterator[tuple[slice, Tensor]]:
    """(where, x[where] - minus[where]) in float64, a chunk at a time through one buffer
    (minus 0 when None); each chunk is valid until the next is drawn."""
    a = _flat(x)
    b = None if minus is None else _flat(minus)
    if b is not None and b.numel() != a.numel():
        raise ValueError(f"vectors of {a.numel()} and {b.numel()} entries")
    buf = torch.empty(min(CHUNK, a.numel()), dtype=torch.float64)
    for start in range(0, a.numel(), CHUNK):
        part = buf[: min(CHUNK, a.numel() - start)]
        where = slice(start, start + part.numel())
        part.copy_(a[where])
        if b is not None:
            part.sub_(b[where])
        yield where, part


def _check_acc(acc: Tensor, x: Tensor) -> None:
    n = _flat(x).numel()
    if acc.dtype != torch.float64 or acc.dim() != 1 or acc.numel() != n:
        raise ValueError(f"acc must be a flat float64 vector of {n} entries")


def sq_norm(x: Tensor) -> float:
    """sum_i x_i^2, each term and the sum in float64."""
    return sum(float(torch.dot(p, p)) for _, p in _chunks(x))


def sq_distance(x: Tensor, y: Tensor) -> float:
    """||x - y||^2 with the differences and the sum in float64 (float32 differences of
    entries near 3e38 would overflow)."""
    return sum(float(torch.dot(p, p)) for _, p in _chunks(x, y))


def add_scaled_(acc: Tensor, x: Tensor, alpha: float = 1.0) -> Tensor:
    """acc += alpha * x in place, acc a flat float64 vector; x of any float dtype is
    widened a chunk at a time. Returns acc."""
    _check_acc(acc, x)
    for where, part in _chunks(x):
        acc[where].add_(part, alpha=alpha)
    return acc


def widened(x: Tensor) -> Tensor:
    """A new flat float64 copy of x (for the accumulators' first vector)."""
    return add_scaled_(torch.zeros(_flat(x).numel(), dtype=torch.float64), x)


def move_mean_(mean: Tensor, x: Tensor, step: float) -> float:
    """One Welford step in place: with delta = x - mean (float64), mean += step * delta;
    returns ||delta||^2. Each chunk of x - mean is taken before that chunk of the mean
    moves, so the mean may be both the accumulator and the point subtracted."""
    return _add_with_norm(mean, x, mean, step)


def add_difference_(acc: Tensor, x: Tensor, y: Tensor, alpha: float = 1.0) -> float:
    """acc += alpha * (x - y) in place, the differences taken in float64; returns
    ||x - y||^2."""
    return _add_with_norm(acc, x, y, alpha)


def add_scaled_norm_(acc: Tensor, x: Tensor, alpha: float = 1.0) -> float:
    """`add_scaled_` that also returns ||x||^2 (float64), from the same widened chunks."""
    return _add_with_norm(acc, x, None, alpha)


def _add_with_norm(acc: Tensor, x: Tensor, minus: Tensor | None, alpha: float) -> float:
    _check_acc(acc, x)
    total = 0.0
    for where, part in _chunks(x, minus):
        total += float(torch.dot(part, part))
        acc[where].add_(part, alpha=alpha)
    return total
