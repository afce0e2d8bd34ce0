"""Time warping of log-mel spectrograms, for pretraining.

Speech engines render "hey nova" with their own timing, and people do too: one stretches
"hey", another clips it and draws out "nova". A model trained on a few engines learns their
ratios: the step-13 full model scores espeak-ng's and festival HTS's dry "hey nova" 0.998-1.000,
and 0.087-0.098 with "hey" compressed to 0.6 of its length (tools/evaluation/probe_timing.py). A warp
around a random point seldom compresses "hey" alone; the `pretrain-timing` corpus profile
re-times it directly (tools/CORPUS.md).
Tape-speed augmentation (tools/augmentation/wave_augment.py) changes the whole utterance's tempo at once
and leaves those ratios alone.

The warp is SpecAugment's: each example's frames are split at an anchor, and the anchor is
moved, so the part before it is stretched and the part after it compressed (or the
reverse), each linearly. The first and last frames stay where they are. Output frame t reads
the input at a fractional frame, interpolated between its two neighbours.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# The anchor is drawn from the middle of the window, so neither side becomes a sliver.
ANCHOR_RANGE = (0.25, 0.75)
# The side nearer the window's edge is stretched or compressed by a factor in
# [1 - warp, 1 + warp]; beyond a half, a syllable could shrink to a frame or two.
MAX_WARP = 0.5


def source_frames(frames: int, anchor: np.ndarray, moved: np.ndarray) -> np.ndarray:
    """Fractional input frame [B, frames] that each output frame reads, for anchors at
    input frame `anchor` [B] moved to output frame `moved` [B] (both strictly inside
    (0, frames - 1)); anchor == moved gives 0, 1, ..., frames - 1."""
    last = float(frames - 1)
    a = np.asarray(anchor, dtype=np.float64).reshape(-1, 1)
    m = np.asarray(moved, dtype=np.float64).reshape(-1, 1)
    if np.any((a <= 0) | (a >= last) | (m <= 0) | (m >= last)):
        raise ValueError("anchors must lie strictly inside the window")
    t = np.arange(frames, dtype=np.float64)[None, :]
    before = t * a / m
    after = a + (t - m) * (last - a) / (last - m)
    return np.where(t <= m, before, after)


def draw_warp(
    batch: int, frames: int, warp: float, generator: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Anchors [batch] and the output frames they move to, drawn from the torch CPU
    `generator` (so a step's warp is the same on any device): each anchor uniform over the
    middle half of the window, moved by up to `warp` of its distance to the nearer edge."""
    import torch

    if not 0.0 <= warp < MAX_WARP:
        raise ValueError(f"time warp must be in [0, {MAX_WARP}), got {warp}")
    last = frames - 1
    u = torch.rand(2, batch, generator=generator).numpy().astype(np.float64)
    lo, hi = ANCHOR_RANGE
    anchor = (lo + (hi - lo) * u[0]) * last
    moved = anchor + warp * (2.0 * u[1] - 1.0) * np.minimum(anchor, last - anchor)
    return anchor, moved


def warp_time(feats: Any, anchor: np.ndarray, moved: np.ndarray) -> Any:
    """Log-mel [B, n_mels, frames] (torch) with each example's time axis warped so that its
    input frame anchor[i] lands on output frame moved[i] (linear interpolation)."""
    import torch

    from wakefl.tools.augmentation.spectrogram_interp import interpolate_at

    pos = torch.as_tensor(
        source_frames(feats.shape[2], anchor, moved), dtype=feats.dtype, device=feats.device
    )
    return interpolate_at(feats, pos, dim=2)
