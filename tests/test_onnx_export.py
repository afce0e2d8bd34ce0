"""ONNX export: one self-contained file with metadata, dynamic batch, onnxruntime against
torch on real speech, and the int8 variant's agreement with fp32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from wakefl.edge_runtime import OnnxScorer, load_audio
from wakefl.errors import ConfigError
from wakefl.models.kws_cnn import export_onnx
from wakefl.models.kws_cnn.frontend import DftLogMelFrontend
from wakefl.models.kws_cnn.quantize import frontend_convs
from wakefl.tools.cli import main

PROB_TOL = 1e-4


@pytest.fixture(scope="module")
def speech_windows(hey_nova_wav) -> np.ndarray:
    """Windows every 100 ms over decoded espeak-ng speech, quiet lead-in and a quieter
    repetition, so the model sees speech, silence and levels in between."""
    x = load_audio(hey_nova_wav, 16000)
    x = np.concatenate([np.zeros(8000, np.float32), x, 0.3 * x])
    return np.stack([x[i : i + 24000] for i in range(0, x.size - 24000 + 1, 1600)])


def test_single_file_with_metadata(tiny_kws_onnx):
    assert not tiny_kws_onnx.with_name(tiny_kws_onnx.name + ".data").exists()
    proto = onnx.load(str(tiny_kws_onnx))  # loads only if self-contained
    onnx.checker.check_model(proto)
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["sample_rate"] == "16000" and meta["window_samples"] == "24000"
    assert meta["precision"] == "fp32" and meta["hop_length"] == "160"
    assert json.loads(meta["model_config"])["width"] == 0.25
    assert any(op.domain in ("", "ai.onnx") and op.version == 18 for op in proto.opset_import)


def test_onnxruntime_matches_torch_on_speech(tiny_kws_model, tiny_kws_onnx, speech_windows):
    scorer = OnnxScorer(tiny_kws_onnx)
    assert (scorer.sample_rate, scorer.window_samples) == (16000, 24000)
    ort_p = scorer.score(speech_windows)  # dynamic batch: all windows at once
    with torch.no_grad():
        torch_p = tiny_kws_model.predict_proba(torch.from_numpy(speech_windows)).numpy()
    assert ort_p.shape == (len(speech_windows),)
    # Probabilities spread out, so agreement is not trivial.
    assert torch_p.std() > 0.1
    assert np.abs(ort_p - torch_p).max() <= PROB_TOL
    single = np.array([scorer.score(w[None])[0] for w in speech_windows[:5]])
    assert np.abs(single - torch_p[:5]).max() <= PROB_TOL


def test_int8_size_and_agreement(tiny_kws_model, tiny_kws_onnx, speech_windows, tmp_path):
    int8_path = export_onnx(
        tiny_kws_model,
        tmp_path / "tiny_int8.onnx",
        int8=True,
        calibration_windows=speech_windows[::3],
    )
    assert not (tmp_path / "tiny_int8.onnx.data").exists()
    fp32_size, int8_size = tiny_kws_onnx.stat().st_size, int8_path.stat().st_size
    assert int8_size < 0.6 * fp32_size
    q = OnnxScorer(int8_path)
    assert q.metadata["precision"] == "int8" and q.window_samples == 24000
    p32 = OnnxScorer(tiny_kws_onnx).score(speech_windows)
    p8 = q.score(speech_windows)
    apart = (p32 >= 0.5) != (p8 >= 0.5)
    logits = [np.log(np.clip(p, 1e-6, 1 - 1e-6) / np.clip(1 - p, 1e-6, 1)) for p in (p32, p8)]
    corr = float(np.corrcoef(*logits)[0, 1])
    print(
        f"\nint8: {int8_size} B vs fp32 {fp32_size} B; decisions differ at 0.5 on "
        f"{apart.mean():.1%} of {len(p32)} windows; logit correlation {corr:.3f}"
    )
    # This seeded random model puts a fifth of its windows within 0.1 of 0.5, so how many
    # flip says little; a rounding error flips only windows near the threshold, a broken
    # kernel (u8s8 saturating without VNNI: a flip 0.44 away, correlation 0.88) does not.
    assert corr >= 0.95
    assert np.abs(p32[apart] - 0.5).max(initial=0.0) <= 0.15


def test_a_waveform_export_runs_its_stft_as_a_float_dft_convolution(
    tiny_kws_model, speech_windows, tmp_path
):
    calib = speech_windows[::3]
    path = export_onnx(
        tiny_kws_model, tmp_path / "w8.onnx", int8=True, calibration_windows=calib, frontend="dft"
    )
    graph = onnx.load(str(path)).graph
    assert not any(n.op_type == "STFT" for n in graph.node)
    (conv,) = frontend_convs(graph)
    # its weights are a float initializer, not the output of a DequantizeLinear
    producers = {o: n.op_type for n in graph.node for o in n.output}
    assert producers.get(next(n for n in graph.node if n.name == conv).input[1]) is None
    assert any(n.op_type == "QuantizeLinear" for n in graph.node)
    wave = OnnxScorer(path)
    assert wave.log_mel is None and wave.metadata["input"] == "wave"
    p8 = OnnxScorer(
        export_onnx(tiny_kws_model, tmp_path / "m8.onnx", int8=True, calibration_windows=calib)
    )
    # the same int8 model behind another frontend: equal but where an activation's
    # rounding tips over (one or two windows of 55, amplified by the scaled-up head)
    gap = np.abs(wave.score(speech_windows) - p8.score(speech_windows))
    assert np.median(gap) < 1e-3 and np.mean(gap > 0.01) <= 0.05 and gap.max() < 0.15
    dft = DftLogMelFrontend(tiny_kws_model.frontend)
    x = torch.from_numpy(speech_windows)
    with torch.no_grad():
        ref, got = tiny_kws_model.frontend(x), dft(x)
    assert got.shape == ref.shape
    # log-mel over speech and silence (log floor): equal to float rounding
    assert float((got - ref).abs().max()) < 1e-3
    assert float((got - ref).abs().mean()) < 1e-5
    assert not any(k in ("basis", "fb") for k in tiny_kws_model.state_dict())


def test_export_refuses_bad_output(tiny_kws_model, tmp_path):
    with pytest.raises(ConfigError, match=".onnx"):
        export_onnx(tiny_kws_model, tmp_path / "m.bin")
    with pytest.raises(ConfigError, match="calibration"):
        export_onnx(
            tiny_kws_model,
            tmp_path / "m.onnx",
            int8=True,
            calibration_windows=np.zeros((2, 100), np.float32),
        )


def test_cli_model_info_and_export(tmp_path, tiny_kws_model, capsys):
    # In-process: the exporter import is already paid for by the fixtures.
    assert main(["model", "info", "--width", "0.25", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["trainable_params"] == tiny_kws_model.num_trainable_params()
    assert d["conv_layers"] + d["pool_layers"] == 11 and d["window_samples"] == 24000

    out = tmp_path / "cli.onnx"
    argv = ["model", "export", "--width", "0.25", "--out", str(out), "--json"]
    # an untrained model is exported only when asked by name
    assert main(argv) == 2 and "--random-weights" in capsys.readouterr().err
    assert not out.exists()
    assert main([*argv, "--random-weights"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes"] == out.stat().st_size
    assert OnnxScorer(out).score(np.zeros((2, 24000), np.float32)).shape == (2,)

    rc = main(
        [
            "model",
            "export",
            "--weights",
            str(tmp_path / "nope.safetensors"),
            "--out",
            str(tmp_path / "x.onnx"),
        ]
    )
    err = capsys.readouterr().err
    assert rc != 0 and "not found" in err and "Traceback" not in err


def test_export_carries_the_threshold_of_the_weights_card(tiny_kws_model, tmp_path, capsys):
    from wakefl.models.kws_cnn import save_model

    weights = save_model(tiny_kws_model, tmp_path / "tuned.safetensors")
    card = {"threshold": 0.8125, "hop_s": 0.1, "smoothing": 3, "refractory_s": 1.0}
    weights.with_suffix(".card.json").write_text(json.dumps(card))
    out = tmp_path / "tuned.onnx"
    assert main(["model", "export", "--weights", str(weights), "--out", str(out)]) == 0
    assert "shipped threshold 0.8125" in capsys.readouterr().out
    proto = onnx.load(str(out))
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["shipped_threshold"]) == 0.8125 and json.loads(meta["smoothing"]) == 3
    assert "tuned.safetensors" in meta["threshold_source"]
    assert json.loads(out.with_suffix(".json").read_text())["shipped_threshold"] == 0.8125
    assert OnnxScorer(out).shipped_threshold == 0.8125
    # no file path of the exporting machine in the node metadata (the exporter's traces)
    root = str(Path(__file__).resolve().parents[1])
    values = [p.value for n in proto.graph.node for p in n.metadata_props]
    assert values and not any(root in v or 'File "' in v for v in values)


def test_shipped_models_are_recognised_and_a_fine_tune_takes_its_baselines_threshold():
    from wakefl.models.kws_cnn import get_flat_params, set_flat_params
    from wakefl.models.kws_cnn.operating_point import for_model, shipped_name
    from wakefl.models.kws_cnn.pretrained import load_pretrained, pretrained_card

    small = load_pretrained("small")
    assert shipped_name(small) == "small"
    point = for_model(small)
    assert point is not None and point.threshold == pretrained_card("small")["threshold"]
    tuned = load_pretrained("small")
    set_flat_params(tuned, get_flat_params(tuned) * 1.001)
    assert shipped_name(tuned) is None and for_model(tuned) is None
    noted = for_model(tuned, small, "the personalized model of round 2")
    assert noted is not None and noted.threshold == point.threshold
    assert "baseline" in noted.source and "round 2 was not tuned" in noted.source
