"""Room impulse responses from a statistical model: a direct path, a few early reflections and
an exponentially decaying noise tail whose high frequencies die out faster (air and wall
absorption). Pure numpy, deterministic for a given generator, and nearly free to compute,
unlike ray tracing (which is not deterministic) or high-order image sources (slow)."""

from __future__ import annotations

import numpy as np
from scipy.signal import lfilter

SAMPLE_RATE = 16000
_MAX_LENGTH_S = 1.0
_BLOCK = 128


def exponential_rir(
    rng: np.random.Generator,
    rt60_s: float,
    drr_db: float,
    sample_rate: int = SAMPLE_RATE,
    n_early: int = 8,
) -> np.ndarray:
    """An impulse response with reverberation time `rt60_s` (60 dB decay) and a
    direct-to-reverberant energy ratio of `drr_db`; the direct path has amplitude 1."""
    if rt60_s <= 0:
        raise ValueError(f"rt60_s must be positive, got {rt60_s}")
    length = int(min(max(rt60_s, 0.05) * 1.1, _MAX_LENGTH_S) * sample_rate)
    direct = int(rng.integers(16, 48))  # 1-3 ms of propagation before the direct sound
    n = direct + length
    t = np.arange(length) / sample_rate
    decay = np.exp(-6.9078 * t / rt60_s)  # 60 dB = ln(1000) in amplitude
    tail = rng.standard_normal(length) * decay
    # High frequencies decay faster: smooth the tail progressively with a one-pole low-pass
    # whose coefficient grows with time.
    alpha = np.clip(0.15 + 0.75 * t / max(rt60_s, 1e-3), 0.0, 0.95)
    smoothed = np.empty_like(tail)
    state = np.zeros(1)
    for i in range(0, length, _BLOCK):  # coefficient constant per block keeps this vectorised
        a = float(alpha[i])
        smoothed[i : i + _BLOCK], state = lfilter(
            [1.0 - a], [1.0, -a], tail[i : i + _BLOCK], zi=state
        )
    tail = smoothed
    # The first few milliseconds belong to the discrete early reflections, not the tail.
    gap = int(0.004 * sample_rate)
    tail[:gap] *= np.linspace(0.0, 1.0, gap)
    rir = np.zeros(n)
    rir[direct:] = tail
    for _ in range(n_early):
        delay = direct + int(rng.uniform(0.003, 0.04) * sample_rate)
        if delay < n:
            rir[delay] += (
                rng.choice([-1.0, 1.0])
                * rng.uniform(0.2, 0.7)
                * np.exp(-6.9078 * (delay - direct) / sample_rate / rt60_s)
            )
    reverb = rir.copy()
    reverb[direct] = 0.0
    e_rev = float(np.sum(reverb**2))
    if e_rev > 0:
        reverb *= np.sqrt(10.0 ** (-drr_db / 10.0) / e_rev)
    reverb[direct] = 1.0
    return reverb.astype(np.float64)
