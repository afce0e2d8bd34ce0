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

from .model import KwsCnn


@torch.no_grad()
def blend(first: KwsCnn, second: KwsCnn, alpha: float) -> KwsCnn:
    """A new model with parameters (1 - alpha) * first + alpha * second. ConfigError when
    alpha is outside [0, 1], the two configs differ, or a blended parameter is not finite."""
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
        raise ConfigError(f"the blend weight must be in [0, 1], got {alpha!r}")
    if first.cfg != second.cfg:
        raise ConfigError(f"cannot blend models of different configs: {first.cfg} and {second.cfg}")
    out = KwsCnn(first.cfg)
    theirs = dict(second.named_parameters())
    for name, p in dict(first.named_parameters()).items():
        mixed = torch.lerp(p.detach().float(), theirs[name].detach().float(), float(alpha))
        if not torch.isfinite(mixed).all():
            raise ConfigError(f"blended parameter {name} is not finite")
        dict(out.named_parameters())[name].copy_(mixed)
    return out.eval()
