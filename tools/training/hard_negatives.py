"""Hard-negative mining for pretraining.

False accepts per hour are set by the few negatives that score highest: a confusable phrase in
a reverberant room, speech over an alarm. Random negatives rarely include them, so every
`mine_every_steps` the trainer scores a fresh random set of candidate negatives (1.5 s cuts
of the training streams and negative training clips) with the current model and keeps the
highest-scoring ones as a pool; a share of each batch's negatives is then drawn from the pool
(and augmented like every other window).

A pool is stored as descriptors, one row (source, index, start) per window: source 0 is
training stream `index` from sample `start`, source 1 is negative training clip `index`.
They go into the checkpoint, so a resumed run trains on the pool the killed run had.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

STREAM, CLIP = 0, 1


def candidates(
    streams: list[np.ndarray], n_clips: int, window: int, n: int, seed: int, step: int
) -> np.ndarray:
    """`n` random candidate descriptors [n, 3] for the mining at `step`: half stream cuts
    (all of them without clips), the rest negative clips (all of them without streams)."""
    rng = np.random.default_rng([seed, 91, step])
    n_cut = (n // 2 if n_clips else n) if streams else 0
    rows = np.zeros((n, 3), np.int64)
    if n_cut:
        which = rng.integers(len(streams), size=n_cut)
        rows[:n_cut, 0] = STREAM
        rows[:n_cut, 1] = which
        sizes = np.array([s.size - window + 1 for s in streams])[which]
        rows[:n_cut, 2] = (rng.random(n_cut) * sizes).astype(np.int64)
    if n > n_cut:
        rows[n_cut:, 0] = CLIP
        rows[n_cut:, 1] = rng.integers(n_clips, size=n - n_cut)
    return rows


def fits(desc: np.ndarray, streams: list[np.ndarray], n_clips: int, window: int) -> bool:
    """Whether every descriptor names a whole window of these streams or clips (a pool
    restored from a checkpoint made on another corpus does not)."""
    for source, index, start in np.asarray(desc, np.int64).reshape(-1, 3):
        if source == STREAM:
            ok = 0 <= index < len(streams) and 0 <= start <= streams[index].size - window
        else:
            ok = source == CLIP and 0 <= index < n_clips
        if not ok:
            return False
    return True


def windows_of(
    desc: np.ndarray, streams: list[np.ndarray], clips: np.ndarray, window: int
) -> np.ndarray:
    """The audio windows [len(desc), window] that descriptors name."""
    out = np.empty((len(desc), window), np.float32)
    for j, (source, index, start) in enumerate(np.asarray(desc, np.int64)):
        if source == STREAM:
            out[j] = streams[index][start : start + window]
        else:
            out[j] = clips[index]
    return out


def mine(
    score: Callable[[np.ndarray], np.ndarray],
    streams: list[np.ndarray],
    clips: np.ndarray,
    window: int,
    n_candidates: int,
    pool_size: int,
    seed: int,
    step: int,
    chunk: int = 512,
) -> np.ndarray:
    """Descriptors of the `pool_size` highest-scoring of this step's candidates, best first
    (ties keep the candidates' order). `score` maps windows [n, window] to wake-word
    probabilities [n]; candidates are scored a chunk at a time to bound memory."""
    if not streams and not len(clips):
        return np.zeros((0, 3), np.int64)
    desc = candidates(streams, len(clips), window, n_candidates, seed, step)
    scores = np.concatenate(
        [
            np.asarray(score(windows_of(desc[i : i + chunk], streams, clips, window)))
            for i in range(0, len(desc), chunk)
        ]
    )
    order = np.argsort(-scores, kind="stable")[:pool_size]
    return desc[order]
