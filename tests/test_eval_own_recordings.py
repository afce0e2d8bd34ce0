"""`wakefl eval` on a user's own recordings, imported with `wakefl corpus import`: wake-word
clips as positives and long recordings as negatives, which the importer keeps as streams.
The shipped model alone gets FRR and FA/h with their resolution; a comparison gives FR and
FA/h instead of n/a, and the console says why the clip FA cells are empty."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from wakefl.models.kws_cnn.pretrained import pretrained_card, pretrained_path
from wakefl.sdk.manifest import read_manifest
from wakefl.tools.cli import main
from wakefl.tools.evaluation.model_scoring import (
    detection_times,
    load_clip_windows,
    load_scorer,
    score_windows,
    stream_posteriors,
)


@pytest.fixture(scope="module")
def own_corpus(tiny_corpus, tmp_path_factory) -> Path:
    """12 wake-word clips and 2 negative recordings of 40 s, of device types A and B,
    imported as a user would import theirs."""
    src = tiny_corpus.parent
    rows = [r for r in read_manifest(tiny_corpus) if r.split == "test" and r.device_type in "AB"]
    pos = [r for r in rows if r.kind == "clip" and r.label == 1][:12]
    neg = [r for r in rows if r.kind == "stream"][:2]
    assert len(pos) == 12 and len(neg) == 2 and all(r.duration_s >= 10 for r in neg)
    labels = tmp_path_factory.mktemp("own") / "labels.csv"
    with labels.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "device_type", "state", "speaker", "split"])
        for r in pos + neg:
            w.writerow([r.path, r.label, r.device_type, r.state, r.speaker, "test"])
    out = labels.parent / "corpus"
    assert (
        main(["corpus", "import", "--src", str(src), "--manifest", str(labels), "--out", str(out)])
        == 0
    )
    manifest = out / "manifest.csv"
    kinds = {(r.label, r.kind) for r in read_manifest(manifest)}
    assert kinds == {(1, "clip"), (0, "stream")}
    return manifest


def test_the_shipped_model_alone_gets_frr_and_fa_per_hour(own_corpus, capsys):
    capsys.readouterr()
    argv = ["eval", "--baseline", "pretrained:small", "--manifest", str(own_corpus), "--quiet"]
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    threshold = pretrained_card("small")["threshold"]
    assert got["threshold_source"] == "the model's shipped threshold"
    rows = {r["device_type"]: r for r in got["rows"]}
    assert set(rows) == {"A", "B", "all"}
    # the figures, recomputed from the model's scores and the streaming detector
    manifest = read_manifest(own_corpus)
    scorer = load_scorer(pretrained_path("small"))
    for d in ("A", "B"):
        clips = [r for r in manifest if r.kind == "clip" and r.device_type == d]
        win = load_clip_windows(clips, own_corpus.parent, 16000, 24000, progress=False)
        scores = score_windows(scorer, win, 16, desc="", progress=False)
        streams = [r for r in manifest if r.kind == "stream" and r.device_type == d]
        events = 0
        for s in streams:
            from wakefl.edge_runtime import load_audio

            wave = load_audio(own_corpus.parent / s.path, 16000)
            events += len(
                detection_times(stream_posteriors(scorer, wave, 0.1, None, None), threshold)
            )
        hours = sum(s.duration_s for s in streams) / 3600
        r = rows[d]
        assert r["threshold"] == threshold and r["n_positive"] == len(clips)
        assert r["frr"] == pytest.approx(float(np.mean(scores < threshold)))
        assert r["frr_resolution"] == pytest.approx(1 / len(clips))
        assert r["fa_per_hour"] == pytest.approx(events / hours)
        assert r["fa_per_hour_resolution"] == pytest.approx(1 / hours)
        assert r["clip_fa"] is None  # no negative clips: the streams measure FA
    assert rows["all"]["n_positive"] == rows["A"]["n_positive"] + rows["B"]["n_positive"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "at the model's shipped threshold" in text and "±1 clip" in text


def test_a_comparison_on_clip_positives_and_stream_negatives(own_corpus, capsys):
    capsys.readouterr()
    argv = ["eval", "--baseline", "pretrained:small", "--candidate", str(pretrained_path("small"))]
    argv += ["--manifest", str(own_corpus), "--at-shipped-threshold", "--quiet", "--n-boot", "20"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    typed = [r for r in rows if r["device_type"] in "AB" and r["state"] == "all"]
    assert typed and all(r["fr"] is not None and r["fa_per_hour"] is not None for r in typed)
    assert all(r["relative_fr"] in (1.0, None) and r["fa"] is None for r in typed)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "n/a cells:" in text and "no negative clips here: FA not measured" in text


def test_a_model_without_a_threshold_is_refused_alone(own_corpus, tiny_kws_onnx, capsys):
    capsys.readouterr()
    rc = main(["eval", "--baseline", str(tiny_kws_onnx), "--manifest", str(own_corpus), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "no shipped threshold" in err and "--threshold" in err


def _labels_without_split(tiny_corpus: Path, folder: Path, with_stream: bool) -> Path:
    """A CSV as a device maker writes one, with no split column: 10 wake-word clips of five
    speakers, 2 other clips and, `with_stream`, one long negative recording."""
    rows = [r for r in read_manifest(tiny_corpus) if r.split == "test" and r.device_type == "A"]
    pos = [r for r in rows if r.kind == "clip" and r.label == 1][:10]
    neg = [r for r in rows if r.kind == "clip" and r.label == 0][:2]
    stream = [r for r in rows if r.kind == "stream"][:1] if with_stream else []
    speakers = ("anna", "ben", "chloe", "dev", "emma")
    labels = folder / ("labels-stream.csv" if with_stream else "labels.csv")
    with labels.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "device_type", "speaker"])
        for i, r in enumerate(pos + neg + stream):
            w.writerow([r.path, r.label, "A", speakers[i % 5] if r.label else "background"])
    return labels


def _import(tiny_corpus: Path, labels: Path, out: Path, *extra: str) -> Path:
    argv = ["corpus", "import", "--src", str(tiny_corpus.parent), "--manifest", str(labels)]
    assert main([*argv, "--out", str(out), "--quiet", *extra]) == 0
    return out / "manifest.csv"


def test_an_import_for_evaluation_keeps_every_clip_in_the_scored_split(
    tiny_corpus, tmp_path, capsys
):
    labels = _labels_without_split(tiny_corpus, tmp_path, with_stream=True)
    drawn = _import(tiny_corpus, labels, tmp_path / "drawn")
    out = capsys.readouterr().out
    # Without --split, the speakers are drawn 70/15/15 for training, and the import says so.
    assert "had no split" in out and "--split test" in out
    assert {r.split for r in read_manifest(drawn) if r.label == 1} != {"test"}

    manifest = _import(tiny_corpus, labels, tmp_path / "eval", "--split", "test")
    assert "had no split" not in capsys.readouterr().out
    rows = read_manifest(manifest)
    assert len(rows) == 13 and {r.split for r in rows} == {"test"}
    argv = ["eval", "--baseline", "pretrained:small", "--manifest", str(manifest), "--quiet"]
    assert main([*argv, "--json"]) == 0
    got = {r["device_type"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    stream_s = sum(r.duration_s for r in rows if r.kind == "stream")
    assert got["A"]["n_positive"] == 10 and got["A"]["frr"] is not None
    assert got["A"]["n_negative_clips"] == 2
    assert got["A"]["stream_hours"] == pytest.approx(stream_s / 3600)
    assert main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    head = next(ln for ln in table if ln.startswith("device"))
    assert "wake" in head and "stream h" in head and "neg clips" in head
    a_row = next(ln for ln in table if ln.startswith("A "))
    assert a_row.split()[-1] == "2" and f"{stream_s / 3600:.3f}" in a_row


def test_an_n_a_cell_says_which_recordings_would_fill_it(tiny_corpus, tmp_path, capsys):
    labels = _labels_without_split(tiny_corpus, tmp_path, with_stream=False)
    manifest = _import(tiny_corpus, labels, tmp_path / "eval", "--split", "test")
    capsys.readouterr()
    argv = ["eval", "--baseline", "pretrained:small", "--manifest", str(manifest), "--quiet"]
    assert main(argv) == 0
    alone = capsys.readouterr().out
    assert "no negative streams: FA/h not measured; to measure it, add negative " in alone
    assert "recordings of 10 s or more" in alone and "to the test split" in alone
    argv += ["--candidate", str(pretrained_path("small")), "--at-shipped-threshold"]
    assert main([*argv, "--n-boot", "20"]) == 0
    compared = capsys.readouterr().out
    assert "n/a cells:" in compared and "str h" in compared
    assert "to measure it, add negative recordings of 10 s or more" in compared
