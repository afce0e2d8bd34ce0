"""Hard-negative mining for pretraining.

False accepts per hour are set by the few negatives that score highest: a confusable phrase in
a reverberant room, speech over an alarm. Random negatives rarely include them, so every
`mine_every_steps` the trainer scores a fresh random set of candidate negatives (1.5 s cuts
of the training streams and negative training clips) with the current model and keeps the
highest-scoring ones as a pool; a share of each batch's negatives is then drawn from the pool
(and augmented like every other window).

A pool is stored as descriptors, one row (source, index, start) per window: source 0 is
training stream `index` from sample `start`, source 1 is negative training clip `index`,
source 2 is rendered window `index` of the run's window cache (tools/training/window_cache.py:
a run over a cache mines its already augmented negatives, so the pool is what the model
sees, babble and AGC included). They go into the checkpoint, so a resumed run trains on the
pool the killed run had.

The first half is pure, on arrays; `mine_pool`, `has_pool` and `restore_pool` apply it to a
training run (tools/training/pretrain.py's `_Run`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from wakefl.errors import ConfigError

STREAM, CLIP, CACHED = 0, 1, 2


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


def cached_candidates(negatives: np.ndarray, n: int, seed: int, step: int) -> np.ndarray:
    """`n` distinct candidate descriptors [n, 3] for the mining at `step` over a window
    cache: rendered windows drawn from `negatives` (the cache's negative windows the run has
    reached), all of them when there are no more than `n`."""
    negatives = np.asarray(negatives, np.int64)
    rng = np.random.default_rng([seed, 97, step])
    picked = negatives if negatives.size <= n else rng.choice(negatives, n, replace=False)
    rows = np.zeros((picked.size, 3), np.int64)
    rows[:, 0] = CACHED
    rows[:, 1] = picked
    return rows


def fits_cache(desc: np.ndarray, labels: np.ndarray) -> bool:
    """Whether every descriptor names a negative window of a cache with these labels (a pool
    restored from a run over another cache, or over raw audio, does not)."""
    desc = np.asarray(desc, np.int64).reshape(-1, 3)
    if desc.size == 0:
        return True
    index = desc[:, 1]
    inside = (desc[:, 0] == CACHED).all() and (index >= 0).all() and (index < len(labels)).all()
    return bool(inside and (labels[index] == 0).all())


def mine_cached(
    score: Callable[[np.ndarray], np.ndarray],
    negatives: np.ndarray,
    n_candidates: int,
    pool_size: int,
    seed: int,
    step: int,
    chunk: int = 512,
) -> np.ndarray:
    """Descriptors of the `pool_size` highest-scoring of this step's cached candidates, best
    first (ties keep the candidates' order). `score` maps cache indices [n] to wake-word
    probabilities [n], a chunk at a time."""
    desc = cached_candidates(negatives, n_candidates, seed, step)
    if not len(desc):
        return desc
    scores = np.concatenate(
        [np.asarray(score(desc[i : i + chunk, 1])) for i in range(0, len(desc), chunk)]
    )
    return desc[np.argsort(-scores, kind="stable")[:pool_size]]


def mine_pool(run: Any, step: int) -> None:
    """Renew `run`'s pool of hard negatives before `step`; the pool's descriptors go into the
    run's state."""
    from wakefl.tools.training.validation import score_batches

    model, data, s = run.model, run.data, run.s
    was = model.training
    model.eval()
    try:
        if run.cache is not None:
            desc = _mine_cache(run, step)
        else:
            desc = mine(
                lambda w: score_batches(model, w),
                data.train_streams,
                data.neg,
                data.window,
                s.mine_candidates,
                s.hard_pool,
                s.seed,
                step,
            )
    finally:
        model.train(was)
    _use_pool(run, desc)
    run.info["hard_pool_step"] = step


def _mine_cache(run: Any, step: int) -> np.ndarray:
    """The pool's descriptors mined from the window cache's negatives that `step` reaches,
    scored as the model sees them in training before the masks and warps."""
    import torch

    cache, model, s = run.cache, run.model, run.s
    device = next(model.parameters()).device

    def score(index: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(cache.log_mel[index].astype(np.float32)).to(device)
        with torch.no_grad():
            return torch.softmax(model.classify(x), dim=1)[:, 1].cpu().numpy()

    negatives = cache.negatives(step, s)
    return mine_cached(score, negatives, s.mine_candidates, s.hard_pool, s.seed, step)


def has_pool(run: Any) -> bool:
    """Whether `run` has a pool to draw from (mined, or restored from its checkpoint)."""
    return (run.cache_pool if run.cache is not None else run.data.hard) is not None


def _use_pool(run: Any, desc: np.ndarray) -> None:
    """Train on the pool these descriptors name, and keep them in the run's state."""
    data = run.data
    if run.cache is not None:
        run.cache_pool = np.asarray(desc, np.int64).reshape(-1, 3)[:, 1]
    else:
        data.hard = windows_of(desc, data.train_streams, data.neg, data.window)
    run.info["hard_pool"] = np.asarray(desc).tolist()


def restore_pool(run: Any) -> None:
    """The pool a resumed run's checkpoint holds; refused when it names audio this corpus
    (or cache) lacks: a checkpoint made on another corpus."""
    desc = np.asarray(run.info["hard_pool"], np.int64).reshape(-1, 3)
    if run.cache is not None:
        ok = fits_cache(desc, run.cache.labels)
    else:
        ok = fits(desc, run.data.train_streams, len(run.data.neg), run.data.window)
    if not ok:
        raise ConfigError(
            f"--resume: the hard-negative pool in {run.out} names audio this corpus lacks "
            "(was the run made on another corpus?)"
        )
    _use_pool(run, desc)
