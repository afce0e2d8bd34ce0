"""The context-speech stage: speech beside and under a training window's foreground, on
real synthesized speech. The foreground is never moved; "outside" leaves it clean; the
ratio is set on active speech; every draw is deterministic per seed."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import numpy as np
import pytest

from wakefl.edge_runtime import load_audio
from wakefl.tools.acoustics.field_acoustics import active_rms
from wakefl.tools.augmentation.context_speech import (
    ContextSpeech,
    active_span,
    around,
    continuation,
    snr_floor,
)
from wakefl.tools.augmentation.speech_backgrounds import SpeechBackgrounds
from wakefl.tools.augmentation.wave_augment import (
    DEFAULT_AUGMENT,
    AugmentBank,
    AugmentSettings,
    augment_window,
    low_snr_augment,
)

N = 24000


def espeak_wav(path, text: str):
    if shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng is not installed; run scripts/setup.sh")
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def voices(tmp_path_factory):
    """A phrase centred in a 1.5 s window, and other sentences of two voices."""
    folder = tmp_path_factory.mktemp("context")
    phrase = load_audio(espeak_wav(folder / "p.wav", "hey nova"), 16000)
    window = np.zeros(N, np.float32)
    start = (N - phrase.size) // 2
    window[start : start + phrase.size] = phrase
    others = []
    for i, text in enumerate(("turn on the lights", "what is the weather like today")):
        y = load_audio(espeak_wav(folder / f"o{i}.wav", text), 16000)
        clip = np.zeros(N, np.float32)
        clip[: min(N, y.size)] = y[:N]
        others.append(clip)
    return window, np.stack(others)


def test_the_active_span_is_where_the_foreground_speaks(voices):
    window, _ = voices
    start, end = active_span(window)
    assert 0 < start < end < N
    assert np.abs(window[:start]).max() < 0.1 * np.abs(window).max()
    assert np.abs(window[end:]).max() < 0.1 * np.abs(window).max()
    assert active_span(np.zeros(N, np.float32)) == (0, N)


@pytest.mark.parametrize("placement", ["outside", "before", "after"])
def test_speech_outside_the_phrase_leaves_the_phrase_clean(voices, placement):
    window, others = voices
    bg = SpeechBackgrounds.make(others, seed=0, n_each=2, seconds=2.0).draw(
        np.random.default_rng(0), N
    )
    out = around(window, bg, placement, snr_db=0.0)
    start, end = active_span(window)
    np.testing.assert_array_equal(out[start:end], window[start:end])
    added = out - window
    assert np.abs(added[: max(0, start - 800)]).max() > 0 if placement != "after" else True
    assert np.abs(added[end + 800 :]).max() > 0 if placement != "before" else True


def test_speech_over_the_window_sits_at_the_drawn_ratio(voices):
    window, others = voices
    bg = SpeechBackgrounds.make(others, seed=0, n_each=2, seconds=2.0).draw(
        np.random.default_rng(0), N
    )
    for snr in (-5.0, 0.0, 10.0):
        added = around(window, bg, "over", snr) - window
        start, end = active_span(window)
        ratio = 20 * np.log10(active_rms(window[start:end]) / active_rms(added))
        assert abs(ratio - snr) < 0.5


def test_background_noise_sits_at_the_drawn_ratio_of_active_speech(voices):
    """`--noise-snr-floor` sets the noise stage on the phrase's active speech, as the held-out
    conditions are set; over the whole window (the shipped models' training) the pauses
    dilute the phrase, so the same drawn ratio is kinder to it (for this phrase in
    silence, by more than 3 dB)."""
    window, _ = voices
    bank = AugmentBank.make(0, n_each=2, seconds=2.0)
    plain = dict(speed_prob=0.0, shift_pos_s=0.0, rir_prob=0.0, background_prob=1.0)
    plain["gain_db"] = (0.0, 0.0)
    for snr in (-5.0, 0.0, 10.0):
        ratios = {}
        for reference in ("active", "window"):
            s = AugmentSettings(**plain, snr_db=(snr, snr), snr_reference=reference)
            added = augment_window(window, 1, np.random.default_rng(3), bank, s) - window
            ratios[reference] = 20 * np.log10(active_rms(window) / np.sqrt(np.mean(added**2)))
        assert abs(ratios["active"] - snr) < 0.5
        assert ratios["window"] > snr + 3.0
    low = low_snr_augment(-5.0)
    assert low.snr_db == (-5.0, 30.0) and low.snr_reference == "active"
    assert dataclasses.replace(low, snr_db=DEFAULT_AUGMENT.snr_db, snr_reference="window") == (
        DEFAULT_AUGMENT
    )


def test_the_same_speaker_goes_on_without_moving_the_phrase(voices):
    window, others = voices
    out = continuation(window, others[0], np.random.default_rng(3), snr_db=0.0)
    start, end = active_span(window)
    # The phrase is there, whole and where it was; more speech sits next to it.
    np.testing.assert_allclose(out[start:end], window[start:end], atol=0.2)
    assert active_rms(out - window) > 0.01
    o_start, o_end = active_span(out)
    assert o_start < start or o_end > end


def test_the_stage_is_deterministic_per_seed_and_differs_across_seeds(voices):
    window, others = voices
    speech = SpeechBackgrounds.make(others, seed=0, n_each=2, seconds=2.0)
    stage = ContextSpeech(lambda rng: others[int(rng.integers(2))], speech.draw)
    runs = [
        [stage.apply(window, np.random.default_rng([seed, k]), -5.0) for k in range(8)]
        for seed in (1, 1, 2)
    ]
    for a, b in zip(runs[0], runs[1], strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, c) for a, c in zip(runs[0], runs[2], strict=True))
    assert all(np.isfinite(x).all() and x.shape == window.shape for x in runs[0])


def test_a_window_refusing_speech_over_it_gets_the_same_draws_outside_it(voices):
    """`over=False` (a near-rhyme negative): speech drawn to go over the window goes outside
    the foreground instead, leaving it clean; every draw is the same, so the generator ends
    where it would have and every other window of the batch is unchanged."""
    window, others = voices
    speech = SpeechBackgrounds.make(others, seed=0, n_each=2, seconds=2.0)
    stage = ContextSpeech(lambda rng: others[int(rng.integers(2))], speech.draw)
    start, end = active_span(window)
    n_over = 0
    for k in range(40):
        ra, rb = np.random.default_rng([3, k]), np.random.default_rng([3, k])
        a, b = stage.apply(window, ra, 0.0), stage.apply(window, rb, 0.0, over=False)
        assert ra.random() == rb.random()  # the same draws were made
        # Refused "over" is the one change: either the same window or a clean foreground.
        if not np.array_equal(a, b):
            n_over += 1
            np.testing.assert_array_equal(b[start:end], window[start:end])
            assert not np.array_equal(a[start:end], window[start:end])
    assert 0 < n_over < 40


def test_the_ratio_floor_comes_down_over_the_first_half_of_the_run():
    assert snr_floor(0.0) == 5.0
    assert snr_floor(0.25) == pytest.approx(0.0)
    assert snr_floor(0.5) == snr_floor(1.0) == -5.0
