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
from wakefl.tools.evaluation.cells import stream_detections
from wakefl.tools.evaluation.evaluate import EvalSettings
from wakefl.tools.evaluation.model_scoring import detection_times, load_scorer, stream_posteriors

WIDTH = 0.125
ROW_KEYS = {
    "candidate": str,
    "device_type": str,
    "state": str,
    "fr": (float, type(None)),
    "fa": (float, type(None)),
    "fa_per_hour": (float, type(None)),
    "relative_fa": (float, type(None)),
    "relative_fr": (float, type(None)),
    "relative_fa_ci": dict,
    "n_positive": int,
    "n_negative": int,
    "fa_per_hour_saturated": bool,
    "baseline_fa_per_hour_saturated": bool,
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
        "base": d / "base.onnx",
        "base_torch": d / "base.safetensors",
        "same": d / "same.onnx",
        "other": d / "other.safetensors",
        "mels32": d / "mels32.safetensors",
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
        capsys,
        "--baseline",
        str(models["base"]),
        "--candidate",
        str(models["same"]),
        "--candidate",
        str(models["other"]),
        "--manifest",
        str(tiny_corpus),
        "--json",
        "--report",
        str(report),
    )
    assert rc == 0, err
    rows = _no_nan(out)["rows"]
    manifest = read_manifest(tiny_corpus)
    devices = {r.device_type for r in manifest if r.split == "test" and r.kind == "clip"}

    for row in rows:
        for key, typ in ROW_KEYS.items():
            assert isinstance(row[key], typ), (key, row[key])
        assert set(row["relative_fa_ci"]) == {"lower", "upper", "note"}
    assert {r["candidate"] for r in rows} == {"same", "other"}
    assert {r["device_type"] for r in rows} == devices | {"all"}

    # A candidate identical to the baseline: exactly 1 everywhere something was measured.
    same = [r for r in rows if r["candidate"] == "same"]
    for r in same:
        if r["n_negative"]:
            assert r["relative_fa"] == 1.0, r
            assert r["relative_fa_ci"] == {"lower": 1.0, "upper": 1.0, "note": ""}
        if r["n_positive"]:
            assert r["relative_fr"] == 1.0, r
        assert r["fr"] == r["baseline_fr"] and r["fa"] == r["baseline_fa"]
        assert r["fa_per_hour"] == r["baseline_fa_per_hour"]
    for d in devices | {"all"}:
        whole = next(r for r in same if r["device_type"] == d and r["state"] == "all")
        assert whole["relative_fa"] == 1.0 and whole["relative_fr"] == 1.0
        # Counts behind the figure: every test clip of the device type.
        clips = [
            m
            for m in manifest
            if m.split == "test" and m.kind == "clip" and (d == "all" or m.device_type == d)
        ]
        assert whole["n_positive"] == sum(m.label for m in clips)
        assert whole["n_negative"] == sum(1 - m.label for m in clips)
        streams = [
            m
            for m in manifest
            if m.split == "test" and m.kind == "stream" and (d == "all" or m.device_type == d)
        ]
        assert whole["stream_hours"] == pytest.approx(sum(m.duration_s for m in streams) / 3600)
        assert whole["fa_per_hour"] == pytest.approx(
            whole["false_accept_events"] / whole["stream_hours"]
        )
        # Relative FR at matched FA, on the clips and on the streams: exactly 1.
        for key in ("relative_fr_at_matched_clip_fa", "relative_fr_at_matched_fa_per_hour"):
            rec = whole[key]
            assert rec["relative_fr"] == 1.0 and rec["relative_fr_ci"] == [1.0, 1.0], rec
            assert rec["baseline_threshold"] == rec["candidate_threshold"]
        assert whole["fa_per_hour_resolution"] == pytest.approx(1.0 / whole["stream_hours"])

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
    assert "## Relative FR at matched FA" in md and "| same | A | " in md
    html = (report / "report.html").read_text()
    assert "`" not in html.split("<h2>Results</h2>")[0]  # Markdown rendered, not raw
    assert html.count("data:image/png;base64,") == len(devices) + 1
    assert _no_nan((report / "results.json").read_text())["rows"] == rows


def test_torch_and_onnx_scorers_agree(models, tiny_corpus):
    rows = [r for r in read_manifest(tiny_corpus) if r.kind == "clip" and r.split == "test"][:6]
    from wakefl.tools.evaluation.model_scoring import score_clips

    onnx = score_clips(load_scorer(models["base"]), rows, tiny_corpus.parent, progress=False)
    torch_scores = score_clips(
        load_scorer(models["base_torch"]), rows, tiny_corpus.parent, progress=False
    )
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
    scorer = _BurstScorer()
    events = stream_detections(scorer, wave, 0.5, settings)
    assert len(events) == 3
    # Each event fires as the first window containing its burst ends.
    for ev, t in zip(events, [10.0, 40.0, 90.0], strict=True):
        assert t < ev <= t + 0.2 + settings.hop_s
    assert false_accepts_per_hour(events, seconds / 3600) == pytest.approx(90.0)
    # Scored once, the posteriors give the events at any other threshold without scoring
    # again, the same as the streaming detector's.
    scored = scorer.windows_scored
    post = stream_posteriors(scorer, wave, hop_s=0.25, smoothing=1, refractory_s=3.0)
    assert scorer.windows_scored == 2 * scored
    assert detection_times(post, 0.5) == events and detection_times(post, 0.95) == []
    direct = detect_audio(
        _BurstScorer(), wave, hop_s=0.25, threshold=0.5, smoothing=1, refractory_s=3.0
    )
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
    _expect_error(
        capsys,
        "model file not found",
        "--baseline",
        str(tmp_path / "nope.onnx"),
        "--candidate",
        other,
        "--manifest",
        manifest,
    )
    _expect_error(
        capsys,
        "model file not found",
        "--baseline",
        base,
        "--candidate",
        str(tmp_path / "nope.safetensors"),
        "--manifest",
        manifest,
    )
    _expect_error(
        capsys,
        "manifest not found",
        "--baseline",
        base,
        "--candidate",
        other,
        "--manifest",
        str(tmp_path / "none.csv"),
    )
    err = _expect_error(
        capsys,
        "different frontend",
        "--baseline",
        base,
        "--candidate",
        str(models["mels32"]),
        "--manifest",
        manifest,
    )
    assert "n_mels" in err

    rows = read_manifest(tiny_corpus)
    no_test = _write_manifest([r for r in rows if r.split != "test"], tmp_path / "a")
    _expect_error(
        capsys,
        "no clips in split 'test'",
        "--baseline",
        base,
        "--candidate",
        other,
        "--manifest",
        str(no_test),
    )
    no_pos = _write_manifest(
        [r for r in rows if not (r.split == "test" and r.device_type == "A" and r.label == 1)],
        tmp_path / "b",
    )
    _expect_error(
        capsys,
        "device type 'A' has no wake-word clips",
        "--baseline",
        base,
        "--candidate",
        other,
        "--manifest",
        str(no_pos),
    )
    lost = [
        replace(r, path="clips/missing.wav") if i == 0 else r
        for i, r in enumerate(r for r in rows if r.split == "test" and r.kind == "clip")
    ]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "clips").symlink_to(tiny_corpus.parent / "clips")
    missing_clip = _write_manifest(lost, tmp_path / "c")
    _expect_error(
        capsys,
        "not found",
        "--baseline",
        base,
        "--candidate",
        other,
        "--manifest",
        str(missing_clip),
    )
    _expect_error(
        capsys,
        "--target-fr",
        "--baseline",
        base,
        "--candidate",
        other,
        "--manifest",
        manifest,
        "--target-fr",
        "1.5",
    )


def test_cli_process_exits_nonzero_without_traceback(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wakefl.tools.cli",
            "eval",
            "--baseline",
            str(tmp_path / "b.onnx"),
            "--candidate",
            str(tmp_path / "c.onnx"),
            "--manifest",
            str(tmp_path / "m.csv"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "wakefl: error: manifest not found" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- one evaluation routine, batched streams, fixed operating points, pairing -------------


def _test_streams(manifest: Path):
    return [r for r in read_manifest(manifest) if r.split == "test" and r.kind == "stream"]


def test_batched_stream_scoring_is_the_streaming_detector_bit_for_bit(models, tiny_corpus):
    from wakefl.edge_runtime import StreamingDetector, load_audio

    scorer = load_scorer(models["base"])
    row = _test_streams(tiny_corpus)[0]
    wave = load_audio(str(row.resolve(tiny_corpus)), sample_rate=scorer.sample_rate)[: 16000 * 12]
    reference = detect_audio(scorer, wave, hop_s=0.1, threshold=0.0, smoothing=3, refractory_s=1.0)
    post = stream_posteriors(scorer, wave, hop_s=0.1, smoothing=3, refractory_s=1.0, batch=37)
    assert np.array_equal(post.raw, reference.raw_scores)
    assert np.array_equal(post.smoothed, reference.scores)
    assert np.array_equal(post.times_s, reference.times_s)
    threshold = float(np.quantile(post.smoothed, 0.6))  # fires on some windows, not others
    det = StreamingDetector(scorer, hop_s=0.1, threshold=threshold, smoothing=3, refractory_s=1.0)
    pushed = [e.time_s for i in range(0, wave.size, 1600) for e in det.push(wave[i : i + 1600])]
    assert 1 <= len(pushed) < post.raw.size
    assert detection_times(post, threshold) == pushed


def test_eval_and_study_give_identical_rows_on_the_same_scores(models, tiny_corpus):
    from wakefl.tools.evaluation.cells import bootstrap_units
    from wakefl.tools.evaluation.evaluate import run_evaluation
    from wakefl.tools.evaluation.model_scoring import score_clips
    from wakefl.tools.studies.paper_figures import EvalSet, relative_records

    settings = EvalSettings(n_boot=60, seed=3, hop_s=0.5, progress=False)
    result = run_evaluation(models["base"], [models["other"]], tiny_corpus, settings)
    base, other = load_scorer(models["base"]), load_scorer(models["other"])
    clips = [r for r in read_manifest(tiny_corpus) if r.split == "test" and r.kind == "clip"]
    compared = 0
    for d in sorted({r.device_type for r in clips}):
        rows = [r for r in clips if r.device_type == d]
        ev = EvalSet(
            d,
            None,
            np.array([r.label for r in rows]),
            np.array([r.state for r in rows]),
            bootstrap_units([r.speaker for r in rows]),
            score_clips(base, rows, tiny_corpus.parent, progress=False),
        )
        cand = score_clips(other, rows, tiny_corpus.parent, progress=False)
        states = ["all", *sorted({r.state for r in rows})]
        study = relative_records(
            ev, cand, states, settings.target_fr, settings.n_boot, settings.seed
        )
        for row in (r for r in result.rows if r["device_type"] == d):
            rec = study[row["state"]]
            ci = row["relative_fa_ci"]
            ours = {
                "relative_fa": row["relative_fa"],
                "relative_fr": row["relative_fr"],
                "candidate_fr": row["fr"],
                "candidate_fa": row["fa"],
                "baseline_fr": row["baseline_fr"],
                "baseline_fa": row["baseline_fa"],
                "relative_fa_ci": [
                    None if isinstance(b, str) else b for b in (ci["lower"], ci["upper"])
                ],
            }
            for key, value in ours.items():
                want = rec[key]
                got = (
                    [None if v is None else round(v, 6) for v in value]
                    if key == "relative_fa_ci"
                    else (None if value is None else round(value, 6))
                )
                assert got == want, (d, row["state"], key)
            assert (row["n_positive"], row["n_negative"]) == (rec["n_positive"], rec["n_negative"])
            compared += 1
    assert compared == sum(1 for r in result.rows if r["device_type"] != "all")


def test_fixed_threshold_reports_the_baseline_at_it_and_flags_saturation(
    models, tiny_corpus, tmp_path, capsys
):
    from wakefl.sdk.wake_metrics import fa_at, fr_at
    from wakefl.tools.evaluation.model_scoring import score_clips

    report = tmp_path / "report"
    rc, out, err = _eval(
        capsys,
        "--baseline",
        str(models["base"]),
        "--candidate",
        str(models["other"]),
        "--manifest",
        str(tiny_corpus),
        "--threshold",
        "0",
        "--json",
        "--report",
        str(report),
    )
    assert rc == 0, err
    rows = _no_nan(out)["rows"]
    clips = [r for r in read_manifest(tiny_corpus) if r.split == "test" and r.kind == "clip"]
    base = score_clips(load_scorer(models["base"]), clips, tiny_corpus.parent, progress=False)
    labels = np.array([r.label for r in clips])
    for r in (r for r in rows if r["state"] == "all"):
        assert r["operating_point"] == "shipped threshold" and r["baseline_threshold"] == 0.0
        m = np.array([r["device_type"] in ("all", c.device_type) for c in clips])
        assert r["baseline_fr"] == fr_at(base[m & (labels == 1)], 0.0) == 0.0
        assert r["baseline_fa"] == fa_at(base[m & (labels == 0)], 0.0) == 1.0
        # Threshold 0 fires at every hop: one event per refractory period, the ceiling.
        assert r["baseline_fa_per_hour"] >= 0.8 * r["fa_per_hour_ceiling"]
        assert r["baseline_fa_per_hour_saturated"] and "saturated" in r["note"]
    md = (report / "report.md").read_text()
    assert "## The baseline at its shipped threshold" in md and "(saturated)" in md
    assert "The baseline at its shipped threshold" in (report / "report.html").read_text()


def test_thresholds_file_and_model_card(models, tiny_corpus, tmp_path, capsys):
    common = ("--candidate", str(models["other"]), "--manifest", str(tiny_corpus), "--json")
    table = tmp_path / "thr.csv"
    table.write_text("device_type,threshold\nA,0.45\n*,0.5\n")
    rc, out, err = _eval(
        capsys, "--baseline", str(models["base"]), "--thresholds", str(table), *common
    )
    assert rc == 0, err
    doc = _no_nan(out)
    by_device = {
        r["device_type"]: r["baseline_threshold"] for r in doc["rows"] if r["state"] == "all"
    }
    assert by_device.pop("A") == 0.45 and set(by_device.values()) == {0.5}
    assert "all" not in by_device  # A and the rest ship different thresholds: no pooled row
    assert doc["summary"]["pooled_rows_skipped"]["candidates"] == ["other"]

    card_dir = tmp_path / "card"
    card_dir.mkdir()
    shutil.copy(models["base"], card_dir / "base.onnx")
    _expect_error(
        capsys,
        "has no model card",
        "--baseline",
        str(card_dir / "base.onnx"),
        "--at-shipped-threshold",
        *common,
    )
    (card_dir / "base.json").write_text(json.dumps({"shipped_threshold": 0.52}))
    rc, out, err = _eval(
        capsys, "--baseline", str(card_dir / "base.onnx"), "--at-shipped-threshold", *common
    )
    assert rc == 0, err
    assert {r["baseline_threshold"] for r in _no_nan(out)["rows"]} == {0.52}
    (card_dir / "base.json").write_text(json.dumps({"shipped_threshold": 7}))
    _expect_error(
        capsys,
        "must be a number in [0, 1]",
        "--baseline",
        str(card_dir / "base.onnx"),
        "--at-shipped-threshold",
        *common,
    )


def test_pairing_scores_each_model_on_its_own_device_type(models, tiny_corpus, tmp_path, capsys):
    from wakefl.sdk.wake_metrics import relative_by_subset
    from wakefl.tools.evaluation.cells import bootstrap_units
    from wakefl.tools.evaluation.model_scoring import score_clips

    pairing = tmp_path / "pairs.csv"
    pairing.write_text(f"model,device_type\n{models['other']},B\n")
    rc, out, err = _eval(
        capsys,
        "--baseline",
        str(models["base"]),
        "--candidate",
        f"{models['same']}:A",
        "--pairing",
        str(pairing),
        "--manifest",
        str(tiny_corpus),
        "--json",
        "--seed",
        "5",
    )
    assert rc == 0, err
    rows = _no_nan(out)["rows"]
    assert {(r["candidate"], r["device_type"]) for r in rows} == {
        ("same", "A"),
        ("other", "B"),
        ("paired", "all"),
    }
    pooled = next(r for r in rows if r["candidate"] == "paired" and r["state"] == "all")
    clips = [
        r
        for r in read_manifest(tiny_corpus)
        if r.split == "test" and r.kind == "clip" and r.device_type in "AB"
    ]
    labels = np.array([r.label for r in clips])
    base = score_clips(load_scorer(models["base"]), clips, tiny_corpus.parent, progress=False)
    same = score_clips(load_scorer(models["same"]), clips, tiny_corpus.parent, progress=False)
    other = score_clips(load_scorer(models["other"]), clips, tiny_corpus.parent, progress=False)
    own = np.where(np.array([r.device_type for r in clips]) == "A", same, other)
    _, cells = relative_by_subset(
        base,
        own,
        labels,
        bootstrap_units([r.speaker for r in clips]),
        {"all": np.ones(labels.size, bool)},
        0.05,
        40,
        5,
    )
    assert pooled["relative_fa"] == cells["all"].relative_fa
    assert pooled["n_positive"] == int(labels.sum()) and pooled["models"] == {
        "A": f"{models['same']}",
        "B": str(models["other"]),
    }
    streams = [r for r in _test_streams(tiny_corpus) if r.device_type in "AB"]
    assert pooled["stream_hours"] == pytest.approx(sum(r.duration_s for r in streams) / 3600)
    _expect_error(
        capsys,
        "two candidates are paired with device type 'A'",
        "--baseline",
        str(models["base"]),
        "--candidate",
        f"{models['same']}:A",
        "--candidate",
        f"{models['other']}:A",
        "--manifest",
        str(tiny_corpus),
    )
    _expect_error(
        capsys,
        "which has no clips",
        "--baseline",
        str(models["base"]),
        "--candidate",
        f"{models['same']}:Z",
        "--manifest",
        str(tiny_corpus),
    )
