"""Input checks shared by the baseline strategies: finiteness and shape of parameter
vectors coming from the server, the clients or the local optimiser."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from wakefl.errors import NonFiniteError, ProtocolError
from wakefl.finite import all_finite


def require_finite(vec: Tensor, what: str) -> Tensor:
    """Return `vec` if every entry is finite, else raise NonFiniteError naming `what`."""
    if not all_finite(vec):
        bad = int((~torch.isfinite(vec)).sum())
        raise NonFiniteError(f"{what}: {bad} of {vec.numel()} entries are NaN or Inf")
    return vec


def require_finite_scalar(value: float, what: str) -> float:
    """Return `value` as float if finite, else raise NonFiniteError naming `what`."""
    value = float(value)
    if not math.isfinite(value):
        raise NonFiniteError(f"{what} is {value}, a finite number is required")
    return value


def require_like(vec: Tensor, like: Tensor, what: str) -> Tensor:
    """Refuse a parameter vector whose shape differs from the model's (a malformed update)."""
    if vec.shape != like.shape:
        raise ProtocolError(
            f"{what} has shape {tuple(vec.shape)}, the model's parameter vector has "
            f"shape {tuple(like.shape)}"
        )
    return vec


def require_positive(value: float, what: str) -> float:
    """Hyperparameter check: finite and > 0 (ValueError: a programming/config mistake)."""
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a finite number > 0, got {value}")
    return value


def require_count(value: int, what: str, minimum: int = 0) -> int:
    """Hyperparameter check: an integer >= `minimum`."""
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)
