"""The wake-word CNN: frontend against librosa, size and layer budget, flat parameters,
safetensors checkpoints and their mismatch refusal."""

from __future__ import annotations

import dataclasses
import json

import librosa
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from wakefl.edge_runtime import load_audio
from wakefl.errors import ConfigError, NonFiniteError
from wakefl.models.kws_cnn import (
    KwsCnn,
    ModelConfig,
    get_flat_params,
    head_slice,
    load_model,
    save_model,
    set_flat_params,
)
from wakefl.models.kws_cnn.frontend import LOG_FLOOR, LogMelFrontend

# Max absolute difference of log-mel values (natural log of power) between torchaudio in
# float32 and librosa in float64: 1e-3 is a 0.1 % difference in mel power.
LOG_MEL_TOL = 1e-3


def test_frontend_matches_librosa_on_speech(hey_nova_wav):
    cfg = ModelConfig()
    y = load_audio(hey_nova_wav, cfg.sample_rate)[: cfg.window_samples]
    assert y.size == cfg.window_samples and np.abs(y).max() > 0.1
    ours = LogMelFrontend(cfg)(torch.from_numpy(y)[None])[0].numpy()
    mel = librosa.feature.melspectrogram(
        y=y.astype(np.float64),
        sr=cfg.sample_rate,
        n_fft=cfg.n_fft,
        win_length=cfg.win_length,
        hop_length=cfg.hop_length,
        center=True,
        pad_mode="reflect",
        power=2.0,
        n_mels=cfg.n_mels,
        fmin=cfg.f_min,
        fmax=cfg.sample_rate / 2,
        htk=False,
        norm="slaney",
    )
    ref = np.log(mel + LOG_FLOOR)
    assert ours.shape == ref.shape == (cfg.n_mels, cfg.n_frames)
    assert np.abs(ours - ref).max() <= LOG_MEL_TOL
    # The spectrogram is not degenerate: speech spans a wide log range.
    assert ref.max() - ref.min() > 10


def test_default_size_and_layer_budget():
    model = KwsCnn(ModelConfig())
    n = model.num_trainable_params()
    assert 2_500_000 <= n <= 3_500_000
    counts = model.layer_counts()
    assert counts["conv_layers"] + counts["pool_layers"] == 11
    assert ModelConfig().window_samples == 24000
    small = KwsCnn(ModelConfig(width=0.25))
    assert small.num_trainable_params() < n / 8
    assert sum(small.layer_counts().values()) == 11


def test_forward_shapes_and_probabilities(tiny_kws_model):
    x = torch.randn(3, tiny_kws_model.cfg.window_samples) * 0.1
    with torch.no_grad():
        logits = tiny_kws_model(x)
        p = tiny_kws_model.predict_proba(x)
    assert logits.shape == (3, 2) and p.shape == (3,)
    assert torch.allclose(p, torch.softmax(logits, -1)[:, 1])
    assert ((p >= 0) & (p <= 1)).all()


def test_state_is_only_trainable_parameters():
    model = KwsCnn(ModelConfig(width=0.25))
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert list(model.frontend.parameters()) == []
    buffers = {name for name, _ in model.named_buffers()}
    assert buffers and all(name.startswith("frontend.") for name in buffers)
    names = [name for name, _ in model.named_parameters()]
    assert names[-4:] == ["head.1.weight", "head.1.bias", "head.3.weight", "head.3.bias"]


def test_flat_params_round_trip_and_head_slice():
    torch.manual_seed(0)
    a, b = KwsCnn(ModelConfig(width=0.25)), KwsCnn(ModelConfig(width=0.25))
    va = get_flat_params(a)
    assert va.shape == (a.num_trainable_params(),) and va.dtype == torch.float32
    va_copy = va.clone()
    va.zero_()  # a detached copy: the model is untouched
    assert torch.equal(get_flat_params(a), va_copy)
    set_flat_params(b, va_copy)
    x = torch.randn(2, a.cfg.window_samples) * 0.1
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    hs = head_slice(a)
    head = torch.cat([p.detach().reshape(-1) for p in a.head.parameters()])
    assert hs.stop == va_copy.numel()
    assert torch.equal(va_copy[hs], head)


def test_set_flat_params_validates():
    model = KwsCnn(ModelConfig(width=0.25))
    v = get_flat_params(model)
    with pytest.raises(ConfigError, match="entries"):
        set_flat_params(model, v[:-1])
    bad = v.clone()
    bad[7] = float("nan")
    with pytest.raises(NonFiniteError):
        set_flat_params(model, bad)
    assert torch.equal(get_flat_params(model), v)


def test_config_json_round_trip():
    cfg = ModelConfig(width=0.5, n_mels=32)
    again = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.window_samples == 24000
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.width = 1.0  # type: ignore[misc]
    with pytest.raises(ConfigError, match="unknown model config field"):
        ModelConfig.from_dict({**cfg.to_dict(), "depth": 3})
    with pytest.raises(ConfigError, match="version"):
        ModelConfig(version=99)


def test_save_load_round_trip(tmp_path, tiny_kws_model):
    path = save_model(tiny_kws_model, tmp_path / "m.safetensors")
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["architecture"] == "kws_cnn"
    assert meta["trainable_params"] == tiny_kws_model.num_trainable_params()
    assert meta["config"]["width"] == 0.25
    loaded = load_model(path)
    assert loaded.cfg == tiny_kws_model.cfg
    assert torch.equal(get_flat_params(loaded), get_flat_params(tiny_kws_model))
    x = torch.randn(2, 24000) * 0.1
    with torch.no_grad():
        assert torch.equal(loaded.predict_proba(x), tiny_kws_model.predict_proba(x))


def test_load_refuses_mismatch(tmp_path, tiny_kws_model):
    path = save_model(tiny_kws_model, tmp_path / "m.safetensors")
    cpath = path.with_suffix(".json")
    meta = json.loads(cpath.read_text())

    # Config says a different width than the weights.
    cpath.write_text(json.dumps({**meta, "config": {**meta["config"], "width": 0.5}}))
    with pytest.raises(ConfigError, match="wrong shape"):
        load_model(path)
    # Unknown version.
    cpath.write_text(json.dumps({**meta, "version": 7}))
    with pytest.raises(ConfigError, match="unknown model version"):
        load_model(path)
    cpath.write_text(json.dumps(meta))

    tensors = load_file(str(path))
    missing = dict(tensors)
    missing.pop("head.3.bias")
    save_file(missing, str(path))
    with pytest.raises(ConfigError, match=r"missing \['head.3.bias'\]"):
        load_model(path)
    save_file({**tensors, "extra.weight": torch.zeros(3)}, str(path))
    with pytest.raises(ConfigError, match="unexpected"):
        load_model(path)

    path.write_bytes(b"not safetensors at all")
    with pytest.raises(ConfigError, match="safetensors"):
        load_model(path)
    cpath.unlink()
    with pytest.raises(ConfigError, match="not found"):
        load_model(path)


def test_widening_preserves_the_function_and_noise_breaks_the_symmetry(hey_nova_wav):
    from wakefl.models.kws_cnn.widen import widen

    torch.manual_seed(0)
    narrow = KwsCnn(ModelConfig(width=0.25)).eval()
    # Trained-looking GroupNorm affines, so the copy of every parameter kind is exercised.
    with torch.no_grad():
        for p in narrow.parameters():
            p.add_(0.1 * torch.randn_like(p))
    wave = torch.from_numpy(load_audio(hey_nova_wav))[: narrow.cfg.window_samples][None]
    wave = torch.cat([wave, 0.05 * torch.randn_like(wave)])
    wide = widen(narrow, 1.0).eval()
    assert wide.cfg.width == 1.0 and wide.num_trainable_params() > 10 * 10**5
    torch.testing.assert_close(wide(wave), narrow(wave), rtol=1e-4, atol=1e-4)
    noisy = widen(narrow, 1.0, noise=0.02, generator=torch.Generator().manual_seed(1)).eval()
    conv = next(m for m in noisy.features if isinstance(m, torch.nn.Conv2d))
    # Copies of one narrow channel differ once noise is added (else they would train alike).
    assert not torch.equal(conv.weight[0], conv.weight[1])
    with pytest.raises(ConfigError, match="cannot widen"):
        widen(wide, 0.25)


def test_blending_interpolates_every_parameter_and_refuses_a_mismatch(tmp_path, capsys):
    from wakefl.models.kws_cnn.blend import blend
    from wakefl.tools.cli import main

    torch.manual_seed(0)
    first, second = KwsCnn(ModelConfig(width=0.25)), KwsCnn(ModelConfig(width=0.25))
    with torch.no_grad():
        for p in second.parameters():
            p.add_(0.1 * torch.randn_like(p))
    wave = 0.1 * torch.randn(2, first.cfg.window_samples)
    first.eval(), second.eval()
    torch.testing.assert_close(blend(first, second, 0.0)(wave), first(wave))
    torch.testing.assert_close(blend(first, second, 1.0)(wave), second(wave))
    # A quarter of the way: every parameter, GroupNorm affines included.
    torch.testing.assert_close(
        get_flat_params(blend(first, second, 0.25)),
        0.75 * get_flat_params(first) + 0.25 * get_flat_params(second),
    )
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="in \\[0, 1\\]"):
            blend(first, second, bad)
    with pytest.raises(ConfigError, match="different configs"):
        blend(first, KwsCnn(ModelConfig(width=0.5)), 0.5)
    with torch.no_grad():
        next(second.parameters()).fill_(float("inf"))
    with pytest.raises(ConfigError, match="not finite"):
        blend(first, second, 0.5)

    a, b = save_model(first, tmp_path / "a.safetensors"), tmp_path / "b.safetensors"
    torch.manual_seed(1)
    save_model(KwsCnn(ModelConfig(width=0.25)), b)
    out = tmp_path / "mix.safetensors"
    args = ["model", "blend", "--first", str(a), "--second", str(b), "--out", str(out)]
    assert main([*args, "--alpha", "0.5"]) == 0
    mixed = get_flat_params(load_model(out))
    expected = (get_flat_params(load_model(a)) + get_flat_params(load_model(b))) / 2
    torch.testing.assert_close(mixed, expected)
    assert main([*args, "--alpha", "2"]) == 2
    assert "in [0, 1]" in capsys.readouterr().err


def test_a_soup_is_the_share_weighted_average_of_its_models_and_refuses_bad_shares(
    tmp_path, capsys
):
    from wakefl.models.kws_cnn.blend import average, blend
    from wakefl.tools.cli import main

    torch.manual_seed(2)
    models = [KwsCnn(ModelConfig(width=0.25)).eval() for _ in range(3)]
    flats = [get_flat_params(m) for m in models]
    torch.testing.assert_close(
        get_flat_params(average(models, [0.5, 0.3, 0.2])),
        0.5 * flats[0] + 0.3 * flats[1] + 0.2 * flats[2],
    )
    # Two models with shares (1 - a, a) make the blend; one model alone is itself.
    torch.testing.assert_close(
        get_flat_params(average(models[:2], [0.75, 0.25])),
        get_flat_params(blend(models[0], models[1], 0.25)),
    )
    wave = 0.1 * torch.randn(2, models[0].cfg.window_samples)
    torch.testing.assert_close(average(models[1:2], [1.0])(wave), models[1](wave))
    bad_shares = {
        "one share per model": [0.5, 0.5],
        "sum to 1": [0.5, 0.3, 0.3],
        ">= 0": [1.2, -0.1, -0.1],
        "finite": [float("nan"), 0.5, 0.5],
    }
    for message, shares in bad_shares.items():
        with pytest.raises(ConfigError, match=message):
            average(models, shares)
    with pytest.raises(ConfigError, match="one share per model"):
        average([], [])
    with pytest.raises(ConfigError, match="different configs"):
        average([models[0], KwsCnn(ModelConfig(width=0.5))], [0.5, 0.5])
    with torch.no_grad():
        next(models[2].parameters()).fill_(float("nan"))
    with pytest.raises(ConfigError, match="not finite"):
        average(models, [0.4, 0.4, 0.2])

    files = [save_model(m, tmp_path / f"m{i}.safetensors") for i, m in enumerate(models[:2])]
    files.append(save_model(KwsCnn(ModelConfig(width=0.25)), tmp_path / "m2.safetensors"))
    out = tmp_path / "soup.safetensors"
    args = ["model", "soup", "--models", *map(str, files), "--out", str(out)]
    assert main(args) == 0  # equal shares by default
    expected = sum(get_flat_params(load_model(f)) for f in files) / 3
    torch.testing.assert_close(get_flat_params(load_model(out)), expected)
    assert main([*args, "--shares", "0.5", "0.5"]) == 2
    assert "one share per model" in capsys.readouterr().err
