"""The five synthetic device types A-E and the acoustic chain of one device: room
(reverberation, distance), device state background, microphone frequency response,
gain and clipping, sensor noise."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.signal import butter, fftconvolve, sosfilt

SAMPLE_RATE = 16000


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    train_weight: float  # relative amount of training data in the fleet
    highpass_hz: float
    lowpass_hz: float
    peak_hz: float  # microphone/enclosure resonance
    peak_db: float
    peak_q: float
    rt60_s: tuple[float, float]
    drr_db: tuple[float, float]  # direct-to-reverberant ratio: distance to the talker
    gain_db: tuple[float, float]  # input gain after the microphone (AGC-less front end)
    clip_level: float  # the converter's full scale relative to 1.0
    noise_floor_db: float  # ambient room tone relative to speech, dB
    ambient_exponent: float  # room tone colour: 1 pink, 2 brown
    state_probs: tuple[float, float, float]  # normal, playback, alarm
    snr_db: dict[str, tuple[float, float]]  # speech-to-background per state


DEVICE_PROFILES: dict[str, DeviceProfile] = {
    "A": DeviceProfile(
        "A",
        "far-field smart speaker in a living room: flat wideband microphone, reverberant, "
        "often playing media itself",
        4.0,
        60.0,
        7600.0,
        1000.0,
        0.0,
        1.0,
        (0.35, 0.7),
        (-3.0, 6.0),
        (0.0, 6.0),
        1.0,
        -38.0,
        1.0,
        (0.45, 0.4, 0.15),
        {"playback": (0.0, 12.0), "alarm": (5.0, 15.0)},
    ),  # fmt: skip
    "B": DeviceProfile(
        "B",
        "hand-held phone, close talk: high-pass, presence peak, hot gain that clips",
        2.5,
        180.0,
        7800.0,
        3000.0,
        7.0,
        1.2,
        (0.1, 0.3),
        (10.0, 20.0),
        (10.0, 16.0),
        0.6,
        -45.0,
        1.0,
        (0.6, 0.25, 0.15),
        {"playback": (5.0, 15.0), "alarm": (8.0, 18.0)},
    ),  # fmt: skip
    "C": DeviceProfile(
        "C",
        "TV soundbar across the room: mid-band microphone, reverberant, mostly TV playback",
        2.0,
        120.0,
        5500.0,
        1200.0,
        6.0,
        0.7,
        (0.4, 0.8),
        (-2.0, 8.0),
        (0.0, 6.0),
        0.9,
        -36.0,
        1.5,
        (0.3, 0.55, 0.15),
        {"playback": (-3.0, 8.0), "alarm": (5.0, 15.0)},
    ),  # fmt: skip
    "D": DeviceProfile(
        "D",
        "earbud/wearable over a narrowband link: 300-3400 Hz, dry, close to the mouth",
        1.5,
        300.0,
        3400.0,
        2000.0,
        4.0,
        1.0,
        (0.05, 0.12),
        (18.0, 28.0),
        (-6.0, 0.0),
        1.0,
        -42.0,
        1.0,
        (0.7, 0.2, 0.1),
        {"playback": (8.0, 18.0), "alarm": (10.0, 20.0)},
    ),  # fmt: skip
    "E": DeviceProfile(
        "E",
        "low-cost kitchen appliance: cheap MEMS microphone with a strong resonance, far, "
        "tiled reverberant room, loud fans, alarms and timers, converter clips early",
        1.0,
        400.0,
        5000.0,
        4500.0,
        11.0,
        2.0,
        (0.6, 1.0),
        (-6.0, 2.0),
        (4.0, 10.0),
        0.5,
        -28.0,
        2.0,
        (0.45, 0.15, 0.4),
        {"playback": (0.0, 10.0), "alarm": (0.0, 10.0)},
    ),  # fmt: skip
}


def _peaking_sos(f0: float, gain_db: float, q: float) -> np.ndarray:
    """RBJ peaking equaliser as one second-order section."""
    a = 10.0 ** (gain_db / 40.0)
    w0 = 2 * np.pi * f0 / SAMPLE_RATE
    alpha = np.sin(w0) / (2 * q)
    b = np.array([1 + alpha * a, -2 * np.cos(w0), 1 - alpha * a])
    den = np.array([1 + alpha / a, -2 * np.cos(w0), 1 - alpha / a])
    return np.concatenate([b / den[0], den / den[0]])[None, :]


def microphone_sos(profile: DeviceProfile) -> np.ndarray:
    """The device's frequency response: band-pass plus an optional resonance."""
    parts = [
        butter(2, profile.highpass_hz, btype="highpass", fs=SAMPLE_RATE, output="sos"),
        butter(4, profile.lowpass_hz, btype="lowpass", fs=SAMPLE_RATE, output="sos"),
    ]
    if profile.peak_db != 0.0:
        parts.append(_peaking_sos(profile.peak_hz, profile.peak_db, profile.peak_q))
    return np.concatenate(parts, axis=0)


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.asarray(x, dtype=np.float64) ** 2)))


def reverberate(dry: np.ndarray, rir: np.ndarray) -> np.ndarray:
    """Convolve with a room response; the output keeps the input's length and alignment."""
    return fftconvolve(dry, rir)[: dry.size]


def scale_to(x: np.ndarray, level_db: float) -> np.ndarray:
    """`x` scaled to an RMS of `level_db` dBFS (silence stays silence)."""
    r = rms(x)
    return x * (10.0 ** (level_db / 20.0) / r) if r > 0 else x


def capture(rng: np.random.Generator, profile: DeviceProfile, acoustic: np.ndarray) -> np.ndarray:
    """What the device records of the sound field at its microphone: the microphone's
    frequency response, the front-end gain, converter clipping and self-noise."""
    out = sosfilt(microphone_sos(profile), acoustic)
    out *= 10.0 ** (rng.uniform(*profile.gain_db) / 20.0)
    out = np.clip(out, -profile.clip_level, profile.clip_level)
    out += rng.standard_normal(out.size) * 10.0 ** (-70.0 / 20.0)  # converter self-noise
    return np.clip(out, -1.0, 1.0)
