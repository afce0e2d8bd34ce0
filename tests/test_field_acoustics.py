"""The second acoustic simulation (tools/acoustics/field_acoustics.py): each stage does what it claims
on real synthesized speech and generated noise, and the whole chain is deterministic per
seed."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from wakefl.tools.acoustics import field_acoustics as fa

SR = 16000


def _db(x: float) -> float:
    return 20.0 * float(np.log10(max(x, 1e-20)))


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> list[np.ndarray]:
    """Three utterances of espeak-ng, the engine every corpus build needs."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (scripts/setup.sh installs it)")
    from wakefl.tools.corpus.speech_synthesis import Voice, synthesize

    cache = Path(tmp_path_factory.mktemp("tts"))
    voice = Voice("espeak-ng", "en-us", "", 160, 50)
    return [
        synthesize(voice, t, cache).astype(np.float64)
        for t in ("hey nova", "turn on the kitchen lights", "what is the weather like today")
    ]


def _band_power(x: np.ndarray, lo: float, hi: float) -> float:
    spec = np.abs(np.fft.rfft(x)) ** 2
    f = np.fft.rfftfreq(x.size, 1.0 / SR)
    return float(spec[(f >= lo) & (f < hi)].sum())


def test_image_source_rooms_follow_the_drawn_reverberation_and_distance() -> None:
    from pyroomacoustics.experimental import measure_rt60

    for seed, rt60 in ((1, (0.3, 0.35)), (2, (0.9, 1.0))):
        room = fa.image_source_room(np.random.default_rng(seed), rt60, (1.0, 5.0))
        assert room.rt60_s == pytest.approx(np.mean(rt60), abs=0.05)
        assert 0.5 <= room.distance_m <= 5.0
        assert room.speech_rir.ndim == 1 and np.max(np.abs(room.speech_rir)) == 1.0
        assert int(np.argmax(np.abs(room.speech_rir))) == 32  # the lead delay is trimmed
        measured = measure_rt60(room.speech_rir, fs=SR, decay_db=20)
        assert 0.6 * room.rt60_s <= measured <= 1.4 * room.rt60_s
        again = fa.image_source_room(np.random.default_rng(seed), rt60, (1.0, 5.0))
        assert np.array_equal(room.speech_rir, again.speech_rir)
        assert np.array_equal(room.noise_rir, again.noise_rir)


def test_the_mulaw_link_band_limits_and_codes_speech_faithfully(speech) -> None:
    x = fa.to_level(speech[1], -20.0)
    y = fa.mulaw_link(x, np.random.default_rng(0), loss=0.0)
    assert y.shape == x.shape
    assert _band_power(y, 4400, 8000) < 1e-3 * _band_power(y, 100, 3800)
    assert _band_power(x, 4100, 8000) > 1e-2 * _band_power(x, 100, 3800)  # the input had highs
    # Below 3.4 kHz the coded speech follows the input (mu-law: about 38 dB SNR).
    from scipy.signal import butter, sosfiltfilt

    sos = butter(8, 3400, fs=SR, output="sos")
    ref, got = sosfiltfilt(sos, x), sosfiltfilt(sos, y)
    assert _db(fa._rms(ref) / fa._rms(ref - got)) > 25.0
    codes = fa.mulaw_encode(np.linspace(-1, 1, 1001))
    assert codes.min() == -128 and codes.max() == 127
    assert np.all(np.diff(codes) >= 0)


def test_packets_are_lost_at_the_asked_rate_in_runs_and_concealed() -> None:
    lost = fa.lost_packets(np.random.default_rng(3), 40000, loss=0.1, burst=0.4)
    assert lost.mean() == pytest.approx(0.1, abs=0.01)
    after_loss = lost[1:][lost[:-1]]
    assert after_loss.mean() == pytest.approx(0.4, abs=0.03)
    x = np.random.default_rng(4).standard_normal(8 * 160)
    mask = np.array([False, True, True, False, False, True, False, False])
    zeroed = fa.conceal(x, mask, 160, repeat=False)
    repeated = fa.conceal(x, mask, 160, repeat=True)
    for i, gone in enumerate(mask):
        seg = slice(i * 160, (i + 1) * 160)
        if not gone:
            assert np.array_equal(zeroed[seg], x[seg]) and np.array_equal(repeated[seg], x[seg])
        else:
            assert not zeroed[seg].any()
    assert np.allclose(repeated[160:320], 0.5 * x[:160])
    assert np.allclose(repeated[320:480], 0.25 * x[:160])
    assert np.allclose(repeated[800:960], 0.5 * x[640:800])
    with pytest.raises(ValueError, match="loss"):
        fa.lost_packets(np.random.default_rng(0), 10, 1.0, 0.2)


def test_a_lossy_link_silences_packets_that_a_clean_one_keeps(speech) -> None:
    x = fa.to_level(np.tile(speech[1], 3), -20.0)
    clean = fa.mulaw_link(x, np.random.default_rng(5), loss=0.0)
    lossy = fa.mulaw_link(x, np.random.default_rng(5), loss=0.3, burst=0.3, repeat=False)
    frames = lambda y: np.sqrt(np.mean(y[: y.size // 320 * 320].reshape(-1, 320) ** 2, 1))  # noqa: E731
    speaking = frames(clean) > 1e-3
    dropped = frames(lossy)[speaking] < 0.05 * frames(clean)[speaking]
    assert 0.15 < dropped.mean() < 0.45


def test_agc_brings_quiet_and_loud_speech_into_range_and_leaves_silence_quiet(speech) -> None:
    x = np.concatenate(speech)
    for level in (-55.0, -35.0, -8.0):
        y = fa.agc(fa.to_level(x, level, active=True), target_db=-20.0)
        assert -26.0 <= _db(fa.active_rms(y)) <= -14.0, level
        assert np.max(np.abs(y)) <= 0.95
    hiss = 10 ** (-85 / 20) * np.random.default_rng(0).standard_normal(SR)
    assert _db(fa._rms(fa.agc(hiss))) < -50.0


def test_spectral_gating_lowers_steady_noise_more_than_speech(speech) -> None:
    rng = np.random.default_rng(6)
    talk = np.concatenate([np.zeros(2 * SR), speech[2], np.zeros(SR)])
    talk = fa.to_level(talk, -20.0, active=True)
    fan = fa.to_level(fa.fan_noise(rng, talk.size), -30.0)
    out = fa.spectral_gate(talk + fan, max_reduction_db=18.0)
    assert out.shape == talk.shape
    quiet = slice(SR // 2, 2 * SR - SR // 4)  # noise only, after the floor has settled
    noise_drop = _db(fa._rms((talk + fan)[quiet]) / fa._rms(out[quiet]))
    active = np.abs(talk) > 0
    speech_drop = _db(fa._rms((talk + fan)[active]) / fa._rms(out[active]))
    assert noise_drop > 8.0
    assert speech_drop < 3.0


def test_clipping_and_bit_depth() -> None:
    x = 0.8 * np.sin(2 * np.pi * 440 * np.arange(SR) / SR)
    assert np.max(np.abs(fa.hard_clip(x, 0.3))) == 0.3
    q = fa.quantize(x, 12)
    assert len(np.unique(q)) <= 4096
    assert np.allclose(q * 2048, np.round(q * 2048))
    assert np.max(np.abs(q - x)) <= 0.5 / 2048 + 1e-12
    with pytest.raises(ValueError, match="bits"):
        fa.quantize(x, 1)


def test_backgrounds_are_unit_level_and_babble_holds_several_talkers(speech) -> None:
    n = 3 * SR
    for kind in fa.NOISE_KINDS:
        a = fa.background(np.random.default_rng(7), kind, n, speech)
        b = fa.background(np.random.default_rng(7), kind, n, speech)
        assert a.shape == (n,) and np.isfinite(a).all()
        assert fa._rms(a) == pytest.approx(1.0, rel=1e-6)
        assert np.array_equal(a, b)
    # Babble of several talkers fills the pauses that one talker leaves.
    one = fa._talker(np.random.default_rng(8), n, speech)
    many = fa.babble(np.random.default_rng(8), n, speech, talkers=(6, 6))
    frames = lambda y: np.sqrt(np.mean(y.reshape(-1, 320) ** 2, 1))  # noqa: E731
    gaps = lambda y: np.mean(frames(y) < 0.05 * frames(y).max())  # noqa: E731
    assert gaps(many) < gaps(one)
    beep = fa.beeper(np.random.default_rng(9), n)
    assert _band_power(beep, 1500, 8000) > 0.8 * _band_power(beep, 0, 8000)
    with pytest.raises(ValueError, match="utterances"):
        fa.background(np.random.default_rng(0), "babble", n, [])
    with pytest.raises(ValueError, match="unknown"):
        fa.background(np.random.default_rng(0), "rain", n, speech)


def _capture(device: fa.FieldDevice, room: fa.ImageSourceRoom, seed: int, speech, kind: str):
    rng = np.random.default_rng(seed)
    dry = np.zeros(24000)
    dry[3000 : 3000 + speech[0].size] = speech[0]
    return fa.field_capture(rng, device, room, dry, fa.background(rng, kind, 24000, speech))


@pytest.mark.slow
def test_every_field_device_records_a_window_deterministically(speech) -> None:
    assert sorted(fa.FIELD_DEVICES) == ["A", "B", "C", "D", "E"]
    for name, dev in fa.FIELD_DEVICES.items():
        room = fa.image_source_room(np.random.default_rng(10), dev.rt60_s, dev.distance_m)
        y = _capture(dev, room, 11, speech, "babble")
        assert y.shape == (24000,) and np.isfinite(y).all() and np.max(np.abs(y)) <= 1.0
        assert np.array_equal(y, _capture(dev, room, 11, speech, "babble"))
        assert not np.array_equal(y, _capture(dev, room, 12, speech, "babble"))
        assert -45.0 < _db(fa._rms(y)) < -3.0, name
        if dev.agc:
            assert -32.0 < _db(fa.active_rms(y)) < -10.0, name
    narrow = _capture(fa.FIELD_DEVICES["D"], room, 13, speech, "music")
    assert _band_power(narrow, 4400, 8000) < 1e-3 * _band_power(narrow, 100, 3800)
    kitchen = fa.FIELD_DEVICES["E"]
    room = fa.image_source_room(np.random.default_rng(14), kitchen.rt60_s, kitchen.distance_m)
    k = _capture(kitchen, room, 15, speech, "fan")
    assert np.allclose(k * 2048, np.round(k * 2048))  # 12-bit samples
    assert np.max(np.abs(k)) <= kitchen.clip_level
    with pytest.raises(ValueError, match="speech, noise"):
        fa.field_capture(np.random.default_rng(0), kitchen, room, None, None)


@pytest.mark.slow
def test_field_augment_keeps_the_window_and_its_rooms_apart_from_the_held_out_ones(
    speech,
) -> None:
    rirs = fa.training_rooms(0, n=3)
    held_out = fa.image_source_room(
        np.random.default_rng([0, 0, fa.HELD_OUT_ROOMS, 0]), (0.3, 1.0), (1.0, 5.0)
    )
    assert all(r.size != held_out.speech_rir.size or not np.allclose(r, held_out.speech_rir)
               for r in rirs)  # fmt: skip
    assert np.array_equal(rirs[1], fa.training_rooms(0, n=3)[1])
    x = np.zeros(24000)
    x[4000 : 4000 + speech[0].size] = speech[0]
    x = fa.to_level(x, -25.0, active=True)
    every = fa.FieldAugmentSettings(1.0, 1.0, 1.0, 1.0, (0.05, 0.05), 1.0, (0.3, 0.3), 1.0, (8, 8))
    y = fa.field_augment(x, np.random.default_rng(1), rirs, every)
    assert y.dtype == np.float32 and y.shape == x.shape and np.max(np.abs(y)) <= 1.0
    assert len(np.unique(y)) <= 256  # 8 bits
    assert _band_power(y, 4400, 8000) < 1e-3 * _band_power(y, 100, 3800)
    assert np.array_equal(y, fa.field_augment(x, np.random.default_rng(1), rirs, every))
    none = fa.FieldAugmentSettings(0.0, 0.0, 0.0, 0.0, (0.0, 0.0), 0.0, (0.3, 0.3), 0.0, (8, 8))
    assert np.allclose(fa.field_augment(x, np.random.default_rng(1), rirs, none), x, atol=1e-7)
    outs = [fa.field_augment(x, np.random.default_rng(s), rirs) for s in range(20)]
    assert sum(not np.allclose(o, x, atol=1e-6) for o in outs) >= 8  # the defaults vary
