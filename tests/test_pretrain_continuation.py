"""A pretraining run continued in a later session from its committed weights: the
schedule and the data take up at the step those weights were saved at."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from micro_training import SETTINGS

from wakefl.errors import ConfigError
from wakefl.tools.training.pretrain import pretrain
from wakefl.tools.training.settings import LAST, continued_lr_at, lr_at


@pytest.fixture(scope="module")
def corpus(pretrain_micro_corpus: Path) -> Path:
    return pretrain_micro_corpus


def test_a_run_continued_from_committed_weights_takes_up_its_schedule_at_that_step(
    corpus: Path, tmp_path: Path
) -> None:
    # A session ends after step 3; only that step's weights survive it (the run's --out,
    # with the optimizer moments, does not).
    pretrain(corpus, tmp_path / "a", SETTINGS, progress=False, max_steps=3)
    weights = tmp_path / "a" / LAST
    info = pretrain(
        corpus, tmp_path / "c", SETTINGS, init_from=weights, start_step=3, progress=False
    )
    assert info["step"] == SETTINGS.total_steps and info["continued_at_step"] == 3
    history = [json.loads(x) for x in (tmp_path / "c" / "history.jsonl").read_text().splitlines()]
    # Validated at step 6 only: steps 1-3 were the first session's. The rate is the
    # schedule's once the fresh moments are warmed up (2 steps here).
    assert [h["step"] for h in history] == [6]
    assert history[0]["lr"] == pytest.approx(lr_at(5, SETTINGS))
    every = dataclasses.replace(SETTINGS, eval_every_steps=1)
    pretrain(corpus, tmp_path / "e", every, init_from=weights, start_step=3, progress=False)
    rates = [
        json.loads(x)["lr"] for x in (tmp_path / "e" / "history.jsonl").read_text().splitlines()
    ]
    assert rates == pytest.approx([lr_at(3, every) / 2, lr_at(4, every), lr_at(5, every)])
    for kwargs, match in (
        ({"start_step": 2}, "--init-from"),
        ({"start_step": 2, "init_from": weights, "resume": True}, "--init-from"),
        ({"start_step": SETTINGS.total_steps, "init_from": weights}, "outside"),
        ({"start_step": -1, "init_from": weights}, "outside"),
    ):
        with pytest.raises(ConfigError, match=match):
            pretrain(corpus, tmp_path / "d", SETTINGS, progress=False, **kwargs)
    assert not (tmp_path / "d").exists()  # refused before anything was written


def test_the_rate_warms_up_again_from_the_step_a_run_was_continued_at() -> None:
    s = dataclasses.replace(SETTINGS, samples=16 * 100, warmup_steps=10)
    assert continued_lr_at(50, s, None) == lr_at(50, s)
    assert continued_lr_at(40, s, 40) == pytest.approx(lr_at(40, s) / 10)
    assert continued_lr_at(44, s, 40) == pytest.approx(lr_at(44, s) / 2)
    assert continued_lr_at(49, s, 40) == lr_at(49, s)
    assert continued_lr_at(90, s, 40) == lr_at(90, s)
