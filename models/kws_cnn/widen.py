"""Function-preserving widening of a trained `KwsCnn` to a larger width (Net2WiderNet).

A wide model trained from scratch on a CPU needs many hours to catch up with a narrow one
that is already trained. Widening copies each narrow channel into a contiguous block of
wide channels and divides the weights that read those copies by the block size, so the
wide model computes exactly the narrow model's function: training then starts from the
narrow model's accuracy and spends its steps on the extra capacity.

GroupNorm survives the copy because each block stays inside one group: wide group g holds
exactly the copies of narrow group g's channels, so its mean and variance are unchanged.
Copies of one channel would receive identical gradients forever; a little noise on the
convolution weights breaks that symmetry (`noise`, relative to each tensor's spread)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from wakefl.errors import ConfigError

from .model import KwsCnn


def _block_ratio(wide: int, narrow: int, what: str) -> int:
    if wide % narrow != 0:
        raise ConfigError(f"cannot widen {what}: {wide} channels are not a multiple of {narrow}")
    return wide // narrow


def _expand(t: torch.Tensor, dim: int, ratio: int) -> torch.Tensor:
    """Each slice along `dim` repeated `ratio` times in a contiguous block."""
    return torch.repeat_interleave(t, ratio, dim=dim)


@torch.no_grad()
def widen(
    model: KwsCnn, width: float, noise: float = 0.0, generator: torch.Generator | None = None
) -> KwsCnn:
    """A `KwsCnn` of `width` that computes what `model` computes (to float rounding when
    `noise` is 0). ConfigError when `width` is narrower or a layer's channels are not whole
    multiples of the narrow model's."""
    if width < model.cfg.width:
        raise ConfigError(f"cannot widen a width-{model.cfg.width} model to {width}")
    wide = KwsCnn(dataclasses.replace(model.cfg, width=width)).to(next(model.parameters()).dtype)
    src = [m for m in model.features if isinstance(m, nn.Conv2d | nn.GroupNorm)]
    dst = [m for m in wide.features if isinstance(m, nn.Conv2d | nn.GroupNorm)]
    in_ratio = 1
    for i, (a, b) in enumerate(zip(src, dst, strict=True)):
        if isinstance(a, nn.Conv2d):
            assert isinstance(b, nn.Conv2d)
            out_ratio = _block_ratio(b.out_channels, a.out_channels, f"convolution {i // 2}")
            w = _expand(_expand(a.weight, 0, out_ratio), 1, in_ratio) / in_ratio
            if noise > 0:
                w = w + noise * w.std() * torch.randn(w.shape, generator=generator).to(w)
            b.weight.copy_(w)
            in_ratio = out_ratio
        else:
            assert isinstance(b, nn.GroupNorm)
            b.weight.copy_(_expand(a.weight, 0, in_ratio))
            b.bias.copy_(_expand(a.bias, 0, in_ratio))
    first, first_wide = model.head[1], wide.head[1]
    assert isinstance(first, nn.Linear) and isinstance(first_wide, nn.Linear)
    first_wide.weight.copy_(_expand(first.weight, 1, in_ratio) / in_ratio)
    first_wide.bias.copy_(first.bias)
    wide.head[3].load_state_dict(model.head[3].state_dict())
    return wide.train(model.training)
