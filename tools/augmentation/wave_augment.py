"""On-the-fly augmentation of 1.5 s training windows for pretraining: each draw changes the
speaker's tempo and pitch, the room, the background, the level and the timing, so the
model hears a different recording of every clip in every epoch.

Pure numpy and deterministic for a given generator; the wake phrase always stays whole
inside the window (positives are shifted and slowed less than negatives)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from scipy.signal import fftconvolve

from wakefl.tools.acoustics.background_sounds import alarm_tones, colored_noise, music_like
from wakefl.tools.acoustics.field_acoustics import active_rms
from wakefl.tools.acoustics.room_impulse import exponential_rir

SAMPLE_RATE = 16000


@dataclass(frozen=True)
class AugmentSettings:
    """Probabilities and ranges of each augmentation (defaults used for the shipped models)."""

    speed_prob: float = 0.5
    speed_pos: tuple[float, float] = (0.97, 1.15)  # slower would push a long phrase out
    speed_neg: tuple[float, float] = (0.85, 1.15)
    shift_pos_s: float = 0.08
    shift_neg_s: float = 0.5
    rir_prob: float = 0.3
    rt60_s: tuple[float, float] = (0.15, 0.9)
    drr_db: tuple[float, float] = (-3.0, 12.0)
    background_prob: float = 0.5
    snr_db: tuple[float, float] = (3.0, 30.0)
    # What `snr_db` is measured against: "window", the whole window's RMS (the shipped
    # models' training), or "active", the foreground's active speech (field_acoustics.
    # active_rms), as the held-out conditions set theirs: a phrase's pauses dilute the
    # window's level, so the same number is a kinder ratio over the window.
    snr_reference: str = "window"
    gain_db: tuple[float, float] = (-24.0, 10.0)
    silence_neg_prob: float = 0.02  # near-silent windows: a quiet room must not fire


DEFAULT_AUGMENT = AugmentSettings()
NOISE_SNR_TOP_DB = 30.0  # the top of the background's ratio, either reference


def low_snr_augment(floor_db: float) -> AugmentSettings:
    """The default augmentation with its background drawn from [floor_db, 30] dB of the
    foreground's active speech (`--noise-snr-floor`)."""
    return replace(DEFAULT_AUGMENT, snr_db=(floor_db, NOISE_SNR_TOP_DB), snr_reference="active")


def change_speed(x: np.ndarray, factor: float) -> np.ndarray:
    """Play `x` `factor` times faster (tempo and pitch together, like a tape)."""
    n_out = max(1, int(round(x.size / factor)))
    return np.interp(np.arange(n_out) * factor, np.arange(x.size), x).astype(np.float32)


def fit_window(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Centre-crop or pad `x` to `n` samples; padding repeats the clip's own edges reversed
    (its background), never digital silence."""
    if x.size >= n:
        start = (x.size - n) // 2
        return x[start : start + n]
    pad = n - x.size
    left = pad // 2
    right = pad - left
    lpad = np.resize(x[: max(1, min(x.size, 400))][::-1], left)
    rpad = np.resize(x[-max(1, min(x.size, 400)) :][::-1], right)
    return np.concatenate([lpad, x, rpad]).astype(np.float32)


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)) + 1e-12))


@dataclass(frozen=True)
class AugmentBank:
    """Backgrounds and room impulse responses made once: rendering music takes ~60 ms a
    window, far more than a training step can spare, so each draw cuts a random stretch from
    a few minutes of pre-rendered sound instead."""

    backgrounds: tuple[np.ndarray, ...]
    rirs: tuple[np.ndarray, ...]

    @classmethod
    def make(
        cls,
        seed: int,
        settings: AugmentSettings = DEFAULT_AUGMENT,
        n_each: int = 24,
        seconds: float = 6.0,
    ) -> AugmentBank:
        rng = np.random.default_rng([seed, 4242])
        n = int(seconds * SAMPLE_RATE)
        bg = [music_like(rng, n) for _ in range(n_each)]
        bg += [alarm_tones(rng, n) for _ in range(n_each // 2)]
        bg += [colored_noise(rng, n, float(rng.uniform(0.0, 2.0))) for _ in range(n_each)]
        rirs = [
            exponential_rir(
                rng, float(rng.uniform(*settings.rt60_s)), float(rng.uniform(*settings.drr_db))
            )
            for _ in range(4 * n_each)
        ]
        return cls(
            tuple((x / _rms(x)).astype(np.float32) for x in bg),
            tuple(r.astype(np.float32) for r in rirs),
        )

    def background(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """A unit-RMS stretch of music-like, alarm-like or coloured noise (white to brown)."""
        x = self.backgrounds[int(rng.integers(len(self.backgrounds)))]
        start = int(rng.integers(0, x.size - n + 1))
        y = x[start : start + n]
        return y / np.float32(_rms(y))

    def rir(self, rng: np.random.Generator) -> np.ndarray:
        return self.rirs[int(rng.integers(len(self.rirs)))]


def augment_window(
    x: np.ndarray,
    label: int,
    rng: np.random.Generator,
    bank: AugmentBank,
    settings: AugmentSettings = DEFAULT_AUGMENT,
) -> np.ndarray:
    """One augmented copy of window `x` (float32, any RMS), the same length."""
    n = x.size
    s = settings
    y: np.ndarray = x.astype(np.float32, copy=True)
    if label == 0 and rng.random() < s.silence_neg_prob:
        return (
            colored_noise(rng, n, float(rng.uniform(0.0, 2.0))) * 10 ** rng.uniform(-5, -3)
        ).astype(np.float32)
    if rng.random() < s.speed_prob:
        y = fit_window(
            change_speed(y, float(rng.uniform(*(s.speed_pos if label else s.speed_neg)))), n, rng
        )
    shift_max = int((s.shift_pos_s if label else s.shift_neg_s) * SAMPLE_RATE)
    y = np.roll(y, int(rng.integers(-shift_max, shift_max + 1)))
    if rng.random() < s.rir_prob:
        wet = fftconvolve(y, bank.rir(rng))[:n].astype(np.float32)
        y = wet * np.float32(_rms(y) / _rms(wet))
    if rng.random() < s.background_prob:
        snr = float(rng.uniform(*s.snr_db))
        level = active_rms(y) if s.snr_reference == "active" else _rms(y)
        y = y + bank.background(rng, n) * np.float32(level / 10 ** (snr / 20))
    # Level changes scale around the clip's own level; hot gains clip like a real converter.
    y = y * np.float32(10 ** (rng.uniform(*s.gain_db) / 20))
    return np.clip(y, -1.0, 1.0).astype(np.float32)
