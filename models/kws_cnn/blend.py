"""Weight blending of two `KwsCnn` models of one architecture: (1 - a) * first + a * second.

When a model fine-tuned from another learns something new (more voices) but loses some of
what it had (a device type's false accepts), the straight line between the two sets of
weights often keeps part of each: fine-tuning from a shared start stays in one basin of the
loss. GroupNorm keeps no running statistics, so blending the parameters blends everything
the model holds."""

from __future__ import annotations

import math

import torch

from wakefl.errors import ConfigError
from wakefl.finite import all_finite

from .flat_params import get_flat_params, set_flat_params
from .model import KwsCnn


@torch.no_grad()
def blend(first: KwsCnn, second: KwsCnn, alpha: float) -> KwsCnn:
    """A new model with parameters (1 - alpha) * first + alpha * second. ConfigError when
    alpha is outside [0, 1], the two configs differ, or the blend is not finite."""
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
        raise ConfigError(f"the blend weight must be in [0, 1], got {alpha!r}")
    if first.cfg != second.cfg:
        raise ConfigError(f"cannot blend models of different configs: {first.cfg} and {second.cfg}")
    mixed = torch.lerp(get_flat_params(first), get_flat_params(second), float(alpha))
    if not all_finite(mixed):
        bad = int((~torch.isfinite(mixed)).sum())
        raise ConfigError(f"the blend is not finite: {bad} NaN/Inf parameter value(s)")
    out = KwsCnn(first.cfg)
    set_flat_params(out, mixed)
    return out.eval()
