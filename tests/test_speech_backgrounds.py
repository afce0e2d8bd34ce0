"""Speech backgrounds for training (tools/augmentation/speech_backgrounds.py): made from the
negatives they are given and nothing else, deterministic per seed, and mixed at the SNR
drawn."""

from __future__ import annotations

import numpy as np
import pytest

from wakefl.tools.augmentation.speech_backgrounds import SNR_DB, SpeechBackgrounds


def _tones(freqs: list[float], n: int = 24000) -> np.ndarray:
    t = np.arange(n) / 16000
    return np.stack([0.1 * np.sin(2 * np.pi * f * t) for f in freqs]).astype(np.float32)


def _spectrum_peaks(x: np.ndarray, k: int) -> set[int]:
    spec = np.abs(np.fft.rfft(x))
    hz = np.fft.rfftfreq(x.size, 1 / 16000)
    return {int(round(hz[i] / 100.0)) * 100 for i in np.argsort(spec)[-k:]}


def test_backgrounds_are_cut_from_the_negatives_given() -> None:
    neg = _tones([300.0, 700.0, 1100.0])
    bg = SpeechBackgrounds.make(neg, seed=0, n_each=3, seconds=2.0)
    assert len(bg.talkers) == 3 and len(bg.babble) == 3
    for x in (*bg.talkers, *bg.babble):
        assert x.shape == (32000,) and x.dtype == np.float32
        assert np.sqrt(np.mean(x.astype(np.float64) ** 2)) == pytest.approx(1.0, rel=1e-3)
        # only the negatives' tones are in it (a wake phrase could never be)
        assert _spectrum_peaks(x, 3) <= {300, 700, 1100}
    again = SpeechBackgrounds.make(neg, seed=0, n_each=3, seconds=2.0)
    other = SpeechBackgrounds.make(neg, seed=1, n_each=3, seconds=2.0)
    assert all(np.array_equal(a, b) for a, b in zip(bg.babble, again.babble, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(bg.babble, other.babble, strict=True))
    with pytest.raises(ValueError, match="negatives"):
        SpeechBackgrounds.make(neg[:0], seed=0)


def test_mixing_puts_the_background_at_the_snr_drawn() -> None:
    bg = SpeechBackgrounds.make(_tones([500.0, 900.0]), seed=0, n_each=2, seconds=2.0)
    y = (np.random.default_rng(3).standard_normal(24000) * 0.05).astype(np.float32)
    snrs = []
    for i in range(50):
        out = bg.mix(y, np.random.default_rng(i))
        assert out.shape == y.shape and out.dtype == np.float32
        added = out.astype(np.float64) - y
        snrs.append(10 * np.log10(np.mean(y.astype(np.float64) ** 2) / np.mean(added**2)))
    assert SNR_DB[0] - 0.01 <= min(snrs) and max(snrs) <= SNR_DB[1] + 0.01
    assert max(snrs) - min(snrs) > 10  # drawn across the range, not fixed
    a = bg.mix(y, np.random.default_rng(7))
    assert np.array_equal(a, bg.mix(y, np.random.default_rng(7)))
