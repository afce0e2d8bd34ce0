"""The version-2 wake-word model, which keeps a phrase's score its own when other speech
shares the window: per-frame normalization, pooled frame decisions, PCEN. Its receptive
field, its pooling, its PCEN against the numpy reference, and its ONNX export."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest
import torch

from wakefl.edge_runtime import OnnxScorer, load_audio
from wakefl.edge_runtime.gain_norm import pcen
from wakefl.edge_runtime.log_mel import LogMel, LogMelSpec
from wakefl.errors import ConfigError
from wakefl.models.kws_cnn import KwsCnn, ModelConfig, export_onnx, load_model, save_model
from wakefl.models.kws_cnn.frontend import LOG_FLOOR
from wakefl.models.kws_cnn.gain_norm import Pcen, smoother_matrix
from wakefl.models.kws_cnn.model import pooled_frame_logits

HOP = 160
WIN_HALF = 200  # half the STFT's 400-tap window: a frame sees samples [160 f - 200, 160 f + 200)
STRIDE, RF_BEFORE, RF_AFTER = 16, 43, 58  # last-map frame j sees frames [16 j - 43, 16 j + 58]


def _model(seed: int = 3, **choices) -> KwsCnn:
    torch.manual_seed(seed)
    cfg = ModelConfig.context_robust(width=0.25, **choices)
    model = KwsCnn(cfg).eval()
    with torch.no_grad():  # a spread of scores, so comparisons test something
        model.head[3].weight.mul_(40.0)
    return model


def _speech(hey_nova_wav, seconds: float = 1.5) -> np.ndarray:
    y = load_audio(hey_nova_wav, 16000)
    return y[: int(seconds * 16000)].astype(np.float32)


def _frame_logits(model: KwsCnn, wave: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        log_mel = model.frontend(torch.from_numpy(wave)[None])
        if model.gain_norm is not None:
            log_mel = model.gain_norm(log_mel)
        return model.frame_logits(model.features(log_mel.unsqueeze(1)))[0].numpy()


def test_version_2_has_the_parameters_of_version_1_and_loads_its_weights(tmp_path):
    v1 = KwsCnn(ModelConfig(width=0.25))
    v2 = KwsCnn(ModelConfig.context_robust(width=0.25))
    assert v1.num_trainable_params() == v2.num_trainable_params()
    assert sum(v2.layer_counts().values()) == 11
    v2.load_state_dict(v1.state_dict())  # what --init-from does
    save_model(v2, tmp_path / "v2.safetensors")
    meta = json.loads((tmp_path / "v2.json").read_text())
    assert meta["config"]["version"] == 2 and meta["config"]["gain_norm"] == "pcen"
    back = load_model(tmp_path / "v2.safetensors")
    assert back.cfg == v2.cfg
    # A version-1 config file names none of the new choices: shipped files stay as they are.
    assert set(ModelConfig(width=0.25).to_dict()) == {
        f.name for f in dataclasses.fields(ModelConfig)
    } - {"norm", "time_pool", "gain_norm", "first_time_pool", "gain_alpha"}


@pytest.mark.parametrize(
    "bad",
    [
        {"norm": "batch"},
        {"time_pool": "attention"},
        {"gain_norm": "log"},
        {"first_time_pool": 4},
    ],
)
def test_unknown_choices_are_refused(bad):
    with pytest.raises(ConfigError):
        ModelConfig.context_robust(**bad)


def test_a_version_1_config_has_only_version_1_choices():
    with pytest.raises(ConfigError, match="version-1"):
        ModelConfig(norm="frame")


def test_speech_after_the_receptive_field_leaves_earlier_frames_unchanged(hey_nova_wav):
    model = _model()
    wave = _speech(hey_nova_wav)
    start = 16000  # loud speech from 1.0 s on
    other = wave.copy()
    other[start:] += 0.8 * np.roll(wave, 5000)[start:]
    first_touched = (start - WIN_HALF) // HOP  # the first STFT frame that sees the change
    a, b = _frame_logits(model, wave), _frame_logits(model, other)
    untouched = [j for j in range(len(a)) if STRIDE * j + RF_AFTER < first_touched]
    assert untouched, "the test needs frames whose receptive field ends before the change"
    np.testing.assert_allclose(b[untouched], a[untouched], atol=1e-5)
    assert np.abs(b - a).max() > 1e-2  # frames that do see the change do change


def test_without_pcen_speech_before_the_receptive_field_changes_nothing_after_it(hey_nova_wav):
    wave = _speech(hey_nova_wav)
    end = 6000  # loud speech in the first 0.375 s
    other = wave.copy()
    other[:end] += 0.8 * np.roll(wave, 9000)[:end]
    last_touched = (end + WIN_HALF) // HOP + 1
    model = _model(gain_norm="none")
    a, b = _frame_logits(model, wave), _frame_logits(model, other)
    untouched = [j for j in range(len(a)) if STRIDE * j - RF_BEFORE > last_touched]
    assert untouched
    np.testing.assert_allclose(b[untouched], a[untouched], atol=1e-5)
    # The version-1 model normalizes over the whole window: the same frames change there.
    v1 = _model(norm="group", time_pool="lse", gain_norm="none")
    a1, b1 = _frame_logits(v1, wave), _frame_logits(v1, other)
    assert np.abs(b1[untouched] - a1[untouched]).max() > 1e-3


def test_pooled_frames_score_a_phrase_the_same_wherever_it_sits():
    """The same pattern at any multiple of the last map's frame stride, away from the
    edges, gives the same window score: nothing but the phrase's own frames decides."""
    torch.manual_seed(0)
    model = _model(gain_norm="none")
    frames = 400  # a longer map than a window, so edges stay out of the phrase's frames
    background = torch.full((1, 40, frames), -6.0)
    patch = torch.randn(1, 40, 60) * 3.0
    scores = []
    for k in (8, 10, 13):
        x = background.clone()
        x[..., STRIDE * k : STRIDE * k + 60] = patch
        with torch.no_grad():
            scores.append(model.classify(x)[0].numpy())
    for s in scores[1:]:
        np.testing.assert_allclose(s, scores[0], atol=1e-4)


def test_pooling_is_a_soft_maximum_of_the_frame_decisions():
    odds = torch.tensor([[-8.0, -8.0, 6.0, -8.0], [-8.0, 6.0, -8.0, -8.0]])
    logits = torch.stack([torch.zeros_like(odds), odds], dim=-1)
    lse = pooled_frame_logits(logits, "lse")
    # Where the phrase sits among the frames does not matter.
    torch.testing.assert_close(lse[0], lse[1])
    pooled = lse[:, 1] - lse[:, 0]
    assert pooled[0] <= odds[0].max() and pooled[0] >= odds[0].max() - np.log(4)
    mx = pooled_frame_logits(logits, "max")
    torch.testing.assert_close(mx[:, 1] - mx[:, 0], odds.amax(dim=1))


def test_pcen_torch_equals_the_numpy_reference(hey_nova_wav):
    cfg = ModelConfig.context_robust(width=0.25)
    wave = _speech(hey_nova_wav)
    spec = LogMelSpec(16000, cfg.window_samples, cfg.n_fft, cfg.win_length, cfg.hop_length,
                      cfg.n_mels, cfg.f_min, 8000.0, LOG_FLOOR)  # fmt: skip
    log_mel = LogMel(spec)(wave[None])
    ours = Pcen(cfg.n_frames)(torch.from_numpy(log_mel))[0].numpy()
    ref = pcen(log_mel)[0]
    assert ours.shape == ref.shape == (cfg.n_mels, cfg.n_frames)
    np.testing.assert_allclose(ours, ref, atol=1e-4)
    assert ref.max() - ref.min() > 1.0  # not degenerate on speech


def test_pcen_divides_out_a_gain_that_changes_over_time(hey_nova_wav):
    """An AGC-like gain ramp (20 dB over the window) moves log-mel by up to 4.6 nats;
    PCEN moves little, since each frame is divided by its own recent level."""
    wave = _speech(hey_nova_wav)
    ramp = np.geomspace(0.1, 1.0, wave.size).astype(np.float32)
    model = KwsCnn(ModelConfig.context_robust(width=0.25))
    with torch.no_grad():
        a, b = (model.frontend(torch.from_numpy(w)[None]) for w in (wave * 0.1, wave * ramp))
        pa, pb = model.gain_norm(a), model.gain_norm(b)
    speech = a[0] > np.log(LOG_FLOOR) + 8  # time-frequency cells well above the floor
    log_change = float((b - a)[0][speech].abs().mean())
    pcen_change = float((pb - pa)[0][speech].abs().mean())
    assert log_change > 1.0
    assert pcen_change < 0.3 * log_change * float(pa[0][speech].abs().mean())


def test_the_smoother_matrix_is_the_recursion():
    e = np.random.default_rng(1).uniform(0.1, 5.0, (3, 40))
    k = smoother_matrix(40, 0.1).numpy()
    m = np.empty_like(e)
    m[:, 0] = e[:, 0]
    for t in range(1, 40):
        m[:, t] = 0.9 * m[:, t - 1] + 0.1 * e[:, t]
    np.testing.assert_allclose(e @ k, m, rtol=1e-12)


def test_onnx_export_of_version_2_equals_torch_fp32_and_int8(hey_nova_wav, tmp_path):
    model = _model()
    wave = load_audio(hey_nova_wav, 16000)
    n = model.cfg.window_samples
    windows = np.stack([wave[i : i + n] for i in range(0, wave.size - n, 2000)])

    def torch_scores() -> np.ndarray:
        with torch.no_grad():
            return model.predict_proba(torch.from_numpy(windows)).numpy()

    fp32 = OnnxScorer(export_onnx(model, tmp_path / "v2.onnx"))
    np.testing.assert_allclose(fp32.score(windows), torch_scores(), atol=1e-5)
    assert json.loads(fp32.metadata["model_config"])["gain_norm"] == "pcen"
    path = export_onnx(model, tmp_path / "v2-int8.onnx", int8=True, calibration_windows=windows)
    np.testing.assert_allclose(OnnxScorer(path).score(windows), torch_scores(), atol=0.02)
    # PCEN's smoother spans energies over 1e-6..1e3: its MatMul must stay float.
    graph = onnx.load(str(path)).graph
    made_by = {out: node.op_type for node in graph.node for out in node.output}
    smoother = [n for n in graph.node if n.op_type == "MatMul"]
    assert smoother and all(made_by.get(i) != "DequantizeLinear" for n in smoother for i in n.input)
    assert any(n.op_type == "QuantizeLinear" for n in graph.node)  # the CNN is int8


def test_a_version_2_model_streams_with_reused_frames_like_its_waveform_export(
    hey_nova_wav, tmp_path
):
    """The detector computes each log-mel frame of a stream once and the graph runs PCEN
    per window: the same posteriors as a waveform-in export that computes everything."""
    from wakefl.edge_runtime import StreamingDetector

    model = _model()
    stream = load_audio(hey_nova_wav, 16000)
    mel = OnnxScorer(export_onnx(model, tmp_path / "m.onnx"))
    wave = OnnxScorer(export_onnx(model, tmp_path / "w.onnx", frontend="dft"))
    a = StreamingDetector(mel, hop_s=0.1).feed(stream)[0]
    b = StreamingDetector(wave, hop_s=0.1).feed(stream)[0]
    assert len(a) == len(b) > 10
    assert np.abs(np.array(a) - np.array(b)).max() < 1e-4
