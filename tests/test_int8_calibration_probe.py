"""The int8 export's calibration method, and the probe that compares calibrations: a
percentile calibration reads narrower activation ranges than min-max from the same windows, an
unknown method is refused before any export, and the probe counts on a real corpus and the
shipped `small` what int8 changes, the same for every run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from wakefl.edge_runtime import OnnxScorer
from wakefl.errors import ConfigError
from wakefl.models.kws_cnn import export_onnx
from wakefl.models.kws_cnn.pretrained import pretrained_card
from wakefl.models.kws_cnn.quantize import (
    CALIBRATION_METHODS,
    quantize_int8,
    synthetic_calibration_windows,
)
from wakefl.tools.probes import int8_calibration


def _activation_scales(path: Path) -> dict[str, float]:
    """The scales of the activations' QuantizeLinear nodes (weights are per channel)."""
    graph = onnx.load(str(path)).graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    return {
        n.input[0]: float(inits[n.input[1]])
        for n in graph.node
        if n.op_type == "QuantizeLinear" and inits[n.input[1]].size == 1
    }


@pytest.mark.slow  # three int8 exports
def test_a_percentile_calibration_reads_other_ranges_and_stays_close_to_fp32(
    tiny_kws_model, tmp_path
):
    cfg = tiny_kws_model.cfg
    windows = synthetic_calibration_windows(cfg.window_samples, cfg.sample_rate, n=12, seed=3)
    paths = {
        m: export_onnx(
            tiny_kws_model, tmp_path / f"{m}.onnx", int8=True, calibration_windows=windows,
            calibration_method=m,
        )
        for m in CALIBRATION_METHODS
    }  # fmt: skip
    minmax, pct = (_activation_scales(paths[m]) for m in ("minmax", "percentile"))
    assert minmax.keys() == pct.keys() and minmax
    # The same windows, another reading of them: the 99.999th percentile of each
    # activation's histogram, inside its extremes (a method ignored would give equal scales).
    assert all(pct[k] <= minmax[k] * (1 + 1e-6) for k in minmax)
    assert sum(pct[k] < minmax[k] * (1 - 1e-5) for k in minmax) > len(minmax) / 2
    fp32 = OnnxScorer(export_onnx(tiny_kws_model, tmp_path / "fp32.onnx"))
    probe = synthetic_calibration_windows(cfg.window_samples, cfg.sample_rate, n=12, seed=4)
    for path in paths.values():  # an untrained model on other windows: close on average
        assert np.abs(OnnxScorer(path).score(probe) - fp32.score(probe)).mean() < 0.05


@pytest.mark.parametrize("method", ["entropy", "", "MINMAX"])
def test_an_unknown_calibration_method_is_refused_before_any_file_is_written(
    tiny_kws_model, tmp_path, method
):
    with pytest.raises(ConfigError, match="calibration method must be one of minmax"):
        export_onnx(tiny_kws_model, tmp_path / "m.onnx", int8=True, calibration_method=method)
    with pytest.raises(ConfigError, match="calibration method"):
        quantize_int8(tmp_path / "none.onnx", tmp_path / "q.onnx", np.zeros((1, 4)), method)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # a corpus, and eight exports of the shipped small model
def test_the_probe_counts_what_int8_changes_the_same_every_run(
    pretrain_micro_corpus: Path, tmp_path: Path, capsys
) -> None:
    args = ["--corpus", str(pretrain_micro_corpus.parent), "--clips", "6"]
    args += ["--model", "small=pretrained:small", "--model", "strict=pretrained:small@0.999"]
    assert int8_calibration.main([*args, "--json", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    assert (
        f"| small ({pretrained_card('small')['threshold']:.4f}," in out
        and "| shipped-stream, percentile |" in out
    )
    result = json.loads((tmp_path / "a.json").read_text())
    assert result["models"]["small"]["weights"].endswith("small.safetensors")
    for model in result["models"].values():
        rows = model["calibrations"]
        assert set(rows) == {f"{c}, {m}" for c in int8_calibration.CALIBRATIONS
                             for m in CALIBRATION_METHODS}  # fmt: skip
        for row in rows.values():
            assert row["windows"] == 12 and 0 <= row["differ"] <= 12
            assert row["differ"] == (
                row["phrases_missed_anew"] + row["phrases_detected_anew"] + row["negatives_differ"]
            )
            assert 0 <= row["median_logit_change"] <= row["p95_logit_change"]
            assert row["held_out_stream"]["windows"] > 8  # 8 windows, every 0.1 s
        assert 0 <= model["near_threshold"] <= 12
    # The same clips and exports for every model: only the threshold differs.
    small, strict = (result["models"][k]["calibrations"] for k in ("small", "strict"))
    for name, row in small.items():
        assert strict[name]["median_logit_change"] == row["median_logit_change"]
    # And for every run: the min-max exports again, alone, give the same rows.
    again = [*args, "--methods", "minmax", "--json", str(tmp_path / "b.json")]
    assert int8_calibration.main(again) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["models"]["small"]["calibrations"]
    assert rows == {k: v for k, v in small.items() if k.endswith(", minmax")}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--clips", "0"], "--clips must be"),
        (["--methods", "entropy"], "calibration method"),
        (["--model", "x=pretrained:small@1.5"], "not in \\[0, 1\\]"),
    ],
)
def test_absurd_arguments_are_refused_before_any_audio(tmp_path, extra, message):
    (tmp_path / "manifest.csv").write_text("path,label,device_type,state,speaker,split\n")
    argv = ["--corpus", str(tmp_path), "--model", "s=pretrained:small", *extra]
    with pytest.raises(ConfigError, match=message):
        int8_calibration.main(argv)
