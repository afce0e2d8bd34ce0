"""The edge runtime's numpy log-mel frontend equals the model's torchaudio frontend, and
its streaming form, which computes a stream's shared frames once, equals it on every
window; a log-mel-input ONNX model scores like the torch model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchaudio

from wakefl.edge_runtime import OnnxScorer, StreamingDetector, load_audio
from wakefl.edge_runtime.log_mel import LogMel, LogMelSpec, StreamingLogMel, mel_filterbank
from wakefl.errors import AudioError, ConfigError
from wakefl.models.kws_cnn import export_onnx
from wakefl.models.kws_cnn.onnx_export import onnx_metadata


@pytest.fixture(scope="module")
def speech_stream(hey_nova_wav) -> np.ndarray:
    """Decoded espeak-ng speech between silence and quiet noise, several seconds long."""
    x = load_audio(hey_nova_wav, 16000)
    rng = np.random.default_rng(0)
    noise = (0.003 * rng.standard_normal(16000)).astype(np.float32)
    return np.concatenate([np.zeros(8000, np.float32), x, noise, 0.3 * x, noise, x, noise])


def _log_mel(model) -> LogMel:
    return LogMel(LogMelSpec.from_metadata(onnx_metadata(model, "fp32")))


def test_the_filterbank_is_torchaudios():
    for f_min, f_max, n_mels in ((20.0, 8000.0, 40), (0.0, 4000.0, 64)):
        ref = torchaudio.functional.melscale_fbanks(
            257, f_min, f_max, n_mels, 16000, norm="slaney", mel_scale="slaney"
        ).numpy()
        assert np.abs(mel_filterbank(257, f_min, f_max, n_mels, 16000) - ref).max() < 1e-6


def test_numpy_log_mel_equals_the_models_frontend(tiny_kws_model, speech_stream):
    lm = _log_mel(tiny_kws_model)
    windows = np.stack([speech_stream[i : i + 24000] for i in range(0, 40000, 4000)])
    with torch.no_grad():
        ref = tiny_kws_model.frontend(torch.from_numpy(windows)).numpy()
    got = lm(windows)
    assert got.shape == ref.shape == (len(windows), 40, 151) and got.dtype == np.float32
    assert np.abs(got - ref).max() < 1e-3  # log of the floor in silence
    assert np.abs(got - ref).mean() < 1e-5
    with pytest.raises(AudioError):
        lm(windows[:, :100])


def test_streaming_frames_equal_whole_windows(tiny_kws_model, speech_stream):
    lm = _log_mel(tiny_kws_model)
    st = StreamingLogMel(lm, 1600)
    n = (speech_stream.size - 24000) // 1600 + 1
    order = list(range(n)) + [0, 1, 5, 6, n - 1]  # on, then a restart and jumps
    for k in order:
        w = speech_stream[k * 1600 : k * 1600 + 24000]
        assert np.array_equal(st.window(w, k), lm(w[None])[0]), k
    with pytest.raises(ConfigError, match="multiple"):
        StreamingLogMel(lm, 1000)


def test_a_log_mel_model_streams_like_the_waveform_model(tiny_kws_model, speech_stream, tmp_path):
    mel = OnnxScorer(export_onnx(tiny_kws_model, tmp_path / "m.onnx"))
    wave = OnnxScorer(export_onnx(tiny_kws_model, tmp_path / "w.onnx", frontend="dft"))
    assert mel.log_mel is not None and mel.metadata["input"] == "log_mel"
    with torch.no_grad():
        windows = np.stack([speech_stream[i : i + 24000] for i in range(0, 30000, 3000)])
        ref = tiny_kws_model.predict_proba(torch.from_numpy(windows)).numpy()
    assert np.abs(mel.score(windows) - ref).max() < 1e-4
    for hop in (0.1, 0.15):  # 0.15 s is no multiple of the frontend's hop: no frame reuse
        a = StreamingDetector(mel, hop_s=hop).feed(speech_stream)[0]
        b = StreamingDetector(wave, hop_s=hop).feed(speech_stream)[0]
        assert len(a) == len(b) > 10
        assert np.abs(np.array(a) - np.array(b)).max() < 1e-4
    with pytest.raises(ConfigError, match="waveform"):
        wave.score_features(np.zeros((1, 40, 151), np.float32))
    with pytest.raises(AudioError):
        mel.score_features(np.zeros((1, 40, 150), np.float32))


def test_metadata_without_frontend_settings_is_refused():
    meta = {"sample_rate": "16000", "window_samples": "24000", "n_fft": "512"}
    with pytest.raises(ConfigError, match="log-mel"):
        LogMelSpec.from_metadata(meta)
    full = {
        **meta,
        "win_length": "600",
        "hop_length": "160",
        "n_mels": "40",
        "f_min": "20",
        "f_max": "8000",
        "log_floor": "1e-6",
    }
    with pytest.raises(ConfigError, match="impossible"):
        LogMelSpec.from_metadata(full)
