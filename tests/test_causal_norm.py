"""The causal norm (`norm="causal"`, models/kws_cnn/model.py): statistics at each frame are
a decaying average over that frame and the frames before it, so sound after a frame never
changes it, and a word after a pause keeps its level against the pause (a per-frame norm
makes every frame equally loud)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from wakefl.edge_runtime import OnnxScorer, load_audio
from wakefl.models.kws_cnn import KwsCnn, ModelConfig, export_onnx
from wakefl.models.kws_cnn.model import (
    CAUSAL_NORM_S,
    CausalGroupNorm,
    FrameGroupNorm,
    causal_average_matrix,
)


def test_the_average_matrix_is_a_decaying_causal_mean():
    np.testing.assert_allclose(causal_average_matrix(4, 0.0).numpy(), np.eye(4))
    cumulative = causal_average_matrix(4, 1.0).numpy()
    for t in range(4):  # decay 1: the mean of frames 0..t
        np.testing.assert_allclose(cumulative[:, t], [1 / (t + 1)] * (t + 1) + [0] * (3 - t))
    w = causal_average_matrix(6, 0.5).numpy()
    np.testing.assert_allclose(w.sum(axis=0), 1.0)
    assert np.all(np.triu(w) == w)  # nothing after a frame
    np.testing.assert_allclose(w[3, 5] / w[4, 5], 0.5)  # one frame older, half the weight


def _norm(frames: int = 40) -> CausalGroupNorm:
    torch.manual_seed(0)
    norm = CausalGroupNorm(2, 4, frames, frame_s=0.03)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.2, 0.2)
    return norm


def test_sound_after_a_frame_never_changes_it():
    norm = _norm()
    x = torch.randn(1, 4, 5, 40)
    y = x.clone()
    y[..., 25:] += 10 * torch.randn(1, 4, 5, 15)
    a, b = norm(x), norm(y)
    torch.testing.assert_close(a[..., :25], b[..., :25])
    assert (a[..., 25:] - b[..., 25:]).abs().max() > 0.1


def test_a_word_after_a_pause_keeps_its_level_where_a_per_frame_norm_loses_it():
    pattern = torch.randn(1, 4, 5, 1)
    level = torch.ones(40)
    level[20:] = 10.0  # a loud word after a quiet stretch
    x = pattern * level + 0.01 * torch.randn(1, 4, 5, 40)
    frame = FrameGroupNorm(2, 4)
    causal = _norm()
    with torch.no_grad():
        frame.weight.copy_(causal.weight)
        frame.bias.copy_(causal.bias)
        f, c = frame(x), causal(x)
    # Per frame, quiet and loud frames come out the same size.
    assert f[..., 10].abs().mean() == pytest.approx(f[..., 20].abs().mean(), rel=0.05)
    # Causally, the word's onset stands out against the pause it follows...
    assert c[..., 20].abs().mean() > 1.5 * c[..., 10].abs().mean()
    # ...and fades to the steady level as the average forgets the pause.
    assert c[..., 39].abs().mean() < c[..., 20].abs().mean()


def test_the_memory_follows_each_layers_frame_rate():
    model = KwsCnn(ModelConfig.context_robust(width=0.25, norm="causal"))
    norms = [m for m in model.features if isinstance(m, CausalGroupNorm)]
    assert len(norms) == 7
    frame_s = [0.01, 0.02, 0.04, 0.04, 0.08, 0.08, 0.16]  # after pools of 2, 2, 2, 2
    for norm, s in zip(norms, frame_s, strict=True):
        w = norm.get_buffer("average")
        assert w[-2, -1] / w[-1, -1] == pytest.approx(math.exp(-s / CAUSAL_NORM_S), rel=1e-5)
    # The same parameters as GroupNorm: version-1 and per-frame files load into it.
    assert all(isinstance(m, nn.GroupNorm) for m in norms)
    assert model.num_trainable_params() == KwsCnn(ModelConfig(width=0.25)).num_trainable_params()


@pytest.mark.slow  # two exports
def test_onnx_export_of_the_causal_norm_equals_torch_fp32_and_int8(hey_nova_wav, tmp_path):
    torch.manual_seed(3)
    model = KwsCnn(ModelConfig.context_robust(width=0.25, norm="causal")).eval()
    wave = load_audio(hey_nova_wav, 16000)
    n = model.cfg.window_samples
    windows = np.stack([wave[i : i + n] for i in range(0, wave.size - n, 2000)])
    with torch.no_grad():  # a spread of scores around 0.5, so the comparison tests something
        model.head[3].weight.mul_(10.0)
        logits = model(torch.from_numpy(windows))
        model.head[3].bias[1] -= (logits[:, 1] - logits[:, 0]).mean()
        expected = model.predict_proba(torch.from_numpy(windows)).numpy()
    assert expected.std() > 1e-3, expected
    fp32 = OnnxScorer(export_onnx(model, tmp_path / "causal.onnx"))
    np.testing.assert_allclose(fp32.score(windows), expected, atol=1e-5)
    int8 = export_onnx(model, tmp_path / "causal-int8.onnx", int8=True, calibration_windows=windows)
    # Looser than the per-frame norm's 0.02: an onset keeps its level against the pause
    # before it, so the maps span a wider range for the same 8 bits (a model that ships
    # is held to decision agreement on the calibration set, models/kws_cnn/quantize.py).
    np.testing.assert_allclose(OnnxScorer(int8).score(windows), expected, atol=0.05)
