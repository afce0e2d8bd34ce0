"""Other people talking behind the talker: babble and a single voice (a television, a
radio, someone across the room) mixed under a training window at -3 to 15 dB SNR.

What defeats the shipped models under the second acoustic simulation is its speech
backgrounds (café babble, television) at low SNR (MODEL_CARD.md, "Held-out acoustics"),
and the training augmentation (wave_augment.py) has no speech in its backgrounds at all:
music, alarms and coloured noise only. The speech here is cut from the run's own training
negatives, so no background ever holds the wake phrase; the label stays the foreground's.

Pure numpy, deterministic for a given seed and generator; made once per run
(`SpeechBackgrounds.make`), then each draw cuts a random stretch, as `AugmentBank` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 16000
SNR_DB = (-3.0, 15.0)
BABBLE_TALKERS = (3, 7)  # voices summed into one babble stretch


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)) + 1e-12))


def _talker(neg: np.ndarray, rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` samples of one voice after another: random negative clips, each at its own
    level within 6 dB, end to end."""
    parts, have = [], 0
    while have < n:
        clip = neg[int(rng.integers(len(neg)))].astype(np.float64)
        parts.append(clip / _rms(clip) * 10 ** (rng.uniform(-6.0, 0.0) / 20))
        have += clip.size
    return np.concatenate(parts)[:n]


@dataclass(frozen=True)
class SpeechBackgrounds:
    """Unit-RMS stretches of single talkers and of babble, made from training negatives."""

    talkers: tuple[np.ndarray, ...]
    babble: tuple[np.ndarray, ...]
    babble_share: float = 0.5

    @classmethod
    def make(
        cls, neg: np.ndarray, seed: int, n_each: int = 32, seconds: float = 6.0
    ) -> SpeechBackgrounds:
        """`n_each` talker and `n_each` babble stretches of `seconds` from `neg`, the
        run's training negatives ([N, T] float audio, no wake phrase)."""
        if len(neg) == 0:
            raise ValueError("speech backgrounds need training negatives")
        rng = np.random.default_rng([seed, 4243])
        n = int(seconds * SAMPLE_RATE)
        talkers = [_talker(neg, rng, n) for _ in range(n_each)]
        babble = []
        for _ in range(n_each):
            k = int(rng.integers(BABBLE_TALKERS[0], BABBLE_TALKERS[1] + 1))
            babble.append(np.sum([_talker(neg, rng, n) for _ in range(k)], axis=0))
        unit = lambda x: (x / _rms(x)).astype(np.float32)  # noqa: E731
        return cls(tuple(map(unit, talkers)), tuple(map(unit, babble)))

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """A unit-RMS stretch of `n` samples: babble with probability `babble_share`,
        else one talker."""
        pool = self.babble if rng.random() < self.babble_share else self.talkers
        x = pool[int(rng.integers(len(pool)))]
        start = int(rng.integers(0, x.size - n + 1))
        y = x[start : start + n]
        return y / np.float32(_rms(y))

    def mix(
        self, y: np.ndarray, rng: np.random.Generator, snr_db: tuple[float, float] = SNR_DB
    ) -> np.ndarray:
        """`y` with a speech background under it at an SNR drawn from `snr_db`; the same
        length, float32, not clipped (the level and the converter come after)."""
        snr = float(rng.uniform(*snr_db))
        bg = self.draw(rng, y.size)
        return (y + bg * np.float32(_rms(y) / 10 ** (snr / 20))).astype(np.float32)
