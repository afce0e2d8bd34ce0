"""Hard-negative mining over a window cache: the pool is the highest-scoring of the cache's
rendered negatives, a share of each batch's negatives comes from it, and a run that mines
resumes to the weights of one that was never stopped."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from micro_training import SETTINGS as MICRO_SETTINGS
from safetensors.torch import load_file

from wakefl.errors import ConfigError
from wakefl.tools.training.hard_negatives import (
    CACHED,
    cached_candidates,
    fits_cache,
    mine_cached,
)
from wakefl.tools.training.pretrain import pretrain
from wakefl.tools.training.settings import STATE_INFO, STATE_WEIGHTS
from wakefl.tools.training.window_cache import WindowCache

# The micro settings, four batches long, validated every second step.
SETTINGS = dataclasses.replace(
    MICRO_SETTINGS, samples=16 * 4, eval_every_steps=2, warmup_steps=1, workers=0
)


def test_mining_over_a_cache_keeps_its_highest_scoring_negatives() -> None:
    labels = np.array([0, 1] * 20)
    negatives = np.flatnonzero(labels == 0)
    level = np.random.default_rng(0).uniform(0, 1, labels.size)

    desc = cached_candidates(negatives, 12, seed=1, step=3)
    assert np.array_equal(desc, cached_candidates(negatives, 12, seed=1, step=3))
    assert not np.array_equal(desc, cached_candidates(negatives, 12, seed=1, step=4))
    assert (desc[:, 0] == CACHED).all() and len(set(desc[:, 1])) == 12
    assert set(desc[:, 1]) <= set(negatives)
    # Fewer negatives than candidates: every one of them, once.
    assert sorted(cached_candidates(negatives[:5], 12, 1, 3)[:, 1]) == sorted(negatives[:5])
    pool = mine_cached(lambda i: level[i], negatives, 12, 4, seed=1, step=3, chunk=5)
    assert np.allclose(level[pool[:, 1]], np.sort(level[desc[:, 1]])[::-1][:4])
    assert fits_cache(pool, labels)
    assert not fits_cache(pool, labels[: pool[:, 1].max()])  # a shorter cache
    assert not fits_cache(np.array([[CACHED, 1, 0]]), labels)  # a phrase window
    assert not fits_cache(np.array([[1, 0, 0]]), labels)  # a raw clip's descriptor


@pytest.mark.slow
def test_a_cached_run_mines_its_rendered_negatives_and_resumes_to_the_same_weights(
    pretrain_micro_corpus: Path, tmp_path: Path
) -> None:
    corpus = pretrain_micro_corpus
    s = dataclasses.replace(
        SETTINGS,
        arch="v2",
        window_cache=str(tmp_path / "cache"),
        cache_windows=16 * 64,
        hard_negative_share=0.5,
        mine_every_steps=2,
        mine_candidates=40,
        hard_pool=6,
    )
    whole = pretrain(corpus, tmp_path / "whole", s, progress=False)
    cache = WindowCache.load(tmp_path / "cache")
    pool = np.asarray(whole["hard_pool"])
    assert whole["hard_pool_step"] == 2 and pool.shape == (6, 3)
    assert (pool[:, 0] == CACHED).all() and (cache.labels[pool[:, 1]] == 0).all()
    # A share of each batch's negatives comes from the pool; without one, the batch is the
    # one a run without mining draws.
    n_pos = round(s.batch_size * s.positive_share)
    n_hard = round((s.batch_size - n_pos) * s.hard_negative_share)
    x, y = cache.batch(3, s, pool[:, 1])
    plain_x, plain_y = cache.batch(3, dataclasses.replace(s, hard_negative_share=0.0))
    assert (y[n_pos : n_pos + n_hard] == 0).all()
    hard = {cache.log_mel[i].tobytes() for i in pool[:, 1]}
    assert all(x[j].half().numpy().tobytes() in hard for j in range(n_pos, n_pos + n_hard))
    torch.testing.assert_close(x[n_pos + n_hard :], plain_x[n_pos + n_hard :])
    assert torch.equal(y[:n_pos], plain_y[:n_pos])
    pretrain(corpus, tmp_path / "parts", s, progress=False, max_steps=3)
    pretrain(corpus, tmp_path / "parts", s, progress=False, resume=True)
    a = load_file(str(tmp_path / "whole" / STATE_WEIGHTS))
    b = load_file(str(tmp_path / "parts" / STATE_WEIGHTS))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    # A pool naming a phrase window (made over another cache) is refused on resume.
    info_path = tmp_path / "parts" / STATE_INFO
    state = json.loads(info_path.read_text())
    state["hard_pool"][0] = [CACHED, int(np.flatnonzero(cache.labels == 1)[0]), 0]
    state["step"] = 3
    info_path.write_text(json.dumps(state))
    with pytest.raises(ConfigError, match="another corpus"):
        pretrain(corpus, tmp_path / "parts", s, progress=False, resume=True)
