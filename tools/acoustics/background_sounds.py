"""Synthetic background for the device states: music-like media playback, alarm and timer
beeps, and ambient room noise. Every function draws only from the generator it is given."""

from __future__ import annotations

import numpy as np

SAMPLE_RATE = 16000


def colored_noise(rng: np.random.Generator, n: int, exponent: float) -> np.ndarray:
    """Unit-RMS noise with power spectrum ~ 1/f**exponent (0 white, 1 pink, 2 brown)."""
    spec = rng.standard_normal(n // 2 + 1) + 1j * rng.standard_normal(n // 2 + 1)
    f = np.fft.rfftfreq(n, 1.0 / SAMPLE_RATE)
    f[0] = f[1] if n > 1 else 1.0
    spec *= f ** (-exponent / 2.0)
    x = np.fft.irfft(spec, n)
    return x / (np.sqrt(np.mean(x**2)) + 1e-12)


def _envelope(n: int, attack: int, decay_s: float) -> np.ndarray:
    t = np.arange(n) / SAMPLE_RATE
    env = np.exp(-t / decay_s)
    a = min(attack, n)
    env[:a] *= np.linspace(0.0, 1.0, a)
    return env


def music_like(rng: np.random.Generator, n: int) -> np.ndarray:
    """Media playback: a chord progression of harmonic notes, a bass line and percussion."""
    out = np.zeros(n)
    tempo = rng.uniform(80, 150)
    beat = int(SAMPLE_RATE * 60.0 / tempo)
    root = rng.uniform(110.0, 220.0)
    scale = np.array([0, 2, 4, 5, 7, 9, 11, 12])
    n_harm = int(rng.integers(3, 7))
    brightness = rng.uniform(0.4, 0.8)
    t_note = np.arange(4 * beat) / SAMPLE_RATE
    for start in range(0, n, 2 * beat):
        chord = rng.choice(scale, size=3, replace=False)
        for step in chord:
            f0 = root * 2.0 ** (step / 12.0) * (2.0 if rng.random() < 0.4 else 1.0)
            note = np.zeros_like(t_note)
            for h in range(1, n_harm + 1):
                if f0 * h < 7500:
                    note += brightness ** (h - 1) * np.sin(
                        2 * np.pi * f0 * h * t_note + rng.uniform(0, 6.283)
                    )
            note *= _envelope(note.size, 160, rng.uniform(0.3, 1.2))
            seg = note[: n - start]
            out[start : start + seg.size] += 0.3 * seg
        bass = np.sin(2 * np.pi * root / 2 * t_note[: 2 * beat]) * _envelope(2 * beat, 80, 0.5)
        seg = bass[: n - start]
        out[start : start + seg.size] += 0.5 * seg
    hit_len = int(0.12 * SAMPLE_RATE)
    for start in range(0, n, beat):
        hit = rng.standard_normal(hit_len) * _envelope(hit_len, 8, rng.uniform(0.02, 0.06))
        if (start // beat) % 2 == 0:  # a kick-like low thump on the down beats
            hit += (
                2.0
                * np.sin(2 * np.pi * 60 * np.arange(hit_len) / SAMPLE_RATE)
                * _envelope(hit_len, 8, 0.08)
            )
        seg = hit[: n - start]
        out[start : start + seg.size] += 0.25 * seg
    return out / (np.sqrt(np.mean(out**2)) + 1e-12)


def alarm_tones(rng: np.random.Generator, n: int) -> np.ndarray:
    """Alarms and timers: repeated beeps, two-tone sirens or rising sweeps."""
    t = np.arange(n) / SAMPLE_RATE
    style = int(rng.integers(0, 3))
    f = rng.uniform(800.0, 3200.0)
    if style == 0:  # beep-beep-beep, pause
        period = rng.uniform(0.25, 0.6)
        duty = rng.uniform(0.3, 0.6)
        gate = ((t % period) < period * duty).astype(float)
        gate *= ((t % (period * 4)) < period * 3).astype(float)
        x = np.sin(2 * np.pi * f * t) + 0.3 * np.sign(np.sin(2 * np.pi * f * t))
    elif style == 1:  # two-tone siren
        period = rng.uniform(0.3, 0.8)
        freq = np.where((t % period) < period / 2, f, f * rng.uniform(1.2, 1.5))
        x = np.sin(2 * np.pi * np.cumsum(freq) / SAMPLE_RATE)
        gate = np.ones(n)
    else:  # rising sweep
        period = rng.uniform(0.5, 1.2)
        frac = (t % period) / period
        freq = f * (1.0 + frac)
        x = np.sin(2 * np.pi * np.cumsum(freq) / SAMPLE_RATE)
        gate = (frac < 0.85).astype(float)
    # Soft edges on the gate avoid clicks that no real buzzer makes.
    k = 40
    gate = np.convolve(gate, np.ones(k) / k, mode="same")
    out = x * gate + 1e-3 * rng.standard_normal(n)
    return out / (np.sqrt(np.mean(out**2)) + 1e-12)


def ambient_noise(rng: np.random.Generator, n: int, exponent: float) -> np.ndarray:
    """Room tone: coloured noise with a slow level wobble (fans, traffic, fridge hum)."""
    x = colored_noise(rng, n, exponent)
    hum_f = rng.choice([50.0, 60.0])
    t = np.arange(n) / SAMPLE_RATE
    x += rng.uniform(0.0, 0.5) * np.sin(2 * np.pi * hum_f * t) + rng.uniform(0.0, 0.2) * np.sin(
        2 * np.pi * 3 * hum_f * t
    )
    wobble = 1.0 + 0.3 * np.sin(2 * np.pi * rng.uniform(0.05, 0.5) * t + rng.uniform(0, 6.283))
    x *= wobble
    return x / (np.sqrt(np.mean(x**2)) + 1e-12)


def background_for_state(rng: np.random.Generator, state: str, n: int) -> np.ndarray | None:
    """Unit-RMS background of a device state; None for the normal state (room tone only)."""
    if state == "playback":
        return music_like(rng, n)
    if state == "alarm":
        return alarm_tones(rng, n)
    if state == "normal":
        return None
    raise ValueError(f"unknown state {state!r}")
