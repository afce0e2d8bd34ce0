"""`wakefl model pretrain`'s flags: the data, the model, the augmentation and the schedule
of a pretraining run. settings.py turns them into a checked `PretrainSettings`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def register_pretrain(
    sub: argparse._SubParsersAction, run: Callable[[argparse.Namespace], int]
) -> None:
    """`wakefl model pretrain`: its data and run options, then its schedule."""
    pre = sub.add_parser("pretrain", help="train the wake-word model on the pretraining corpus")
    pre.add_argument("--out", type=Path, required=True, help="run folder (checkpoints, best model)")
    pre.add_argument("--width", type=float, default=1.0, help="width multiplier (0.25 = small)")
    pre.add_argument("--phrase", default="hey nova", help="the wake phrase (synthetic speech)")
    pre.add_argument(
        "--corpus",
        type=Path,
        default=None,
        metavar="MANIFEST",
        help="a corpus manifest with train/val clips and streams "
        "(default: build or reuse the cached 'pretrain' corpus of --phrase and --seed; a "
        "new seed builds a new corpus, about 25 min)",
    )
    pre.add_argument(
        "--extra-corpus",
        type=Path,
        action="append",
        default=[],
        metavar="MANIFEST",
        help="add this corpus's training clips and streams (e.g. the 'pretrain-voices' "
        "profile, or imported recordings); repeatable. Validation stays on --corpus",
    )
    pre.add_argument(
        "--val-corpus",
        type=Path,
        default=None,
        metavar="MANIFEST",
        help="choose the best checkpoint on this corpus's val split (clips and streams) "
        "instead of --corpus's, e.g. a 'pretrain-acoustics' build: held-out acoustics",
    )
    pre.add_argument(
        "--field-augment",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="pass this share of the training windows through the second acoustic "
        "simulation's training stages (rooms, AGC, noise suppression, narrowband link, "
        "clipping; tools/acoustics/field_acoustics.py); 0 = off",
    )
    pre.add_argument(
        "--speech-backgrounds",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="mix other people talking (babble or one voice, -3 to 15 dB SNR, cut from the "
        "training negatives) under this share of the training windows; 0 = off",
    )
    _add_pretrain_run_options(pre)
    _add_pretrain_augment_options(pre)
    _add_pretrain_context_options(pre)
    _add_pretrain_background_options(pre)
    _add_pretrain_hinge_options(pre)
    pre.set_defaults(func=run)


def _add_pretrain_run_options(pre: argparse.ArgumentParser) -> None:
    """Device, initialisation, schedule, validation and checkpointing of `wakefl model
    pretrain`."""
    pre.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    pre.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes preparing augmented batches (the same run for any count; a GPU "
        "needs several to be kept busy)",
    )
    pre.add_argument("--resume", action="store_true", help="continue the run in --out")
    pre.add_argument(
        "--init-from",
        type=Path,
        default=None,
        metavar="WEIGHTS",
        help=(
            "start from these weights (e.g. a shipped model) instead of random; a narrower "
            "model is widened to --width first, computing the same function"
        ),
    )
    pre.add_argument(
        "--start-step",
        type=int,
        default=0,
        metavar="K",
        help="with --init-from: begin at step K of the schedule and data, to continue a run "
        "(same --seed, --samples) from its step-K weights once its --out is gone",
    )
    pre.add_argument(
        "--samples",
        type=int,
        default=400_000,
        help="training samples in the whole run; sets the learning-rate schedule",
    )
    pre.add_argument("--batch-size", type=int, default=32)
    pre.add_argument("--lr", type=float, default=2e-3)
    pre.add_argument(
        "--seed", type=int, default=0, help="training seed, and the default corpus's seed"
    )
    pre.add_argument("--threads", type=int, default=2, help="torch threads for training")
    pre.add_argument("--eval-every", type=int, default=500, metavar="STEPS")
    pre.add_argument(
        "--val-stream-seconds",
        type=float,
        default=300.0,
        metavar="S",
        help="validate on the first S s of each validation stream (validation cost)",
    )
    pre.add_argument("--checkpoint-minutes", type=float, default=5.0)
    pre.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop (with a checkpoint) after this long; --resume continues",
    )
    pre.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_pretrain_augment_options(pre: argparse.ArgumentParser) -> None:
    """The augmentations and negative mining of `wakefl model pretrain` that target what
    the detection benchmark still misses."""
    pre.add_argument(
        "--mel-warp",
        type=float,
        default=0.0,
        metavar="W",
        help="vocal-tract-length perturbation: scale each example's spectrum by a factor in "
        "[1-W, 1+W] (0 = off)",
    )
    pre.add_argument(
        "--time-warp",
        type=float,
        default=0.0,
        metavar="W",
        help="split each example's time axis at a random point and move it, stretching one "
        "side and compressing the other by up to a factor 1±W (0 = off)",
    )
    pre.add_argument(
        "--balance-by",
        choices=("device-type", "engine"),
        default=None,
        help="draw each clip from a device type (or speech engine) chosen uniformly first, "
        "instead of from all clips (the corpus has fewer clips of some)",
    )
    pre.add_argument(
        "--hard-negatives",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="draw this share of the negatives from a pool of the highest-scoring training "
        "negatives, mined again every --mine-every steps (0 = off); with --window-cache, "
        "of the cache's rendered negatives, as augmented",
    )
    pre.add_argument("--mine-every", type=int, default=1500, metavar="STEPS")
    pre.add_argument(
        "--distill-from",
        type=Path,
        default=None,
        metavar="WEIGHTS",
        help="a teacher model (e.g. the shipped full model) whose scores of each augmented "
        "batch the model also learns from",
    )
    pre.add_argument(
        "--distill-weight",
        type=float,
        default=None,
        metavar="W",
        help="with --distill-from: the teacher's share of the loss, in (0, 1] (default 0.5)",
    )
    pre.add_argument(
        "--distill-temperature",
        type=float,
        default=None,
        metavar="T",
        help="with --distill-from: the softmax temperature both models' scores are compared "
        "at, in (0, 100] (default 2)",
    )


def _add_pretrain_context_options(pre: argparse.ArgumentParser) -> None:
    """The model layout, speech around the phrase, and the window cache."""
    pre.add_argument(
        "--arch",
        default="v1",
        metavar="ARCH",
        help="v1 (the shipped models' layout) or v2 (per-frame norm, pooled frame decisions, "
        "PCEN: the phrase keeps its score beside other speech); v2,KEY=VALUE,... overrides "
        "one of its choices (norm, time_pool, gain_norm, first_time_pool, gain_alpha) for an "
        "ablation; gain_norm=log_agc is PCEN's gain stage alone, in the log domain",
    )
    pre.add_argument(
        "--gain-ramp-samples",
        type=int,
        default=0,
        metavar="N",
        help="with gain_norm=log_agc: raise its gain_alpha from 0 (plain log-mel, what an "
        "--init-from model knows) to the arch's value over the first N samples (default 0: "
        "from the first step)",
    )
    pre.add_argument(
        "--window-cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="train over windows rendered once into DIR (log-mel, with this run's "
        "augmentation), rendering --cache-windows of them first where DIR lacks them",
    )
    pre.add_argument("--cache-windows", type=int, default=0, metavar="N")
    pre.add_argument(
        "--context-speech",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="share of training windows, phrases and negatives alike, with speech beside or "
        "under them: the same speaker going on in one breath, other talkers or babble "
        "outside the foreground or over it, -5 to 15 dB (default 0)",
    )
    pre.add_argument(
        "--field-preset",
        choices=("default", "context"),
        default="default",
        help="with --field-augment: the stages' probabilities (context: AGC in half, noise "
        "suppression in a quarter, link, clipping and converters rarely)",
    )


def _add_pretrain_background_options(pre: argparse.ArgumentParser) -> None:
    """What plays behind the foreground: the noise stage's floor, the source of other speech
    and the windows it may go over."""
    pre.add_argument(
        "--noise-snr-floor",
        type=float,
        default=None,
        metavar="DB",
        help="draw the background noise (music, alarms, coloured noise) at DB to 30 dB of "
        "the foreground's active speech instead of 3 to 30 dB over the whole window, e.g. -5 "
        "(the held-out acoustics' fans and babble reach -3 dB)",
    )
    pre.add_argument(
        "--speech-source",
        choices=("negatives", "everyday"),
        default="negatives",
        help="what --context-speech and --speech-backgrounds cut other speech from: every "
        "training negative (half of them near-rhymes of the phrase, the shipped models' "
        "babble) or 'everyday' speech only (clips named *_other.wav), as people talk",
    )
    pre.add_argument(
        "--speech-over-near-rhymes",
        choices=("yes", "no"),
        default="yes",
        help="with --context-speech: 'no' puts other speech beside a near-rhyme negative "
        "('hey noah') but never over it, so a phrase under babble is not taught to be doubted "
        "by near-rhymes under the same babble",
    )
    pre.add_argument(
        "--speech-over-stream-near-rhymes",
        choices=("yes", "no"),
        default="yes",
        help="with --context-speech: 'no' does the same for a crop of a training stream "
        "that holds a near-rhyme by the stream's transcript",
    )


def _add_pretrain_hinge_options(pre: argparse.ArgumentParser) -> None:
    """Hinges on the window's logit beside cross-entropy (tools/training/logit_margin.py)."""
    pre.add_argument(
        "--logit-margin",
        type=float,
        default=0.0,
        metavar="M",
        help="add a hinge asking each phrase window for a logit difference of at least M and "
        "each other window for at most -M (e.g. 6: score 0.9975), where cross-entropy barely "
        "pulls a phrase that scores 0.98 under a threshold of 0.99; 0 = off",
    )
    pre.add_argument(
        "--positive-margin",
        type=float,
        default=0.0,
        metavar="M",
        help="the bounded hinge: ask each phrase window scoring above 0.5 for a logit "
        "difference of at least M (6: score 0.9975), leaving negatives and buried phrases to "
        "cross-entropy; 0 = off",
    )
    pre.add_argument(
        "--logit-cap",
        type=float,
        default=0.0,
        metavar="C",
        help="penalize any window's logit difference above C (above --positive-margin; 9: "
        "score 0.99988), so the top scores stay apart in float32; 0 = off",
    )
