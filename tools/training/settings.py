"""Pretraining's settings and schedule: `PretrainSettings` (every knob of a run, each
explained where it is declared), the learning-rate schedule and the names of the files a
run folder holds."""

from __future__ import annotations

import math
from dataclasses import dataclass

STATE_WEIGHTS = "state.safetensors"
STATE_INFO = "state.json"
BEST = "best.safetensors"
BEST_CARD = "best.card.json"
HISTORY = "history.jsonl"
# Relative spread of the noise that lets the copies made by widening a narrower --init-from
# model diverge: small enough to keep its accuracy, large enough to break the symmetry.
WIDEN_NOISE = 0.02
# What `balance_by` may group training clips by.
BALANCE_KEYS = ("device_type", "engine")


@dataclass(frozen=True)
class PretrainSettings:
    width: float = 1.0
    phrase: str = "hey nova"
    seed: int = 0
    batch_size: int = 32
    samples: int = 400_000  # training samples in the whole run (sets the schedule)
    lr: float = 2e-3
    weight_decay: float = 1e-4
    warmup_steps: int = 300
    # A third of each batch is the phrase: false accepts per hour are set by the rare
    # negatives that score high, so negatives get the larger share.
    positive_share: float = 1 / 3
    stream_crop_share: float = 0.4  # of the negatives in a batch
    spec_masks: bool = True
    # Vocal-tract-length perturbation: each example's spectrum scaled by a factor drawn
    # from [1 - mel_warp, 1 + mel_warp] (tools/training/mel_warp.py); 0 = off.
    mel_warp: float = 0.0
    # Each example's time axis split at a random anchor that moves, so one side is stretched
    # and the other compressed; the side nearer the edge by a factor in [1 - time_warp,
    # 1 + time_warp] (tools/training/time_warp.py); 0 = off.
    time_warp: float = 0.0
    # Share of the negatives drawn from the mined pool of high-scoring negatives
    # (tools/training/hard_negatives.py); 0 = off. The pool is renewed every `mine_every_steps`.
    hard_negative_share: float = 0.0
    # Draw each wake-phrase and negative clip from a group chosen uniformly, then a clip of
    # that group: groups by "device_type" (the corpus has 4x as many clips of A as of E, and
    # E is where held-out phrases are missed most) or by speech "engine" (three quarters of
    # the phrases are espeak-ng's; flite's are missed most). "": clips drawn uniformly.
    balance_by: str = ""
    # Knowledge distillation: a teacher model (weights file; "" = off) scores the same
    # augmented batch, and this share of the loss pulls the student's class probabilities
    # at `distill_temperature` towards the teacher's. A narrow model learns more from a
    # wide one's graded scores (how near a "hey noah" is to the phrase) than from labels.
    distill_from: str = ""
    distill_weight: float = 0.0
    distill_temperature: float = 2.0
    # Share of the training windows also passed through the second acoustic simulation's
    # training stages (tools/acoustics/field_acoustics.py field_augment: image-source rooms apart from
    # the held-out ones, noise suppression, AGC, clipping, a narrowband link, a coarse
    # converter); 0 = off.
    field_augment: float = 0.0
    # A manifest whose validation split (clips and streams) picks the best checkpoint
    # instead of the training corpus's, e.g. a `pretrain-acoustics` build: held-out acoustics
    # that training never simulates. "" = the training corpus's validation split.
    val_corpus: str = ""
    mine_every_steps: int = 1500
    mine_candidates: int = 6000
    hard_pool: int = 600
    eval_every_steps: int = 500
    checkpoint_minutes: float = 5.0
    val_fa_per_hour: float = 2.0
    val_stream_seconds: float = 300.0  # per validation stream (caps validation cost)
    threads: int = 2
    device: str = "cpu"
    # Processes preparing batches (decoding nothing: augmentation only). Each batch depends
    # on its step alone, so any count gives the same run; a GPU needs several to be fed.
    workers: int = 1

    @property
    def total_steps(self) -> int:
        return max(1, math.ceil(self.samples / self.batch_size))


def lr_at(step: int, s: PretrainSettings) -> float:
    """Linear warm-up, then a cosine from `lr` down to 5% of it at the last step."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    frac = min(1.0, (step - s.warmup_steps) / max(1, s.total_steps - s.warmup_steps))
    return s.lr * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def distillation_in_range(weight: float, temperature: float) -> bool:
    """Whether a teacher's share of the loss is in (0, 1] and its temperature in (0, 100]
    (False for NaN)."""
    return 0.0 < weight <= 1.0 and 0.0 < temperature <= 100.0
