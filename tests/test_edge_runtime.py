"""The edge runtime: WAV decoding (bit depths, stereo, resampling, bad files), streaming
detection independent of chunking and sample format, the whole-file path and the
`wakefl edge detect` command, all on onnxruntime without torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import wave

import numpy as np
import onnx
import pytest
import soundfile as sf

from wakefl.edge_runtime import (
    Detection,
    OnnxScorer,
    StreamingDetector,
    detect_audio,
    detect_file,
    load_audio,
)
from wakefl.errors import AudioError, ConfigError

SR = 16000


def _write_pcm(path, samples: np.ndarray, rate: int, width: int) -> None:
    """Integer PCM WAV via the standard library; samples [frames, channels] in [-1, 1)."""
    frames = np.atleast_2d(samples.T).T
    scale = float(1 << (8 * width - 1))
    ints = np.clip(np.round(frames * scale), -scale, scale - 1).astype(np.int64)
    raw = (
        b"".join(int(v).to_bytes(width, "little", signed=True) for v in ints.reshape(-1))
        if width == 3
        else ints.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    )
    with wave.open(str(path), "wb") as w:
        w.setnchannels(frames.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)


@pytest.fixture(scope="module")
def speech(hey_nova_wav) -> np.ndarray:
    """~8 s of real speech with pauses and noise, at 16 kHz."""
    x = load_audio(hey_nova_wav, SR)
    rng = np.random.default_rng(3)
    gap = (0.01 * rng.standard_normal(SR)).astype(np.float32)
    return np.concatenate([gap, x, gap, 0.5 * x, gap]).astype(np.float32)


@pytest.mark.parametrize("width", [2, 3, 4])
def test_pcm_bit_depths_match_soundfile(tmp_path, speech, width):
    p = tmp_path / f"pcm{width}.wav"
    _write_pcm(p, speech[:8000], SR, width)
    ours = load_audio(p, SR)
    ref, rate = sf.read(str(p), dtype="float64")
    assert rate == SR and ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-6


@pytest.mark.parametrize("subtype", ["FLOAT", "DOUBLE"])
def test_float_wav(tmp_path, speech, subtype):
    p = tmp_path / "float.wav"
    sf.write(str(p), speech[:8000], SR, subtype=subtype)
    assert np.abs(load_audio(p, SR) - speech[:8000]).max() <= 1e-7


def test_stereo_is_mixed_down(tmp_path, speech):
    left, right = speech[:8000], 0.25 * speech[8000:16000]
    p = tmp_path / "stereo.wav"
    _write_pcm(p, np.stack([left, right], axis=1), SR, 2)
    assert np.abs(load_audio(p, SR) - (left + right) / 2).max() <= 2 / 32768


@pytest.mark.parametrize("rate", [8000, 22050, 44100])
def test_other_rates_are_resampled(tmp_path, rate):
    t = np.arange(int(rate * 0.5)) / rate
    p = tmp_path / f"tone{rate}.wav"
    _write_pcm(p, 0.5 * np.sin(2 * np.pi * 440 * t), rate, 2)
    y = load_audio(p, SR)
    assert y.size == round(t.size * SR / rate)
    ts = np.arange(y.size) / SR
    mid = slice(y.size // 4, 3 * y.size // 4)  # away from the FFT method's wrap-around
    assert np.abs(y[mid] - 0.5 * np.sin(2 * np.pi * 440 * ts[mid])).max() < 5e-3


def test_bad_files_raise_audio_error(tmp_path, speech):
    cases = {}
    cases["missing"] = tmp_path / "missing.wav"
    (empty := tmp_path / "empty.wav").write_bytes(b"")
    cases["empty"] = empty
    (junk := tmp_path / "junk.wav").write_bytes(np.random.default_rng(0).bytes(500))
    cases["junk"] = junk
    good = tmp_path / "good.wav"
    _write_pcm(good, speech[:1600], SR, 2)
    (trunc := tmp_path / "trunc.wav").write_bytes(good.read_bytes()[:30])
    cases["truncated header"] = trunc
    (cut := tmp_path / "cut.wav").write_bytes(good.read_bytes()[:1000])
    cases["truncated samples"] = cut
    silent = tmp_path / "nodata.wav"
    _write_pcm(silent, np.zeros((0, 1)), SR, 2)
    cases["no samples"] = silent
    for path in cases.values():
        with pytest.raises(AudioError):
            load_audio(path, SR)
    with pytest.raises(AudioError, match="truncated WAV.*declares 3200 bytes.*holds 956"):
        load_audio(cut, SR)
    # a streaming writer's placeholder size (0xFFFFFFFF) still reads what is there
    data = bytearray(good.read_bytes())
    at = data.index(b"data")
    data[at + 4 : at + 8] = b"\xff\xff\xff\xff"
    (streamed := tmp_path / "streamed.wav").write_bytes(bytes(data))
    assert load_audio(streamed, SR).size == 1600


def test_runtime_imports_without_torch(tiny_kws_onnx):
    code = textwrap.dedent(f"""
        import sys
        for name in ("torch", "torchaudio", "librosa", "soundfile", "scipy"):
            sys.modules[name] = None  # any import of them fails
        import numpy as np
        from wakefl.edge_runtime import OnnxScorer, StreamingDetector
        s = OnnxScorer({str(tiny_kws_onnx)!r})
        d = StreamingDetector(s, threshold=0.0)
        ev = d.push(np.zeros(s.window_samples, np.int16))
        print(len(ev), s.score(np.zeros((3, s.window_samples), np.float32)).shape)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "(3,)"]


def _events(det: StreamingDetector, audio: np.ndarray, chunk: int) -> list[Detection]:
    det.reset()
    out = []
    for i in range(0, audio.size, chunk):
        out += det.push(audio[i : i + chunk])
    return out


def test_events_do_not_depend_on_chunking_or_format(tiny_kws_onnx, speech):
    scorer = OnnxScorer(tiny_kws_onnx)
    pcm = np.round(speech * 32767).astype(np.int16)
    as_float = pcm.astype(np.float32) / 32768.0
    whole = detect_audio(scorer, as_float, hop_s=0.1, smoothing=3, threshold=0.0)
    # An operating point that fires on some windows and not on others.
    threshold = float(np.quantile(whole.scores, 0.7))
    det = StreamingDetector(scorer, hop_s=0.1, threshold=threshold, smoothing=3, refractory_s=0.5)
    reference = _events(det, as_float, as_float.size)
    assert 1 <= len(reference) < len(whole.scores)
    gaps = np.diff([e.time_s for e in reference])
    assert (gaps >= 0.5 - 1e-9).all()
    for chunk in (160, 441, 1600, 7777, 2 * SR, 5 * SR):  # 10 ms ... 5 s
        for audio in (pcm, as_float):
            got = _events(det, audio, chunk)
            assert [e.time_s for e in got] == [e.time_s for e in reference], (chunk, audio.dtype)
            np.testing.assert_allclose(
                [e.score for e in got], [e.score for e in reference], atol=1e-6
            )


def test_smoothing_threshold_and_refractory_logic():
    """A transparent scorer (1.0 when the newest 100 ms of the window is loud) pins down
    the event timing: window ends on the hop grid, moving average, refractory period."""

    class LoudTail:
        sample_rate, window_samples = SR, SR

        def score(self, windows):
            return (np.abs(windows[:, -1600:]).max(axis=1) > 0.5).astype(np.float32)

    audio = np.zeros(6 * SR, np.float32)
    audio[int(2.05 * SR) : int(2.45 * SR)] = 0.9  # burst A, 400 ms
    audio[int(4.0 * SR) : int(4.1 * SR)] = 0.9  # burst B, 100 ms
    res = detect_audio(LoudTail(), audio, hop_s=0.1, threshold=0.5, smoothing=3, refractory_s=1.0)
    assert np.allclose(res.times_s, np.arange(1.0, 6.0 + 1e-9, 0.1))
    # Raw fires at 2.1..2.5 s; the 3-point average reaches 2/3 first at 2.2 s.
    assert [round(e.time_s, 6) for e in res.events] == [2.2]
    i = int(np.argmin(np.abs(res.times_s - 2.2)))
    assert res.scores[i] == pytest.approx(np.mean(res.raw_scores[i - 2 : i + 1]))
    # Burst B: one raw hit at 4.1 s averages to 1/3 < 0.5 with smoothing; without
    # smoothing it fires, and a short refractory lets burst A fire at every hop.
    res1 = detect_audio(LoudTail(), audio, hop_s=0.1, threshold=0.5, smoothing=1, refractory_s=0.0)
    assert [round(e.time_s, 6) for e in res1.events] == [2.1, 2.2, 2.3, 2.4, 2.5, 4.1]


def test_detector_rejects_bad_settings_and_chunks(tiny_kws_onnx):
    scorer = OnnxScorer(tiny_kws_onnx)
    with pytest.raises(ConfigError):
        StreamingDetector(scorer, hop_s=0.0)
    with pytest.raises(ConfigError):
        StreamingDetector(scorer, threshold=1.5)
    with pytest.raises(ConfigError):
        StreamingDetector(scorer, smoothing=0)
    det = StreamingDetector(scorer)
    with pytest.raises(AudioError):
        det.push(np.array([0.1, np.nan], np.float32))
    with pytest.raises(AudioError):
        det.push(np.zeros(10, np.int32))
    with pytest.raises(AudioError):
        scorer.score(np.zeros((1, 100), np.float32))


def test_short_file_is_scored_once(tiny_kws_onnx, tmp_path, speech):
    p = tmp_path / "short.wav"
    _write_pcm(p, speech[:4000], SR, 2)
    res = detect_file(OnnxScorer(tiny_kws_onnx), p, threshold=0.0)
    assert len(res.times_s) == 1 and res.times_s[0] == pytest.approx(0.25)
    assert len(res.events) == 1


def _edge_cli(*args: str) -> subprocess.CompletedProcess:
    # torch is blocked: detection must work on a device without it.
    code = (
        "import sys; sys.modules['torch'] = None; from wakefl.tools.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "edge", "detect", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_edge_detect(tiny_kws_onnx, hey_nova_wav, tmp_path):
    r = _edge_cli(
        "--model",
        str(tiny_kws_onnx),
        str(hey_nova_wav),
        "--threshold",
        "0",
        "--hop",
        "0.05",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["events"] and out["events"][0]["time_s"] == pytest.approx(1.5)
    assert out["windows"] == 1 + int((out["duration_s"] - 1.5) / 0.05 + 1e-9)

    (corrupt := tmp_path / "corrupt.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunkjunk")
    (empty := tmp_path / "empty.wav").write_bytes(b"")
    for bad, needle in ((corrupt, "corrupt"), (empty, "empty"), (tmp_path / "none.wav", "no such")):
        r = _edge_cli("--model", str(tiny_kws_onnx), str(bad), "--json")
        assert r.returncode != 0 and needle in r.stderr and "Traceback" not in r.stderr
    r = _edge_cli("--model", str(tmp_path / "none.onnx"), str(hey_nova_wav))
    assert r.returncode != 0 and "not found" in r.stderr and "Traceback" not in r.stderr


def _with_threshold(src, dst, threshold: float, source: str):
    """A copy of an exported model whose metadata carries a shipped threshold."""
    proto = onnx.load(str(src))
    for key, value in (("shipped_threshold", json.dumps(threshold)), ("threshold_source", source)):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save_model(proto, str(dst))
    return dst


def test_detector_defaults_to_the_models_shipped_threshold(tiny_kws_onnx, speech, tmp_path):
    plain = OnnxScorer(tiny_kws_onnx)
    raw = detect_audio(plain, speech, threshold=0.0).scores
    # A threshold among the posteriors: some windows reach it, others do not.
    shipped = float(np.quantile(raw, 0.8))
    scorer = OnnxScorer(_with_threshold(tiny_kws_onnx, tmp_path / "t.onnx", shipped, "its card"))
    assert scorer.shipped_threshold == pytest.approx(shipped)
    det = StreamingDetector(scorer)
    assert det.threshold == pytest.approx(shipped) and "its card" in det.threshold_source
    res = detect_audio(scorer, speech)
    assert res.extra["threshold"] == pytest.approx(shipped)
    assert res.events == detect_audio(plain, speech, threshold=shipped).events
    # given explicitly, a threshold wins; a model without one runs at the fallback, saying so
    assert StreamingDetector(scorer, threshold=0.3).threshold == 0.3
    fallback = StreamingDetector(plain)
    assert fallback.threshold == 0.5 and "no shipped threshold" in fallback.threshold_source
    bad = _with_threshold(tiny_kws_onnx, tmp_path / "bad.onnx", 3.0, "x")
    with pytest.raises(ConfigError, match="shipped_threshold"):
        OnnxScorer(bad)


def test_cli_edge_detect_runs_at_the_models_threshold_and_says_so(
    tiny_kws_onnx, hey_nova_wav, tmp_path
):
    model = _with_threshold(tiny_kws_onnx, tmp_path / "t.onnx", 0.25, "the card of m")
    r = _edge_cli("--model", str(model), str(hey_nova_wav), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["threshold"] == 0.25 and "the card of m" in out["threshold_source"]
    r = _edge_cli("--model", str(tiny_kws_onnx), str(hey_nova_wav))
    assert r.returncode == 0, r.stderr
    assert "at threshold 0.5000 (0.5, a fallback" in r.stdout
    r = _edge_cli("--help")
    assert "shipped threshold" in " ".join(r.stdout.split())


@pytest.mark.slow  # a CLI subprocess scoring 30 s of audio
def test_output_into_a_closed_pipe_ends_quietly(tiny_kws_onnx, speech, tmp_path):
    """`wakefl edge detect ... | head`: the reader leaves early; no traceback."""
    wav = tmp_path / "long.wav"
    _write_pcm(wav, np.tile(speech, 4), SR, 2)  # 3,000 posteriors: more than a pipe holds
    cli = f"{sys.executable} -m wakefl.tools.cli edge detect --model {tiny_kws_onnx}"
    cmd = f"{cli} {wav} --hop 0.01 --posteriors --json | head -c 100 >/dev/null"
    r = subprocess.run(
        ["bash", "-c", cmd + "; exit ${PIPESTATUS[0]}"], capture_output=True, text=True, timeout=120
    )
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr
    assert r.returncode == 141
