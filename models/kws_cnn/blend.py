"""Weight blending of `KwsCnn` models of one architecture: (1 - a) * first + a * second, or
the weighted average of several ("soup").

When a model fine-tuned from another learns something new (more voices) but loses some of
what it had (a device type's false accepts), the straight line between the two sets of
weights often keeps part of each: fine-tuning from a shared start stays in one basin of the
loss. GroupNorm keeps no running statistics, so blending the parameters blends everything
the model holds. Several fine-tunes of one start, each pushed a different way (more of one
device type, of one speech engine, of the near-rhymes), can be averaged the same way."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from wakefl.errors import ConfigError
from wakefl.finite import all_finite

from .config import ModelConfig
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
    return _model_of(first.cfg, mixed, "blend")


@torch.no_grad()
def average(models: Sequence[KwsCnn], shares: Sequence[float]) -> KwsCnn:
    """A new model with parameters sum_i shares[i] * models[i]. ConfigError unless there
    are as many shares as models (at least one), each share is finite and non-negative,
    the shares sum to 1, every config is the same, and the average is finite."""
    if not models or len(models) != len(shares):
        raise ConfigError(f"need one share per model, got {len(shares)} for {len(models)} model(s)")
    for s in shares:
        if not (isinstance(s, int | float) and math.isfinite(s) and s >= 0.0):
            raise ConfigError(f"a share must be a finite number >= 0, got {s!r}")
    if not math.isclose(math.fsum(shares), 1.0, abs_tol=1e-6):
        raise ConfigError(f"the shares must sum to 1, got {math.fsum(shares)!r}")
    first = models[0]
    for m in models[1:]:
        if m.cfg != first.cfg:
            raise ConfigError(
                f"cannot average models of different configs: {first.cfg} and {m.cfg}"
            )
    # Summed in float64: with several terms, float32 rounding would depend on their order.
    mixed = sum(float(s) * get_flat_params(m).double() for m, s in zip(models, shares, strict=True))
    return _model_of(first.cfg, torch.as_tensor(mixed).float(), "average")


def _model_of(cfg: ModelConfig, flat: torch.Tensor, what: str) -> KwsCnn:
    """A model in eval mode holding these flat parameters; ConfigError if any is not
    finite (a NaN in one parent would spread to every output)."""
    if not all_finite(flat):
        bad = int((~torch.isfinite(flat)).sum())
        raise ConfigError(f"the {what} is not finite: {bad} NaN/Inf parameter value(s)")
    out = KwsCnn(cfg)
    set_flat_params(out, flat)
    return out.eval()
