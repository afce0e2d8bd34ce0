"""tools/bench/peers.py and peer_detectors.py: how clips are laid out and scored, and
wakefl, openWakeWord and microWakeWord through their own streaming paths on a few seconds
of espeak-ng speech."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from wakefl.errors import ConfigError
from wakefl.tools.bench import peer_detectors as pdet
from wakefl.tools.bench import peers as bp

SR = pdet.SAMPLE_RATE
needs_peers = pytest.mark.skipif(
    not pdet.peers_available(),
    reason="the optional extra `peers` (pyopen-wakeword, pymicro-wakeword) is not installed",
)
needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng missing")


def _noisy(n: int, seed: int, level: float = 0.003) -> np.ndarray:
    return (level * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def test_clips_lie_apart_each_with_its_own_background_and_span():
    tone = 0.25 * np.sin(np.arange(12000) * 0.3).astype(np.float32)
    clips = [_noisy(24000, i) for i in range(3)]
    for c in clips:
        c[6000:18000] += tone
    wave, spans = bp.clip_stream(clips)
    step = bp.LEAD_S + 1.5 + bp.AFTER_S
    assert wave.dtype == np.int16
    assert wave.size == int(round(3 * step * SR))
    for i, (a, b) in enumerate(spans):
        assert a == pytest.approx(bp.LEAD_S + i * step)
        assert b == pytest.approx(a + 1.5 + bp.TAIL_S)
        start = int(round(a * SR))
        assert np.array_equal(wave[start : start + 24000], bp.to_int16(clips[i]))
    # The background before the first clip is noise at the clip's quietest level, never
    # digital silence, and far below the clip.
    lead = wave[: int(bp.LEAD_S * SR)].astype(np.float64)
    assert 0 < np.sqrt(np.mean(lead**2)) < 0.1 * 0.25 * 32768
    # No span reaches the next clip's start less a detector's context (about 2 s).
    assert all(b + 2.0 < a2 for (_, b), (a2, _) in zip(spans, spans[1:], strict=False))


def test_a_clip_scores_the_highest_score_within_its_span():
    track = pdet.ScoreTrack(
        np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), np.array([0.9, 0.2, 0.7, 0.1, 0.4, 0.95]), 1.0
    )
    # (1, 3]: 2.0 and 3.0; (3.5, 5]: 4.0 and 5.0; nothing in (6, 7].
    assert bp.clip_scores(track, [(1.0, 3.0), (3.5, 5.0), (6.0, 7.0)]).tolist() == [0.7, 0.4, 0.0]


def _result(detector: str, folder: str, max_clips: int | None = None) -> dict:
    return {
        **{k: None for k in bp.SETTINGS},
        "max_clips_per_type": max_clips,
        "detectors": {detector: {"threshold": 0.5, "hop_s": 0.1}},
        "conditions": {
            "held-out speakers": {
                "corpus": {"folder": folder},
                "figures": {detector: {"A": {"positives": 3}}},
            },
            "held-out acoustics": {"status": "not scored: no corpus given"},
        },
    }


def test_merging_keeps_both_detectors_on_the_same_corpus_and_refuses_another():
    merged = bp.merge_results(_result("x", "c"), _result("y", "c"))
    assert set(merged["detectors"]) == {"x", "y"}
    assert set(merged["conditions"]["held-out speakers"]["figures"]) == {"x", "y"}
    with pytest.raises(ConfigError, match="another corpus"):
        bp.merge_results(_result("x", "c"), _result("y", "d"))
    with pytest.raises(ConfigError, match="max_clips_per_type"):
        bp.merge_results(_result("x", "c"), _result("y", "c", max_clips=5))


def test_without_the_extra_the_peers_are_refused_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "pyopen_wakeword", None)  # an import of it fails
    assert bp.main(["--corpus", str(tmp_path), "--peers", "openwakeword"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install -e '.[peers]'" in err


def test_a_model_without_a_card_needs_a_threshold(tmp_path):
    from wakefl.models.kws_cnn.pretrained import pretrained_card, pretrained_path

    small = pretrained_path("small")
    op = bp.wakefl_operating_point(small, None)
    assert op["threshold"] == pretrained_card("small")["threshold"]
    assert (op["hop_s"], op["smoothing"]) == (0.1, 3)
    assert bp.wakefl_operating_point(small, 0.7)["threshold"] == 0.7
    bare = tmp_path / "m.onnx"
    bare.write_bytes(b"")
    with pytest.raises(ConfigError, match="--wakefl-threshold"):
        bp.wakefl_operating_point(bare, None)


# --- a few seconds of espeak-ng speech ------------------------------------------------


def _say(text: str, voice: str, cache: Path) -> np.ndarray:
    from wakefl.tools.corpus.speech_synthesis import Voice, synthesize

    return synthesize(Voice("espeak-ng", voice, "", 150, 50), text, cache)


def _clip(speech: np.ndarray, seed: int) -> np.ndarray:
    clip = _noisy(24000, seed)
    n = min(speech.size, 20000)
    clip[3000 : 3000 + n] += speech[:n]
    return clip


@pytest.fixture(scope="module")
def jarvis_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Device type A's test split: "hey jarvis" and other speech by two espeak-ng voices as
    1.5 s clips, and a 24 s stream of other speech."""
    import soundfile as sf

    from wakefl.sdk.manifest import ManifestRow, write_manifest

    root = tmp_path_factory.mktemp("jarvis")
    cache = root / "tts"
    rows = []
    texts = [("hey jarvis", 1), ("turn on the lights", 0), ("what time is it", 0)]
    for i, (text, label) in enumerate((t, lab) for t, lab in texts for _ in range(2)):
        voice = ("en-us", "en-gb")[i % 2]
        path = f"clips/A_{i}.wav"
        (root / "clips").mkdir(exist_ok=True)
        sf.write(root / path, _clip(_say(text, voice, cache), i), SR, subtype="PCM_16")
        rows.append(ManifestRow(path, label, "A", "normal", voice, "test", 1.5, "clip"))
    stream = _noisy(24 * SR, 99)
    for k, text in enumerate(["play some music", "hey there how are you", "call my mother"]):
        speech = _say(text, ("en-us", "en-gb")[k % 2], cache)
        stream[(2 + 7 * k) * SR : (2 + 7 * k) * SR + speech.size] += speech
    (root / "streams").mkdir()
    sf.write(root / "streams/A_0.wav", stream, SR, subtype="PCM_16")
    rows.append(ManifestRow("streams/A_0.wav", 0, "A", "normal", "mixed", "test", 24.0, "stream"))
    write_manifest(rows, root / "manifest.csv")
    return root


@needs_peers
@needs_espeak
def test_peers_stream_real_speech_from_a_fresh_state(jarvis_corpus):
    audio = bp.load_condition(jarvis_corpus, None, None)["A"]
    wave, spans = bp.clip_stream(audio.pos)
    for det in (pdet.OpenWakeWordDetector(), pdet.MicroWakeWordDetector()):
        first, again = det.track(wave), det.track(wave)
        assert np.array_equal(first.scores, again.scores)  # no state left from the first
        assert np.all(np.diff(first.times_s) >= 0) and first.times_s[-1] <= wave.size / SR
        assert np.all((first.scores >= 0) & (first.scores <= 1))
        gaps = np.diff(np.unique(first.times_s))
        assert np.allclose(gaps, det.hop_s)
    oww = pdet.OpenWakeWordDetector()
    pos = bp.clip_scores(oww.track(wave), spans)
    other = oww.track(bp.to_int16(audio.streams[0])).scores
    # openWakeWord's own model hears espeak-ng's "hey jarvis" and not its other speech.
    assert pos.min() >= oww.threshold > other.max()


@pytest.mark.slow  # exports a model to ONNX and runs three detectors: about 15 s on 2 cores
@needs_peers
@needs_espeak
def test_the_bench_scores_all_three_detectors_and_writes_relative_json(
    jarvis_corpus, tmp_path, capsys
):
    from wakefl.models.kws_cnn.pretrained import pretrained_path

    out = tmp_path / "res" / "peers.json"
    code = bp.main(
        ["--wakefl", str(pretrained_path("small")), "--corpus", str(jarvis_corpus)]
        + ["--json", str(out)]
    )
    assert code == 0
    text = out.read_text(encoding="utf-8")
    assert str(tmp_path) not in text and str(jarvis_corpus) not in text
    res = json.loads(text)
    assert set(res["detectors"]) == {
        "wakefl",
        "openWakeWord hey_jarvis",
        "microWakeWord hey_jarvis",
    }
    assert res["detectors"]["microWakeWord hey_jarvis"]["threshold"] == pytest.approx(0.97)
    assert res["conditions"]["held-out acoustics"]["status"].startswith("not scored")
    figures = res["conditions"]["held-out speakers"]["figures"]
    for name, rows in figures.items():
        a = rows["A"]
        assert a["positives"] == 2 and a["stream_hours"] == pytest.approx(24 / 3600, abs=1e-4)
        assert a["fa_per_hour_resolution"] == pytest.approx(150.0, rel=1e-3)
        assert not a["frr_at_0.5_fa_h"]["resolved"]  # 24 s cannot resolve 0.5 FA/h
        assert rows["all"]["detected_at_shipped"] == a["detected_at_shipped"], name
    assert figures["openWakeWord hey_jarvis"]["A"]["detected_at_shipped"] == 1.0
    assert "held-out speakers (jarvis" in capsys.readouterr().out


@needs_espeak
def test_recordings_give_each_detector_its_highest_score_on_real_speech(tmp_path, capsys):
    from conftest import espeak_wav

    model = Path(__file__).resolve().parents[1] / "models/kws_cnn/pretrained/hey-jarvis-small"
    said = espeak_wav(tmp_path / "said.wav", "hey jarvis, turn on the lights")
    other = espeak_wav(tmp_path / "other.wav", "turn on the lights")
    out = tmp_path / "rec.json"
    argv = ["--wakefl", str(model.with_suffix(".safetensors")), "--peers", "--recordings"]
    assert bp.main([*argv, str(said), str(other), "--json", str(out)]) == 0
    res = json.loads(out.read_text(encoding="utf-8"))
    assert set(res["detectors"]) == {"wakefl"} and "conditions" not in res
    rec = res["recordings"]
    assert rec["said.wav"]["wakefl"]["detected"] and not rec["other.wav"]["wakefl"]["detected"]
    assert rec["other.wav"]["wakefl"]["max_score"] < res["detectors"]["wakefl"]["threshold"]
    assert " fires\nother.wav | " in capsys.readouterr().out
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF not audio")
    assert bp.main([*argv, str(broken)]) == 2
    assert "cannot decode" in capsys.readouterr().err
    assert bp.main([*argv, str(said), "--corpus", str(tmp_path)]) == 2
    assert "instead of the conditions" in capsys.readouterr().err


def test_the_compact_corpus_resolves_half_a_false_accept_an_hour_per_condition():
    from wakefl.tools.acoustics.device_acoustics import DEVICE_PROFILES
    from wakefl.tools.corpus.plan import PROFILES
    from wakefl.tools.corpus.speakers import make_speakers, make_unseen_speakers

    p = PROFILES["pretrain-compact"]
    types = len(DEVICE_PROFILES)
    for streams in (p.streams_per_device, p.unseen_streams_per_device):
        assert types * streams * p.stream_seconds / 3600 * bp.FA_TARGET >= 1.0
    speakers = make_speakers(0, p, "hey jarvis")
    assert sum(s.split == "test" for s in speakers) >= 30
    unseen = make_unseen_speakers(0, p, "hey jarvis")
    assert len(unseen) == 48
    assert not {s.voice.voice for s in unseen} & {s.voice.voice for s in speakers}
