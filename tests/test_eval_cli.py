"""`wakefl eval` on the tiny corpus with small models exported to ONNX (and one safetensors
checkpoint): an identical candidate gives exactly 1, the JSON schema, the report files, the
streaming FA/hour count, and a clear error for every kind of bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from wakefl.edge_runtime import detect_audio
from wakefl.models.kws_cnn import KwsCnn, ModelConfig, export_onnx, save_model
from wakefl.sdk.manifest import read_manifest, write_manifest
from wakefl.sdk.wake_metrics import false_accepts_per_hour
from wakefl.tools.cli import main
from wakefl.tools.evaluation import CachedScorer, EvalSettings, stream_detections
from wakefl.tools.model_scoring import load_scorer

WIDTH = 0.125
ROW_KEYS = {
    "candidate": str, "device_type": str, "state": str, "fr": (float, type(None)),
    "fa": (float, type(None)), "fa_per_hour": (float, type(None)),
    "relative_fa": (float, type(None)), "relative_fr": (float, type(None)),
    "relative_fa_ci": list, "n_positive": int, "n_negative": int,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("eval_models")
    torch.manual_seed(0)
    base = KwsCnn(ModelConfig(width=WIDTH))
    save_model(base, d / "base.safetensors")
    export_onnx(base, d / "base.onnx")
    shutil.copy(d / "base.onnx", d / "same.onnx")
    torch.manual_seed(1)
    save_model(KwsCnn(ModelConfig(width=WIDTH)), d / "other.safetensors")
    save_model(KwsCnn(ModelConfig(width=WIDTH, n_mels=32)), d / "mels32.safetensors")
    return {
        "base": d / "base.onnx", "base_torch": d / "base.safetensors", "same": d / "same.onnx",
        "other": d / "other.safetensors", "mels32": d / "mels32.safetensors",
    }


def _eval(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["eval", "--quiet", "--n-boot", "40", "--hop-s", "0.5", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _no_nan(text: str) -> dict:
    def refuse(token: str):
        raise AssertionError(f"non-finite number {token} in JSON")

    return json.loads(text, parse_constant=refuse)


def test_eval_identical_candidate_schema_and_report(models, tiny_corpus, tmp_path, capsys):
    report = tmp_path / "report"
    rc, out, err = _eval(
        capsys, "--baseline", str(models["base"]), "--candidate", str(models["same"]),
        "--candidate", str(models["other"]), "--manifest", str(tiny_corpus), "--json",
        "--report", str(report),
    )
    assert rc == 0, err
    rows = _no_nan(out)["rows"]
    manifest = read_manifest(tiny_corpus)
    devices = {r.device_type for r in manifest if r.split == "test" and r.kind == "clip"}

    for row in rows:
        for key, typ in ROW_KEYS.items():
            assert isinstance(row[key], typ), (key, row[key])
        assert len(row["relative_fa_ci"]) == 2
    assert {r["candidate"] for r in rows} == {"same", "other"}
    assert {r["device_type"] for r in rows} == devices | {"all"}

    # A candidate identical to the baseline: exactly 1 everywhere something was measured.
    same = [r for r in rows if r["candidate"] == "same"]
    for r in same:
        if r["n_negative"]:
            assert r["relative_fa"] == 1.0, r
            assert r["relative_fa_ci"] == [1.0, 1.0]
        if r["n_positive"]:
            assert r["relative_fr"] == 1.0, r
        assert r["fr"] == r["baseline_fr"] and r["fa"] == r["baseline_fa"]
        assert r["fa_per_hour"] == r["baseline_fa_per_hour"]
    for d in devices | {"all"}:
        whole = next(r for r in same if r["device_type"] == d and r["state"] == "all")
        assert whole["relative_fa"] == 1.0 and whole["relative_fr"] == 1.0
        # Counts behind the figure: every test clip of the device type.
        clips = [m for m in manifest if m.split == "test" and m.kind == "clip" and (d == "all" or m.device_type == d)]
        assert whole["n_positive"] == sum(m.label for m in clips)
        assert whole["n_negative"] == sum(1 - m.label for m in clips)
        streams = [m for m in manifest if m.split == "test" and m.kind == "stream" and (d == "all" or m.device_type == d)]
        assert whole["stream_hours"] == pytest.approx(sum(m.duration_s for m in streams) / 3600)
        assert whole["fa_per_hour"] == pytest.approx(whole["false_accept_events"] / whole["stream_hours"])

    # The other candidate: its figures agree with its own counts, and its FR is matched.
    for r in (r for r in rows if r["candidate"] == "other" and r["state"] == "all"):
        if r["baseline_fa"]:
            assert r["relative_fa"] == pytest.approx(r["fa"] / r["baseline_fa"])
        assert abs(r["fr"] - r["baseline_fr"]) <= 1.0 / r["n_positive"] / 2 + 1e-12
        assert r["fr"] <= 0.05 + 1.0 / r["n_positive"]

    for d in devices | {"all"}:
        png = report / f"det_{d}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (report / "report.md").read_text()
    assert "| same | A | all |" in md and "det_A.png" in md
    html = (report / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(devices) + 1
    assert _no_nan((report / "results.json").read_text())["rows"] == rows


def test_torch_and_onnx_scorers_agree(models, tiny_corpus):
    rows = [r for r in read_manifest(tiny_corpus) if r.kind == "clip" and r.split == "test"][:6]
    from wakefl.tools.model_scoring import score_clips

    onnx = score_clips(load_scorer(models["base"]), rows, tiny_corpus.parent, progress=False)
    torch_scores = score_clips(load_scorer(models["base_torch"]), rows, tiny_corpus.parent, progress=False)
    np.testing.assert_allclose(onnx, torch_scores, atol=1e-4)


class _BurstScorer:
    """Scores a window by its peak amplitude: fires on the loud bursts of a constructed stream."""

    sample_rate = 16000
    window_samples = 24000

    def __init__(self) -> None:
        self.windows_scored = 0

    def score(self, windows: np.ndarray) -> np.ndarray:
        self.windows_scored += len(windows)
        return np.clip(np.abs(windows).max(axis=1), 0.0, 1.0).astype(np.float32)


def test_stream_false_accepts_per_hour_on_known_bursts():
    sr, seconds = 16000, 120
    rng = np.random.default_rng(0)
    wave = (0.01 * rng.standard_normal(sr * seconds)).astype(np.float32)
    burst_times = [10.0, 40.0, 41.0, 90.0]  # 40 and 41 s fall in one refractory period
    for t in burst_times:
        wave[int(t * sr) : int((t + 0.2) * sr)] = 0.9
    settings = EvalSettings(hop_s=0.25, smoothing=1, refractory_s=3.0, progress=False)
    scorer = CachedScorer(_BurstScorer())
    events = stream_detections(scorer, wave, 0.5, settings)
    assert len(events) == 3
    # Each event fires as the first window containing its burst ends.
    for ev, t in zip(events, [10.0, 40.0, 90.0], strict=True):
        assert t < ev <= t + 0.2 + settings.hop_s
    assert false_accepts_per_hour(events, seconds / 3600) == pytest.approx(90.0)
    # A second pass at another threshold is answered from the cache, with the same result
    # as the uncached detector.
    scored = scorer.inner.windows_scored
    again = stream_detections(scorer, wave, 0.95, settings)
    assert scorer.inner.windows_scored == scored and again == []
    direct = detect_audio(_BurstScorer(), wave, hop_s=0.25, threshold=0.5, smoothing=1, refractory_s=3.0)
    assert [e.time_s for e in direct.events] == events


def _write_manifest(rows, tmp_path: Path) -> Path:
    path = tmp_path / "manifest.csv"
    write_manifest(rows, path)
    return path


def _expect_error(capsys, needle: str, *args: str) -> str:
    rc, _, err = _eval(capsys, *args)
    assert rc != 0
    assert needle in err, err
    assert "Traceback" not in err
    return err


def test_errors_are_clear(models, tiny_corpus, tmp_path, capsys):
    base, other, manifest = str(models["base"]), str(models["other"]), str(tiny_corpus)
    _expect_error(capsys, "model file not found", "--baseline", str(tmp_path / "nope.onnx"),
                  "--candidate", other, "--manifest", manifest)
    _expect_error(capsys, "model file not found", "--baseline", base,
                  "--candidate", str(tmp_path / "nope.safetensors"), "--manifest", manifest)
    _expect_error(capsys, "manifest not found", "--baseline", base, "--candidate", other,
                  "--manifest", str(tmp_path / "none.csv"))
    err = _expect_error(capsys, "different frontend", "--baseline", base,
                        "--candidate", str(models["mels32"]), "--manifest", manifest)
    assert "n_mels" in err

    rows = read_manifest(tiny_corpus)
    no_test = _write_manifest([r for r in rows if r.split != "test"], tmp_path / "a")
    _expect_error(capsys, "no clips in split 'test'", "--baseline", base, "--candidate", other,
                  "--manifest", str(no_test))
    no_pos = _write_manifest(
        [r for r in rows if not (r.split == "test" and r.device_type == "A" and r.label == 1)],
        tmp_path / "b",
    )
    _expect_error(capsys, "device type 'A' has no wake-word clips", "--baseline", base,
                  "--candidate", other, "--manifest", str(no_pos))
    lost = [replace(r, path="clips/missing.wav") if i == 0 else r
            for i, r in enumerate(r for r in rows if r.split == "test" and r.kind == "clip")]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "clips").symlink_to(tiny_corpus.parent / "clips")
    missing_clip = _write_manifest(lost, tmp_path / "c")
    _expect_error(capsys, "not found", "--baseline", base, "--candidate", other,
                  "--manifest", str(missing_clip))
    _expect_error(capsys, "--target-fr", "--baseline", base, "--candidate", other,
                  "--manifest", manifest, "--target-fr", "1.5")


def test_cli_process_exits_nonzero_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "wakefl.tools.cli", "eval", "--baseline", str(tmp_path / "b.onnx"),
         "--candidate", str(tmp_path / "c.onnx"), "--manifest", str(tmp_path / "m.csv")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "wakefl: error: manifest not found" in proc.stderr
    assert "Traceback" not in proc.stderr
