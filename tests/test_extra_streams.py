"""The `pretrain-streams` and `pretrain-valstreams` add-ons: more negative streams of the
main corpus's test (or validation) speakers, which the detection benchmark scores beside the
main corpus's own streams of the same split."""

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
from wakefl.tools.bench.detection import run
from wakefl.tools.bench.detection_conditions import extra_stream_manifests
from wakefl.tools.bench.detection_scoring import (
    SplitScores,
    frr_at_fa,
    pooled_operating_point,
    score_split,
    top_stream_events,
)

SR, WINDOW = 16000, 24000
HEADER = "path,label,device_type,state,speaker,split,duration_s,kind"


class EnergyScorer:
    """A posterior from the window's loudness, standing in for a model."""

    sample_rate = SR
    window_samples = WINDOW

    def score(self, windows: np.ndarray) -> np.ndarray:
        rms = np.sqrt(np.mean(np.asarray(windows, dtype=np.float64) ** 2, axis=1))
        return 1.0 - np.exp(-8.0 * rms)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _test_speakers(folder: Path, split: str = "test") -> set[str]:
    with (folder / "speakers.csv").open(encoding="utf-8") as f:
        return {r["speaker"] for r in csv.DictReader(f) if r["split"] == split}


@pytest.mark.slow
def test_the_streams_add_on_holds_new_streams_of_the_held_out_speakers_only(tmp_path) -> None:
    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.corpus.build import build_corpus
    from wakefl.tools.corpus.transcripts import read_transcript

    main = build_corpus(tmp_path / "main", 0, "pretrain-micro", progress=False)
    extra = build_corpus(tmp_path / "extra", 0, "pretrain-streams-micro", progress=False)
    rows = read_manifest(extra)
    assert {(r.kind, r.split, r.label) for r in rows} == {("stream", "test", 0)}
    devices = sorted({r.device_type for r in read_manifest(main)})
    assert sorted(r.device_type for r in rows) == sorted(devices * 2)
    held_out = _test_speakers(main.parent)
    assert held_out == _test_speakers(extra.parent)
    said = {u.speaker for r in rows for u in read_transcript(extra.parent / r.path)}
    assert said and said <= held_out
    # Draws of their own: no add-on stream repeats one of the main corpus's.
    main_streams = {
        _digest(main.parent / r.path) for r in read_manifest(main) if r.kind == "stream"
    }
    assert not main_streams & {_digest(extra.parent / r.path) for r in rows}
    assert extra_stream_manifests(main.parent, [extra.parent]) == (extra,)
    # The second test add-on: the same held-out speakers, streams no earlier build holds.
    from dataclasses import replace

    from wakefl.tools.corpus.plan import PROFILES

    # Its test-sized twin: the micro add-on with the second reading's draws.
    twin = replace(PROFILES["pretrain-streams-micro"], name="pretrain-streams-second-micro",
                   draw_offset=PROFILES["pretrain-streams-second"].draw_offset)  # fmt: skip
    second = build_corpus(tmp_path / "second", 0, twin, progress=False)
    second_rows = read_manifest(second)
    assert {(r.kind, r.split, r.label) for r in second_rows} == {("stream", "test", 0)}
    second_said = {u.speaker for r in second_rows for u in read_transcript(second.parent / r.path)}
    assert second_said and second_said <= held_out
    seen = main_streams | {_digest(extra.parent / r.path) for r in rows}
    assert not seen & {_digest(second.parent / r.path) for r in second_rows}
    assert extra_stream_manifests(main.parent, [second.parent]) == (second,)
    # The validation twin: the same for the validation speakers, refused on the test split.
    val = build_corpus(tmp_path / "val", 0, "pretrain-valstreams-micro", progress=False)
    val_rows = read_manifest(val)
    assert {(r.kind, r.split, r.label) for r in val_rows} == {("stream", "val", 0)}
    val_said = {u.speaker for r in val_rows for u in read_transcript(val.parent / r.path)}
    assert val_said and val_said <= _test_speakers(main.parent, "val")
    main_val = {_digest(main.parent / r.path) for r in read_manifest(main) if r.split == "val"}
    assert not main_val & {_digest(val.parent / r.path) for r in val_rows}
    assert extra_stream_manifests(main.parent, [val.parent], "val") == (val,)
    with pytest.raises(ConfigError, match="holds no test streams"):
        extra_stream_manifests(main.parent, [val.parent], "test")


def _corpus(folder: Path, seed: int, with_clips: bool, stream_s: float, gain: float) -> None:
    """A corpus folder of device type A: a positive and a negative clip (when `with_clips`)
    and one test stream of `stream_s` seconds, with the corpus.json a build writes."""
    rng = np.random.default_rng(seed + int(stream_s))
    folder.mkdir(parents=True)
    rows = [HEADER]
    if with_clips:
        for i, label in enumerate((1, 0)):
            sf.write(folder / f"c{i}.wav", 0.2 * rng.standard_normal(WINDOW), SR)
            rows.append(f"c{i}.wav,{label},A,normal,s{i},test,1.5,clip")
    sf.write(folder / "s.wav", gain * rng.standard_normal(int(stream_s * SR)), SR)
    rows.append(f"s.wav,0,A,normal,mix,test,{stream_s},stream")
    (folder / "manifest.csv").write_text("\n".join(rows) + "\n")
    info = {"seed": seed, "phrase": "hey nova", "profile": {"n_speakers": 24, "voice_set": "p"}}
    (folder / "corpus.json").write_text(json.dumps(info))


def test_extra_streams_join_the_held_out_streams_of_the_same_speakers(tmp_path) -> None:
    _corpus(tmp_path / "main", 0, True, 20.0, 0.01)
    _corpus(tmp_path / "extra", 0, False, 30.0, 0.5)
    _corpus(tmp_path / "other", 1, False, 30.0, 0.5)
    extra = extra_stream_manifests(tmp_path / "main", [tmp_path / "extra"])
    assert extra == (tmp_path / "extra" / "manifest.csv",)
    scorer = EnergyScorer()
    alone = score_split(scorer, tmp_path / "main" / "manifest.csv", "A", None)
    both = score_split(scorer, tmp_path / "main" / "manifest.csv", "A", None, extra_streams=extra)
    assert alone.stream_hours == pytest.approx(20.0 / 3600)
    assert both.stream_hours == pytest.approx(50.0 / 3600)
    assert both.stream_files == [tmp_path / "main" / "s.wav", tmp_path / "extra" / "s.wav"]
    # The same file name in two corpora: the report tells them apart.
    assert both.stream_labels == ["s.wav", "extra/s.wav"]
    assert top_stream_events(both, k=1)[0]["stream"] == "extra/s.wav"
    # The clips stay the main corpus's; the loud add-on stream is what raises the scores.
    np.testing.assert_array_equal(both.pos, alone.pos)
    assert both.raw_streams[1].min() > alone.raw_streams[0].max()
    # In place of the main corpus's own streams: the add-on's alone, the clips unchanged.
    only = score_split(
        scorer, tmp_path / "main" / "manifest.csv", "A", None, extra_streams=extra,
        own_streams=False,
    )  # fmt: skip
    assert only.stream_hours == pytest.approx(30.0 / 3600)
    assert only.stream_labels == ["extra/s.wav"]
    np.testing.assert_array_equal(only.pos, alone.pos)
    np.testing.assert_array_equal(only.raw_streams[0], both.raw_streams[1])
    with pytest.raises(ConfigError, match="no add-on"):
        score_split(scorer, tmp_path / "main" / "manifest.csv", "A", None, own_streams=False)
    with pytest.raises(ConfigError, match="not built with"):
        extra_stream_manifests(tmp_path / "main", [tmp_path / "other"])
    with pytest.raises(ConfigError, match="not a finished corpus build"):
        extra_stream_manifests(tmp_path / "main", [tmp_path / "none"])
    (tmp_path / "main" / "corpus.json").unlink()
    with pytest.raises(ConfigError, match="no corpus.json"):
        extra_stream_manifests(tmp_path / "main", [tmp_path / "extra"])
    # Without add-ons, a corpus needs no corpus.json.
    assert extra_stream_manifests(tmp_path / "main", []) == ()


def test_streams_cut_shorter_than_a_window_are_refused_in_one_line(tmp_path) -> None:
    _corpus(tmp_path / "main", 0, True, 20.0, 0.01)
    manifest = tmp_path / "main" / "manifest.csv"
    assert score_split(EnergyScorer(), manifest, "A", 1.5).stream_hours == pytest.approx(1.5 / 3600)
    with pytest.raises(ConfigError, match="1 s of stream .* shorter than the model's window"):
        score_split(EnergyScorer(), manifest, "A", 1.0)


def test_a_test_streams_add_on_is_refused_on_the_validation_split(tmp_path) -> None:
    _corpus(tmp_path / "main", 0, True, 20.0, 0.01)
    _corpus(tmp_path / "extra", 0, False, 30.0, 0.5)
    args = argparse.Namespace(
        corpus=tmp_path / "main", split="val", extra_streams=[tmp_path / "extra"]
    )
    with pytest.raises(ConfigError, match="holds no val streams"):
        run(args)


def test_only_extra_streams_without_an_add_on_is_refused(tmp_path) -> None:
    from wakefl.tools.bench.detection import main

    _corpus(tmp_path / "main", 0, True, 20.0, 0.01)
    with pytest.raises(ConfigError, match="--only-extra-streams"):
        main(["--weights", str(tmp_path / "w.safetensors"), "--corpus", str(tmp_path / "main"),
              "--only-extra-streams"])  # fmt: skip


def _one_hour(peaks: list[float], pos: list[float]) -> SplitScores:
    """Scores of one device type: an hour of silence-like stream windows at the shipped hop
    with isolated peaks, and wake-phrase clip scores `pos`."""
    stream = np.zeros(36000)
    stream[np.arange(len(peaks)) * 1000 + 500] = peaks
    return SplitScores(np.array(pos), np.zeros(4), [stream], 1.0, smoothing=1)


def test_one_threshold_for_all_types_is_set_on_their_streams_together() -> None:
    pos = [0.5, 0.92, 0.97, 0.99]
    per = {"A": _one_hour([0.9, 0.8], pos), "B": _one_hour([0.95], pos)}
    # Alone, an hour allows no false accept at 0.5 FA/h: each type needs its own peak beat.
    assert frr_at_fa(per["A"], 0.5)["threshold"] == 0.92
    assert frr_at_fa(per["B"], 0.5)["threshold"] == 0.97
    # Together, two hours allow one: B's 0.95 may fire once, A's 0.9 may not.
    p = pooled_operating_point(per, 0.5)
    assert p["threshold"] == 0.92 and p["resolved"] and p["stream_hours"] == 2.0
    assert p["fa_per_hour"] == 0.5
    assert p["by_type"]["A"]["fa_per_hour"] == 0.0 and p["by_type"]["B"]["fa_per_hour"] == 1.0
    assert p["by_type"]["A"]["frr"] == 0.25
    assert not pooled_operating_point({"A": per["A"]}, 0.5)["resolved"]
