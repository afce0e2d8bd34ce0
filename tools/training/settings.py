"""Pretraining's settings and schedule: `PretrainSettings` (every knob of a run, each
explained where it is declared), the settings `wakefl model pretrain`'s flags ask for
(checked), the learning-rate schedule and the names of the files a run folder holds."""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass

from wakefl.errors import ConfigError
from wakefl.models.kws_cnn.config import V1_CHOICES, ModelConfig
from wakefl.tools.acoustics.field_acoustics import FieldAugmentSettings
from wakefl.tools.augmentation.time_warp import MAX_WARP
from wakefl.tools.augmentation.wave_augment import (
    DEFAULT_AUGMENT,
    NOISE_SNR_TOP_DB,
    AugmentSettings,
    low_snr_augment,
)
from wakefl.tools.training.logit_margin import MAX_MARGIN

STATE_WEIGHTS = "state.safetensors"
STATE_INFO = "state.json"
BEST = "best.safetensors"
LAST = "last.safetensors"  # the latest checkpoint's weights as a model file
BEST_CARD = "best.card.json"
HISTORY = "history.jsonl"
# Relative spread of the noise that lets the copies made by widening a narrower --init-from
# model diverge: small enough to keep its accuracy, large enough to break the symmetry.
WIDEN_NOISE = 0.02
# What `balance_by` may group training clips by.
BALANCE_KEYS = ("device_type", "engine")
# Below -20 dB of active speech the phrase is gone: a window labelled positive would lie.
NOISE_SNR_FLOOR_RANGE = (-20.0, NOISE_SNR_TOP_DB)


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
    # from [1 - mel_warp, 1 + mel_warp] (tools/augmentation/mel_warp.py); 0 = off.
    mel_warp: float = 0.0
    # Each example's time axis split at a random anchor that moves, so one side is stretched
    # and the other compressed; the side nearer the edge by a factor in [1 - time_warp,
    # 1 + time_warp] (tools/augmentation/time_warp.py); 0 = off.
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
    # A hinge on the window's logit beside cross-entropy (tools/training/logit_margin.py):
    # positives asked for a logit difference of at least this, negatives at most its
    # negative; 0 = off.
    logit_margin: float = 0.0
    # The bounded hinge (logit_margin.positive_margin_loss): phrases scoring above 0.5 asked
    # for a logit difference of at least `positive_margin`, every window's held under
    # `logit_cap`; 0 = off.
    positive_margin: float = 0.0
    logit_cap: float = 0.0
    # Share of the training windows also passed through the second acoustic simulation's
    # training stages (tools/acoustics/field_acoustics.py field_augment: image-source rooms apart from
    # the held-out ones, noise suppression, AGC, clipping, a narrowband link, a coarse
    # converter); 0 = off.
    field_augment: float = 0.0
    # Share of the training windows with other people talking under them (babble or one
    # voice, at -3 to 15 dB SNR, cut from the training negatives:
    # tools/augmentation/speech_backgrounds.py); 0 = off.
    speech_backgrounds: float = 0.0
    # Share of the training windows, positives and negatives alike, with speech beside or
    # under their foreground (tools/augmentation/context_speech.py): the same speaker going
    # on in one breath, or other talkers and babble outside the foreground or over it, at
    # an active-speech ratio whose floor comes down from 5 to -5 dB over the first half of
    # the run; 0 = off.
    context_speech: float = 0.0
    # The field stages' probabilities: "default" (FieldAugmentSettings()) or "context":
    # AGC in half of the windows it touches and noise suppression in a quarter, the
    # narrowband link, clipping and coarse converters rarely (they cost CPU and the held-out
    # figures barely move with them).
    field_preset: str = "default"
    # The background stage's (wave_augment.py) lowest ratio in dB of the foreground's active
    # speech, drawn up to 30 dB; None: the shipped models' 3-30 dB over the whole window.
    noise_snr_floor: float | None = None
    # What the context-speech and speech-background stages cut other people's speech and a
    # speaker's next words from: "negatives" (every training negative, near-rhymes of the
    # phrase among them) or "everyday" (everyday speech only; data.narrow_to_speech_source).
    speech_source: str = "negatives"
    # False: the context-speech stage puts no speech over a near-rhyme negative (beside it
    # instead). Under babble at 0-5 dB "hey noah" and "hey nova" sound alike, so a model
    # taught that a near-rhyme under babble is not the phrase learns to doubt every phrase
    # under babble, where a real room holds far fewer near-rhymes than phrases.
    speech_over_near_rhymes: bool = True
    # False: the same for a training-stream crop that holds most of a near-rhyme by its
    # stream's transcript (data.holds_near_rhyme): the streams' speakers say near-rhymes
    # as often as other sentences, and a quarter of the windows are stream crops.
    speech_over_stream_near_rhymes: bool = True
    # The model: "v1" (every shipped model) or "v2" (ModelConfig.context_robust), with
    # optional overrides of its choices, e.g. "v2,gain_norm=none" (an ablation).
    arch: str = "v1"
    # With `gain_norm=log_agc` in `arch`: its gain_alpha rises from 0 (the log-mel itself,
    # what an --init-from model was trained on) to the arch's value over this many training
    # samples, so trained weights follow the change of input instead of meeting all of it
    # at once; 0 = the arch's value from the first step.
    gain_ramp_samples: int = 0
    # A folder of rendered windows (tools/training/window_cache.py) to train over instead
    # of augmenting each batch anew; the first run that names it renders `cache_windows`.
    window_cache: str = ""
    cache_windows: int = 0
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

    def field_settings(self) -> FieldAugmentSettings:
        return FIELD_PRESETS[self.field_preset]

    def augment_settings(self) -> AugmentSettings:
        if self.noise_snr_floor is None:
            return DEFAULT_AUGMENT
        return low_snr_augment(self.noise_snr_floor)

    def model_config(self) -> ModelConfig:
        """The run's model configuration, from `arch` and `width`."""
        return model_config(self.arch, self.width)


FIELD_PRESETS = {
    "default": FieldAugmentSettings(),
    "context": FieldAugmentSettings(
        agc_prob=0.5, suppress_prob=0.25, link_prob=0.05, clip_prob=0.05, bits_prob=0.03
    ),
}


# Cached: a frozen result of a pure parse, which a ramped run asks for at every step.
@functools.lru_cache(maxsize=16)
def model_config(arch: str, width: float) -> ModelConfig:
    """ "v1", "v2" or "v2,KEY=VALUE,..." (norm, time_pool, gain_norm, first_time_pool,
    gain_alpha) as a ModelConfig of `width`; ConfigError for anything else."""
    name, *overrides = [part.strip() for part in arch.split(",")]
    if name not in ("v1", "v2") or (name == "v1" and overrides):
        raise ConfigError(f"--arch must be v1, v2 or v2,KEY=VALUE,..., got {arch!r}")
    if name == "v1":
        return ModelConfig(width=width)
    choices: dict[str, object] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in V1_CHOICES or not value:
            raise ConfigError(f"--arch: {item!r} is not KEY=VALUE with KEY in {sorted(V1_CHOICES)}")
        choices[key] = _choice_value(key, value)
    return ModelConfig.context_robust(width=width, **choices)


def _choice_value(key: str, value: str) -> object:
    if key == "first_time_pool" and value.isdigit():
        return int(value)
    if key == "gain_alpha":
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"--arch: gain_alpha must be a number, got {value!r}") from None
    return value


def gain_alpha_at(step: int, s: PretrainSettings, target: float) -> float:
    """The log_agc model's gain_alpha at `step`: rising linearly from 0 to `target` over the
    first `gain_ramp_samples` samples, then `target`."""
    if s.gain_ramp_samples <= 0:
        return target
    return target * min(1.0, (step + 1) * s.batch_size / s.gain_ramp_samples)


def lr_at(step: int, s: PretrainSettings) -> float:
    """Linear warm-up, then a cosine from `lr` down to 5% of it at the last step."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    frac = min(1.0, (step - s.warmup_steps) / max(1, s.total_steps - s.warmup_steps))
    return s.lr * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def continued_lr_at(step: int, s: PretrainSettings, continued_at: int | None) -> float:
    """The schedule's learning rate, warmed up again over `warmup_steps` from the step a run
    was continued at (`--start-step`): its optimizer moments start from zero there, and
    Adam's first steps on fresh moments move every weight by about the full rate."""
    if continued_at is None:
        return lr_at(step, s)
    return lr_at(step, s) * min(1.0, (step - continued_at + 1) / max(1, s.warmup_steps))


def distillation_in_range(weight: float, temperature: float) -> bool:
    """Whether a teacher's share of the loss is in (0, 1] and its temperature in (0, 100]
    (False for NaN)."""
    return 0.0 < weight <= 1.0 and 0.0 < temperature <= 100.0


def distillation_from_flags(args: argparse.Namespace) -> tuple[str, float, float]:
    """The teacher's file, weight and temperature from the flags, checked. A weight or
    temperature without a teacher is refused: a run that silently trained without the
    distillation its command asked for would cost hours."""
    if args.distill_from is None:
        for flag, value in (
            ("weight", args.distill_weight),
            ("temperature", args.distill_temperature),
        ):
            if value is not None:
                raise ConfigError(f"--distill-{flag} only applies with --distill-from")
        off = PretrainSettings  # its defaults: no teacher
        return off.distill_from, off.distill_weight, off.distill_temperature
    if not args.distill_from.is_file():
        raise ConfigError(f"--distill-from {args.distill_from}: no such weights file")
    # The settings' own weight is 0 (off); a named teacher gets half of the loss.
    weight = 0.5 if args.distill_weight is None else args.distill_weight
    temperature = args.distill_temperature
    if temperature is None:
        temperature = PretrainSettings.distill_temperature
    if not distillation_in_range(weight, temperature):
        raise ConfigError(
            "--distill-weight must be in (0, 1] and --distill-temperature in (0, 100], got "
            f"{weight} and {temperature}"
        )
    return str(args.distill_from), weight, temperature


def _check_augmentation(args: argparse.Namespace) -> None:
    """The warps, the mined share and the augmentation shares, each within its range (NaN
    is out of every range)."""
    if not 0.0 <= args.mel_warp < 0.5:
        raise ConfigError(f"--mel-warp must be in [0, 0.5), got {args.mel_warp}")
    if not 0.0 <= args.time_warp < MAX_WARP:
        raise ConfigError(f"--time-warp must be in [0, {MAX_WARP}), got {args.time_warp}")
    if not 0.0 <= args.hard_negatives <= 1.0 or args.mine_every < 1:
        raise ConfigError("--hard-negatives must be in [0, 1] and --mine-every at least 1")
    for flag, share in (
        ("--field-augment", args.field_augment),
        ("--speech-backgrounds", args.speech_backgrounds),
        ("--context-speech", args.context_speech),
    ):
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"{flag} must be in [0, 1], got {share}")
    if not 0.0 <= args.logit_margin <= MAX_MARGIN:
        raise ConfigError(f"--logit-margin must be in [0, {MAX_MARGIN:g}], got {args.logit_margin}")
    _check_positive_margin(args.positive_margin, args.logit_cap)
    for flag in ("speech_over_near_rhymes", "speech_over_stream_near_rhymes"):
        if getattr(args, flag) == "no" and args.context_speech == 0:
            name = "--" + flag.replace("_", "-")
            raise ConfigError(f"{name} no applies to --context-speech windows; set it")
    floor = args.noise_snr_floor
    if floor is not None and not NOISE_SNR_FLOOR_RANGE[0] <= floor < NOISE_SNR_TOP_DB:
        raise ConfigError(
            f"--noise-snr-floor must be in [{NOISE_SNR_FLOOR_RANGE[0]:g}, "
            f"{NOISE_SNR_TOP_DB:g}) dB, got {floor}"
        )


def _check_positive_margin(margin: float, cap: float) -> None:
    if not 0.0 <= margin <= MAX_MARGIN:
        raise ConfigError(f"--positive-margin must be in [0, {MAX_MARGIN:g}], got {margin}")
    if not (cap == 0.0 or margin < cap <= MAX_MARGIN):
        raise ConfigError(
            f"--logit-cap must be 0 (off) or in ({margin:g}, {MAX_MARGIN:g}] "
            f"(above --positive-margin), got {cap}"
        )


def _check_corpora(args: argparse.Namespace) -> None:
    for extra in args.extra_corpus:
        if not extra.is_file():
            raise ConfigError(f"--extra-corpus {extra}: no such manifest")
    if args.val_corpus is not None and not args.val_corpus.is_file():
        raise ConfigError(f"--val-corpus {args.val_corpus}: no such manifest")


def settings_from_flags(args: argparse.Namespace) -> PretrainSettings:
    """The run's PretrainSettings from `wakefl model pretrain`'s flags, checked."""
    if args.samples < args.batch_size:
        raise ConfigError("--samples must be at least one batch")
    _check_augmentation(args)
    _check_corpora(args)
    teacher, distill_weight, distill_temperature = distillation_from_flags(args)
    arch = model_config(args.arch, args.width)  # refused here, before any data is decoded
    if args.gain_ramp_samples != 0 and (arch.gain_norm != "log_agc" or args.gain_ramp_samples < 0):
        raise ConfigError("--gain-ramp-samples needs --arch v2,gain_norm=log_agc,... and N >= 0")
    if args.window_cache is not None and args.cache_windows < 1:
        raise ConfigError("--window-cache needs --cache-windows N >= 1")
    if not 0 <= args.workers <= 64:
        raise ConfigError(f"--workers must be in [0, 64], got {args.workers}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available here")
    return PretrainSettings(
        width=args.width,
        phrase=" ".join(args.phrase.lower().split()),
        seed=args.seed,
        batch_size=args.batch_size,
        samples=args.samples,
        lr=args.lr,
        threads=args.threads,
        device=args.device,
        workers=args.workers,
        eval_every_steps=args.eval_every,
        val_stream_seconds=args.val_stream_seconds,
        checkpoint_minutes=args.checkpoint_minutes,
        mel_warp=args.mel_warp,
        time_warp=args.time_warp,
        hard_negative_share=args.hard_negatives,
        balance_by=(args.balance_by or "").replace("-", "_"),
        distill_from=teacher,
        distill_weight=distill_weight,
        distill_temperature=distill_temperature,
        mine_every_steps=args.mine_every,
        field_augment=args.field_augment,
        speech_backgrounds=args.speech_backgrounds,
        context_speech=args.context_speech,
        field_preset=args.field_preset,
        noise_snr_floor=args.noise_snr_floor,
        logit_margin=args.logit_margin,
        positive_margin=args.positive_margin,
        logit_cap=args.logit_cap,
        speech_source=args.speech_source,
        speech_over_near_rhymes=args.speech_over_near_rhymes == "yes",
        speech_over_stream_near_rhymes=args.speech_over_stream_near_rhymes == "yes",
        arch=args.arch,
        gain_ramp_samples=args.gain_ramp_samples,
        window_cache=str(args.window_cache) if args.window_cache is not None else "",
        cache_windows=args.cache_windows,
        val_corpus=str(args.val_corpus.resolve()) if args.val_corpus is not None else "",
    )
