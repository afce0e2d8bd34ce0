"""The training tests' run settings: a width-0.25 model, six batches of 16 over the micro
pretraining corpus (conftest's `pretrain_micro_corpus`), validated every third step on
6 s of each validation stream: seconds of training, every part of a run exercised."""

from __future__ import annotations

from wakefl.tools.training.settings import PretrainSettings

SETTINGS = PretrainSettings(
    width=0.25,
    samples=16 * 6,
    batch_size=16,
    eval_every_steps=3,
    warmup_steps=2,
    threads=1,
    val_stream_seconds=6.0,
)
