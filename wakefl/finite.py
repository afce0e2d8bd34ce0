"""An exact, cheap test that a tensor holds no NaN or Inf.

`torch.isfinite(x).all()` materialises a boolean tensor and costs ~8 ms on a 3M-entry
model vector on one core; the server runs it several times per update. A sum is ~50x
cheaper and is finite only if every term is: NaN and Inf propagate through addition, and
Inf + -Inf is NaN. A non-finite sum may still come from finite terms that overflow, so
that case falls back to the element-wise test: the answer is always exact.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def all_finite(x: Tensor) -> bool:
    """True when every entry of `x` is finite (integer and empty tensors always are)."""
    if x.is_complex():
        return bool(torch.isfinite(x).all())
    if not x.is_floating_point() or x.numel() == 0:
        return True
    if math.isfinite(float(x.sum())):
        return True
    return bool(torch.isfinite(x).all())
