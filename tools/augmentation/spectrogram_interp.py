"""Reading a log-mel spectrogram at fractional positions along one axis.

The spectrum warp (tools/augmentation/mel_warp.py) reads each band at a fractional band, and the time
warp (tools/augmentation/time_warp.py) reads each frame at a fractional frame; both interpolate
linearly between the two neighbours, here.
"""

from __future__ import annotations

from typing import Any


def interpolate_at(feats: Any, pos: Any, dim: int) -> Any:
    """`feats` [B, n_mels, frames] (torch) read at fractional indices `pos` along `dim`
    (1: bands, pos [B, n_mels]; 2: frames, pos [B, frames]), the same for every entry of
    the other axis. `pos` must lie in [0, size - 1] of that axis."""
    import torch

    if dim not in (1, 2):
        raise ValueError(f"dim must be 1 (bands) or 2 (frames), got {dim}")
    size = feats.shape[dim]
    lo = pos.floor().long().clamp(0, size - 1)
    hi = (lo + 1).clamp(max=size - 1)
    other = 2 if dim == 1 else 1  # the axis each position is shared along
    frac = (pos - lo.to(pos.dtype)).unsqueeze(other)
    below = torch.gather(feats, dim, lo.unsqueeze(other).expand(feats.shape))
    above = torch.gather(feats, dim, hi.unsqueeze(other).expand(feats.shape))
    return below + frac * (above - below)
