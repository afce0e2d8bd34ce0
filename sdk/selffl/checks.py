"""Input checks shared by Self-FL and the baseline strategies.

Three kinds of bad input, three errors:
* NaN or Inf in parameters or uncertainties -> `NonFiniteError` (the round is refused and
  the previous state kept);
* an update whose shape is not the model's -> `ProtocolError` (a malformed message);
* a hyperparameter or rule argument outside its domain -> `HyperparameterError`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from wakefl.errors import ConfigError, NonFiniteError, ProtocolError
from wakefl.finite import all_finite


class HyperparameterError(ConfigError, ValueError):
    """A hyperparameter or rule argument outside its domain (lr <= 0, C outside (0, 1], a
    negative variance...). A `ConfigError`, so the CLI reports it without a trace, and a
    `ValueError`, so callers that treat bad arguments the standard Python way still can."""


def require_finite(vec: Tensor, what: str) -> Tensor:
    """Return `vec` if every entry is finite, else raise `NonFiniteError` naming `what`."""
    if not all_finite(vec):
        bad = int((~torch.isfinite(vec)).sum())
        raise NonFiniteError(f"{what}: {bad} of {vec.numel()} entries are NaN or Inf")
    return vec


def require_finite_scalar(value: float, what: str, *, allow_inf: bool = False) -> float:
    """Return `value` as float; raise `NonFiniteError` for NaN, and for +-Inf unless
    `allow_inf` (S_-m is +Inf when another client is perfectly certain)."""
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
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
    """A finite number > 0 (learning rates, prior variances)."""
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise HyperparameterError(f"{what} must be a finite number > 0, got {value}")
    return value


def require_non_negative(value: float, what: str) -> float:
    """A finite number >= 0 (variances, proximal weights)."""
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise HyperparameterError(f"{what} must be a finite number >= 0, got {value}")
    return value


def require_count(value: int, what: str, minimum: int = 0) -> int:
    """An integer >= `minimum` (step counts, batch sizes)."""
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise HyperparameterError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def require_activity_rate(activity_rate: float) -> float:
    """The activity rate C = |A| / M of a round, in (0, 1]."""
    rate = require_finite_scalar(activity_rate, "activity rate")
    if not 0.0 < rate <= 1.0:
        raise HyperparameterError(f"activity rate C must be in (0, 1], got {activity_rate!r}")
    return rate


def require_choice(value: str, choices: tuple[str, ...], what: str) -> str:
    """One of a fixed set of names."""
    if value not in choices:
        raise HyperparameterError(f"{what} must be one of {choices}, got {value!r}")
    return value
