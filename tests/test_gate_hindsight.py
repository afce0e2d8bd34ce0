"""The gate in hindsight (tools/studies/gate_hindsight.py): its four views against closed
forms, and the study on a demo-shaped run over real decoded audio of the tiny corpus."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from wakefl.errors import ConfigError
from wakefl.models.kws_cnn.pretrained import pretrained_path
from wakefl.tools.studies.gate_hindsight import VIEWS, Scores, Units, device_scores, main, views


def _units(s: Scores) -> Units:
    return Units(*(np.array([f"{k}{i}" for i in range(a.size)]) for k, a in (
        ("p", s.pos), ("c", s.clip_neg), ("g", s.gate_windows), ("d", s.detector_windows))))  # fmt: skip


def _base() -> Scores:
    # Two wake words in 20 (0.05, 0.099) under every negative (0.1): the baseline misses them.
    return Scores(np.linspace(0.05, 0.98, 20), np.full(10, 0.1), np.full(20, 0.1), np.full(50, 0.1))


def test_the_same_model_is_level_in_every_view() -> None:
    base = _base()
    out = views(base, base, _units(base), shipped_threshold=0.9, gate_target_fr=0.5, n_boot=50)
    assert set(out) == set(VIEWS)
    for rec in out.values():
        assert rec["relative_fr"] == pytest.approx(1.0)
        assert rec["relative_fr_ci"] == pytest.approx([1.0, 1.0])


def test_a_moment_between_the_gates_windows_shows_only_in_the_detectors_views() -> None:
    # The served model lifts every wake word above the negatives, and scores one moment of
    # stream 0.999 that the gate's windows (every 0.5 s) step over.
    base = _base()
    detector = base.detector_windows.copy()
    detector[17] = 0.999
    served = Scores(np.minimum(base.pos + 0.1, 0.995), base.clip_neg, base.gate_windows, detector)
    out = views(base, served, _units(base), shipped_threshold=0.9, gate_target_fr=0.5, n_boot=50)
    # Gate's views: the baseline misses 2 of 20 at no false accept, the served model none.
    assert out["gate"]["relative_fr"] == pytest.approx(0.0)
    assert out["gate, shipped threshold"]["relative_fr"] == pytest.approx(0.0)
    # Detector's views: held to no false accept the served model must sit above 0.999 and
    # misses all 20: ten times the baseline's two misses.
    assert out["detector"]["relative_fr"] == pytest.approx(10.0)
    assert out["detector, streams only"]["relative_fr"] == pytest.approx(10.0)


def _demo_run(tmp_path: Path, corpus: Path) -> tuple[Path, Path]:
    """A run folder shaped as `wakefl demo` leaves it (baseline and served A both the shipped
    small model) and a manifest of A's validation clips plus one stream as validation."""
    run = tmp_path / "run"
    (run / "models").mkdir(parents=True)
    (run / "report").mkdir()
    small = pretrained_path("small")
    for name in ("baseline", "served-A"):
        shutil.copy(small, run / "models" / f"{name}.safetensors")
        shutil.copy(small.with_suffix(".json"), run / "models" / f"{name}.json")
    row = {"device_type": "A", "gate_switched": True, "serves": "personalized",
           "relative_fr": 1.0, "relative_fr_ci": [1.0, 1.0]}  # fmt: skip
    doc = {
        "profile": "tiny",
        "seed": 0,
        "rows": [row, {**row, "device_type": "B", "gate_switched": False}],
    }
    (run / "report" / "demo_results.json").write_text(json.dumps(doc))
    with corpus.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["device_type"] == "A"]
    keep = [r for r in rows if r["split"] == "val" and r["kind"] == "clip"]
    keep += [{**r, "split": "val"} for r in rows if r["kind"] == "stream"][:1]
    for r in keep:  # the audio beside a manifest of its own, as a corpus holds it
        (tmp_path / r["path"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(corpus.parent / r["path"], tmp_path / r["path"])
    manifest = tmp_path / "manifest.csv"
    with manifest.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(keep)
    return run, manifest


def test_the_study_on_a_demo_run(tmp_path: Path, tiny_corpus: Path, capsys) -> None:
    run, manifest = _demo_run(tmp_path, tiny_corpus)
    out = tmp_path / "hindsight.json"
    argv = ["--run", str(run), "--manifest", str(manifest), "--n-boot", "20", "--json", str(out)]
    assert main(argv) == 0
    records = json.loads(out.read_text())
    assert [r["device_type"] for r in records] == ["A"]  # B's gate did not switch
    for view in VIEWS:  # served is the baseline: level wherever it is looked at
        assert records[0]["validation"][view]["relative_fr"] == pytest.approx(1.0)
    printed = capsys.readouterr().out
    assert "| A | personalized | 1.00 [1.00, 1.00] |" in printed


def test_a_folder_that_is_not_a_demo_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a `wakefl demo` run"):
        main(["--run", str(tmp_path)])


def test_an_addons_validation_streams_join_the_devices(tmp_path: Path, tiny_corpus: Path) -> None:
    run, manifest = _demo_run(tmp_path, tiny_corpus)
    models = {"base": run / "models" / "baseline.safetensors"}
    alone, alone_units = device_scores(manifest, "A", models)
    addon = tmp_path / "addon"
    addon.mkdir()
    with manifest.open(newline="") as f:
        streams = [r for r in csv.DictReader(f) if r["kind"] == "stream"]
    for r in streams:
        (addon / r["path"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / r["path"], addon / r["path"])
    with (addon / "manifest.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(streams[0]))
        w.writeheader()
        w.writerows(streams)
    both, both_units = device_scores(manifest, "A", models, addon / "manifest.csv")
    for field in ("gate_windows", "detector_windows"):
        one = getattr(alone["base"], field)
        np.testing.assert_array_equal(getattr(both["base"], field), np.concatenate([one, one]))
        # The add-on's copy of a stream is a bootstrap unit apart from the corpus's.
        assert len(set(getattr(both_units, field))) == 2 * len(set(getattr(alone_units, field)))
    np.testing.assert_array_equal(both["base"].pos, alone["base"].pos)
