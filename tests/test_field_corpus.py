"""The held-out-acoustics add-on (`--profile pretrain-acoustics`): the main corpus's
validation and test speakers and its unseen voices, recorded by the second acoustic
simulation, byte-identical per seed, and scored by the detection benchmark as conditions of
their own."""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from wakefl.errors import ConfigError


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _speakers(folder: Path) -> dict[str, tuple[str, ...]]:
    with (folder / "speakers.csv").open(encoding="utf-8") as f:
        return {r["speaker"]: tuple(r.values()) for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from wakefl.tools.corpus.build import build_corpus

    root = tmp_path_factory.mktemp("field")
    main = build_corpus(root / "main", 0, "pretrain-micro", progress=False)
    field = build_corpus(root / "field", 0, "pretrain-acoustics-micro", progress=False)
    return main.parent, field.parent


@pytest.mark.slow
def test_the_add_on_holds_the_held_out_speakers_through_the_field_devices(built) -> None:
    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.corpus.build import build_corpus
    from wakefl.tools.corpus.transcripts import read_transcript

    main, field = built
    rows = read_manifest(field / "manifest.csv")
    assert {r.split for r in rows} == {"val", "test"}
    for split in ("val", "test"):
        for d in "ABCDE":
            mine = [r for r in rows if r.split == split and r.device_type == d]
            assert sum(r.kind == "clip" for r in mine) == 6
            assert sum(r.kind == "stream" for r in mine) == 1
            assert {r.label for r in mine if r.kind == "clip"} == {0, 1}
    # The main corpus's validation and test speakers, nobody else.
    held_out = {k: v for k, v in _speakers(main).items() if v[1] != "train"}
    assert _speakers(field) == held_out
    spoken = {r.speaker for r in rows if r.kind == "clip" and r.label == 1}
    assert spoken <= set(held_out)
    said = {u.speaker for r in rows if r.kind == "stream" for u in read_transcript(field / r.path)}
    assert said and said <= set(held_out)
    unseen = read_manifest(field / "unseen" / "manifest.csv")
    assert {(r.split, r.kind) for r in unseen} == {("test", "clip"), ("test", "stream")}
    assert _speakers(field / "unseen") == _speakers(main / "unseen")
    info = json.loads((field / "corpus.json").read_text())
    assert info["acoustics"] == "field" and info["seed"] == 0
    assert info["field_devices"]["D"].startswith("bt-speakerphone")
    # The narrowband link's clips carry nothing above 4 kHz; the wideband speaker's do.
    for device, narrow in (("D", True), ("A", False)):
        first = next(
            r.path for r in rows if r.device_type == device and r.split == "test" and r.label == 1
        )
        wave, sr = sf.read(field / first)
        spec = np.abs(np.fft.rfft(wave)) ** 2
        f = np.fft.rfftfreq(wave.size, 1 / sr)
        ratio = spec[f > 4400].sum() / spec[(f > 100) & (f < 3800)].sum()
        assert (ratio < 1e-3) == narrow, (device, ratio)
    # Byte-identical per seed, and the main corpus's files are not among its own.
    again = build_corpus(field.parent / "again", 0, "pretrain-acoustics-micro", progress=False)
    assert _digest(again.parent) == _digest(field)
    main_wavs = {v for k, v in _digest(main).items() if k.endswith(".wav")}
    assert not main_wavs & {v for k, v in _digest(field).items() if k.endswith(".wav")}


@pytest.mark.slow
def test_the_benchmark_reports_the_three_held_out_conditions_apart(built, tmp_path) -> None:
    from wakefl.tools.bench.detection import run
    from wakefl.tools.bench.detection_report import format_table

    main, field = built
    args = argparse.Namespace(
        pretrained="small",
        weights=None,
        corpus=main,
        int8=False,
        split="test",
        max_stream_seconds=None,
        detectors=None,
        retimed=None,
        extra_streams=None,
        acoustics=field,
        threads=1,
        plots=None,
    )
    result = run(args)
    assert list(result["fp32"]) == [
        "held-out speakers",
        "held-out acoustics",
        "unseen voices",
        "unseen voices, held-out acoustics",
    ]
    conditions = result["conditions"]
    assert list(conditions) == list(result["fp32"])
    for name, c in conditions.items():
        rows = result["fp32"][name]
        assert sorted(c["by_type"]) == list("ABCDE")
        hours = sum(rows[d]["stream_hours"] for d in "ABCDE")
        assert c["all types"]["stream_hours"] == pytest.approx(hours, abs=2e-3)
        assert c["all types"]["fa_h_resolution"] == pytest.approx(1 / hours, rel=1e-2)
        for d, cell in c["by_type"].items():
            assert cell["frr_at_shipped_threshold"] == rows[d]["at_shipped_threshold"]["frr"]
            assert (
                cell["fa_h_at_shipped_threshold"] == rows[d]["at_shipped_threshold"]["fa_per_hour"]
            )
            assert cell["frr_at_0.5_fa_h"] == rows[d]["frr_at_0.5_fa_h"]["frr"]
    table = format_table(result)
    assert "held-out acoustics | all |" in table
    assert "unseen voices, held-out acoustics | E |" in table
    # Validation: the held-out acoustics' validation split, beside the main one.
    val = run(argparse.Namespace(**{**vars(args), "split": "val"}))
    assert list(val["fp32"]) == ["validation", "validation, held-out acoustics"]
    # The add-on alone, as --corpus: the same figures, under its own names.
    alone = run(argparse.Namespace(**{**vars(args), "corpus": field, "acoustics": None}))
    assert list(alone["fp32"]) == ["held-out acoustics", "unseen voices, held-out acoustics"]
    assert alone["conditions"]["held-out acoustics"] == conditions["held-out acoustics"]
    with pytest.raises(ConfigError, match="held-out-acoustics build"):
        run(argparse.Namespace(**{**vars(args), "corpus": field}))


def test_an_add_on_of_other_speakers_or_acoustics_is_refused(tmp_path) -> None:
    from wakefl.tools.bench.detection_conditions import acoustics_manifests

    def corpus(name: str, seed: int, acoustics: str | None) -> Path:
        folder = tmp_path / name
        (folder / "unseen").mkdir(parents=True)
        (folder / "manifest.csv").write_text("path\n")
        (folder / "unseen" / "manifest.csv").write_text("path\n")
        info = {"seed": seed, "phrase": "hey nova", "profile": {"n_speakers": 24}}
        if acoustics:
            info["acoustics"] = acoustics
        (folder / "corpus.json").write_text(json.dumps(info))
        return folder

    main = corpus("main", 0, None)
    assert acoustics_manifests(main, corpus("field", 0, "field"), "test") == {
        "held-out acoustics": tmp_path / "field" / "manifest.csv",
        "unseen voices, held-out acoustics": tmp_path / "field" / "unseen" / "manifest.csv",
    }
    assert list(acoustics_manifests(main, tmp_path / "field", "val")) == [
        "validation, held-out acoustics"
    ]
    assert acoustics_manifests(main, None, "test") == {}
    with pytest.raises(ConfigError, match="was not built with .*main's speakers"):
        acoustics_manifests(main, corpus("other", 1, "field"), "test")
    with pytest.raises(ConfigError, match="pretrain-acoustics"):
        acoustics_manifests(main, corpus("plain", 0, None), "test")
    with pytest.raises(ConfigError, match="not a finished corpus build"):
        acoustics_manifests(main, tmp_path / "none", "test")


def test_the_compact_add_on_holds_the_compact_corpus_speakers_with_no_validation_set() -> None:
    from wakefl.tools.corpus.plan import FIELD_ACOUSTICS_PROFILES, PROFILES

    compact, addon = PROFILES["pretrain-compact"], PROFILES["pretrain-compact-acoustics"]
    assert "pretrain-compact-acoustics" in FIELD_ACOUSTICS_PROFILES
    assert (addon.n_speakers, addon.unseen_speakers) == (
        compact.n_speakers,
        compact.unseen_speakers,
    )
    assert addon.voice_set == compact.voice_set and addon.train_unit == 0
    assert (addon.val_clips, addon.val_streams_per_device) == (0, 0)
    # 2.5 h of test stream over the five device types: one false accept is 0.4 FA/h.
    assert 5 * addon.streams_per_device * addon.stream_seconds / 3600 == pytest.approx(2.5)


def test_the_subset_is_the_full_add_on_less_its_validation_set_and_all_but_one_stream() -> None:
    from dataclasses import replace

    from wakefl.tools.corpus.plan import FIELD_ACOUSTICS_PROFILES, PROFILES

    full, subset = PROFILES["pretrain-acoustics"], PROFILES["pretrain-acoustics-subset"]
    assert "pretrain-acoustics-subset" in FIELD_ACOUSTICS_PROFILES
    assert subset == replace(
        full,
        name="pretrain-acoustics-subset",
        val_clips=0,
        val_streams_per_device=0,
        streams_per_device=1,
        unseen_streams_per_device=1,
    )
