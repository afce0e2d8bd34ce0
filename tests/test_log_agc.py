"""The log-domain AGC (`gain_norm="log_agc"`): PCEN's gain stage alone, which is the log-mel
itself at gain_alpha 0, so trained log-mel weights can be moved over to it a little at a
time. Its torch form against the numpy reference, its export, its config, and the ramp
that pretraining raises gain_alpha by."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from wakefl.edge_runtime import OnnxScorer, load_audio
from wakefl.edge_runtime.gain_norm import log_agc
from wakefl.edge_runtime.log_mel import LogMel, LogMelSpec
from wakefl.errors import ConfigError
from wakefl.models.kws_cnn import KwsCnn, ModelConfig, export_onnx, load_model, save_model
from wakefl.models.kws_cnn.frontend import LOG_FLOOR
from wakefl.models.kws_cnn.gain_norm import LogAgc
from wakefl.tools.training.pretrain_flags import register_pretrain
from wakefl.tools.training.settings import (
    PretrainSettings,
    gain_alpha_at,
    model_config,
    settings_from_flags,
)

AGC_ARCH = "v2,norm=group,gain_norm=log_agc,first_time_pool=3"


def _log_mel(hey_nova_wav: Path, gain: np.ndarray | float = 1.0) -> np.ndarray:
    cfg = ModelConfig()
    wave = load_audio(hey_nova_wav, 16000)[: cfg.window_samples].astype(np.float32) * gain
    spec = LogMelSpec(16000, cfg.window_samples, cfg.n_fft, cfg.win_length, cfg.hop_length,
                      cfg.n_mels, cfg.f_min, 8000.0, LOG_FLOOR)  # fmt: skip
    return LogMel(spec)(wave[None].astype(np.float32))


def _agc_model(alpha: float, seed: int = 3) -> KwsCnn:
    torch.manual_seed(seed)
    model = KwsCnn(model_config(f"{AGC_ARCH},gain_alpha={alpha}", 0.25)).eval()
    with torch.no_grad():  # a spread of scores, so comparisons test something
        model.head[3].weight.mul_(20.0)
    return model


def test_log_agc_torch_equals_the_numpy_reference(hey_nova_wav):
    log_mel = _log_mel(hey_nova_wav)
    for alpha in (0.3, 0.98):
        ours = LogAgc(log_mel.shape[-1], alpha)(torch.from_numpy(log_mel))[0].numpy()
        ref = log_agc(log_mel, alpha)[0]
        np.testing.assert_allclose(ours, ref, atol=1e-4)
        assert np.abs(ref - log_mel[0]).max() > 1.0  # it changed something


def test_at_alpha_0_it_is_the_log_mel_and_scores_as_the_same_weights_without_it(hey_nova_wav):
    log_mel = torch.from_numpy(_log_mel(hey_nova_wav))
    torch.testing.assert_close(LogAgc(log_mel.shape[-1], 0.0)(log_mel), log_mel)
    agc = _agc_model(0.0)
    plain = KwsCnn(dataclasses.replace(agc.cfg, gain_norm="none", gain_alpha=0.98)).eval()
    plain.load_state_dict(agc.state_dict())  # no parameters of its own
    with torch.no_grad():
        torch.testing.assert_close(agc.classify(log_mel), plain.classify(log_mel))
        agc.set_gain_alpha(0.98)
        assert not torch.allclose(agc.classify(log_mel), plain.classify(log_mel))
    assert agc.cfg.gain_alpha == 0.98 and agc.gain_norm.alpha == 0.98


def test_log_agc_takes_out_a_gain_that_changes_over_time(hey_nova_wav):
    """A 20 dB ramp over the window moves the log-mel by up to 4.6 nats; at alpha 0.98 each
    channel is measured against its own recent level, so the speech moves far less."""
    frames = ModelConfig().n_frames
    ramp = np.geomspace(0.1, 1.0, ModelConfig().window_samples).astype(np.float32)
    a, b = _log_mel(hey_nova_wav, 0.1), _log_mel(hey_nova_wav, ramp)
    speech = a[0] > np.log(LOG_FLOOR) + 8
    agc = LogAgc(frames, 0.98)
    pa, pb = (agc(torch.from_numpy(x))[0].numpy() for x in (a, b))
    log_change = float(np.abs(b - a)[0][speech].mean())
    agc_change = float(np.abs(pb - pa)[speech].mean())
    assert log_change > 1.0 and agc_change < 0.5 * log_change


def test_onnx_export_of_a_log_agc_model_equals_torch_fp32_and_int8(hey_nova_wav, tmp_path):
    model = _agc_model(0.7)
    wave = load_audio(hey_nova_wav, 16000)
    n = model.cfg.window_samples
    windows = np.stack([wave[i : i + n] for i in range(0, wave.size - n, 2000)])
    with torch.no_grad():  # scores centred on 0.5, so the windows' spread shows in them
        odds = model(torch.from_numpy(windows)).diff(dim=1)[:, 0]
        model.head[3].bias[1] -= float(odds.median())
        expected = model.predict_proba(torch.from_numpy(windows)).numpy()
    assert expected.max() - expected.min() > 0.1
    fp32 = OnnxScorer(export_onnx(model, tmp_path / "agc.onnx"))
    np.testing.assert_allclose(fp32.score(windows), expected, atol=1e-5)
    config = json.loads(fp32.metadata["model_config"])
    assert (config["gain_norm"], config["gain_alpha"]) == ("log_agc", 0.7)
    path = export_onnx(model, tmp_path / "agc-int8.onnx", int8=True, calibration_windows=windows)
    # The head's gain (x20) shows int8's rounding twenty times over: a bound, not equality.
    np.testing.assert_allclose(OnnxScorer(path).score(windows), expected, atol=0.05)


def test_gain_alpha_is_checked_and_named_only_where_it_applies(tmp_path):
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ConfigError, match="gain_alpha"):
            ModelConfig.context_robust(gain_norm="log_agc", gain_alpha=bad)
    with pytest.raises(ConfigError, match="log_agc only"):
        ModelConfig.context_robust(gain_norm="pcen", gain_alpha=0.5)
    with pytest.raises(ConfigError, match="a number"):
        model_config(f"{AGC_ARCH},gain_alpha=high", 0.25)
    # Files of the other gain norms stay what they were.
    assert "gain_alpha" not in ModelConfig.context_robust().to_dict()
    assert "gain_alpha" not in ModelConfig().to_dict()
    model = _agc_model(0.25)
    save_model(model, tmp_path / "agc.safetensors")
    back = load_model(tmp_path / "agc.safetensors")
    assert back.cfg == model.cfg and back.gain_norm.alpha == 0.25
    with pytest.raises(ConfigError, match="log_agc"):
        KwsCnn(ModelConfig.context_robust()).set_gain_alpha(0.5)


@pytest.mark.parametrize(
    ("ramp", "step", "alpha"),
    [(0, 0, 0.98), (3200, 0, 0.0098), (3200, 49, 0.49), (3200, 99, 0.98), (3200, 5000, 0.98)],
)
def test_the_ramp_raises_gain_alpha_linearly_to_its_target(ramp, step, alpha):
    s = PretrainSettings(batch_size=32, gain_ramp_samples=ramp, arch=AGC_ARCH)
    assert gain_alpha_at(step, s, 0.98) == pytest.approx(alpha)


def _flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register_pretrain(parser.add_subparsers(dest="cmd"), lambda args: 0)
    return parser.parse_args(["pretrain", "--corpus", "m.csv", "--out", "run", *argv])


def test_a_ramp_is_refused_without_a_log_agc_model():
    with pytest.raises(ConfigError, match="gain-ramp-samples"):
        settings_from_flags(_flags("--arch", "v2,gain_norm=pcen", "--gain-ramp-samples", "64"))
    with pytest.raises(ConfigError, match="gain-ramp-samples"):
        settings_from_flags(_flags("--arch", AGC_ARCH, "--gain-ramp-samples", "-1"))
    s = settings_from_flags(_flags("--arch", AGC_ARCH, "--gain-ramp-samples", "64"))
    assert s.gain_ramp_samples == 64


@pytest.mark.slow
def test_a_ramped_run_saves_each_checkpoint_with_the_alpha_it_computes(
    pretrain_micro_corpus: Path, tmp_path: Path
) -> None:
    """From log-mel weights, over a ramp longer than the run: the last checkpoint says the
    gain_alpha its weights were trained at, and a resumed run reaches the same weights."""
    from micro_training import SETTINGS
    from safetensors.torch import load_file

    from wakefl.tools.training.pretrain import pretrain
    from wakefl.tools.training.settings import LAST, STATE_WEIGHTS

    torch.manual_seed(0)
    save_model(
        KwsCnn(model_config("v2,norm=group,gain_norm=none", 0.25)), tmp_path / "w.safetensors"
    )
    s = dataclasses.replace(
        SETTINGS, samples=16 * 4, eval_every_steps=2, warmup_steps=1, workers=0,
        arch=AGC_ARCH, gain_ramp_samples=16 * 8,
    )  # fmt: skip
    start = tmp_path / "w.safetensors"
    pretrain(pretrain_micro_corpus, tmp_path / "whole", s, init_from=start, progress=False)
    last = load_model(tmp_path / "whole" / LAST)
    assert last.cfg.gain_alpha == pytest.approx(0.98 * 4 / 8)
    pretrain(pretrain_micro_corpus, tmp_path / "parts", s, init_from=start, progress=False,
             max_steps=1)  # fmt: skip
    assert load_model(tmp_path / "parts" / LAST).cfg.gain_alpha == pytest.approx(0.98 / 8)
    pretrain(pretrain_micro_corpus, tmp_path / "parts", s, progress=False, resume=True)
    a = load_file(str(tmp_path / "whole" / STATE_WEIGHTS))
    b = load_file(str(tmp_path / "parts" / STATE_WEIGHTS))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
