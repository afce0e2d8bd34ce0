"""The synthetic corpus: determinism, splits, decodability, sizes, device heterogeneity."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from wakefl.errors import ConfigError
from wakefl.sdk.manifest import CLIP_SAMPLES, STATES, read_manifest
from wakefl.tools.corpus.build import build_corpus
from wakefl.tools.corpus.plan import CorpusProfile
from wakefl.tools.studies.corpus_stats import band_features, nearest_centroid_accuracy

# Smaller than tiny, so that two cold builds (speech rendered twice) stay cheap.
MICRO = CorpusProfile("micro", n_speakers=8, train_unit=2, val_clips=3, test_clips=3,
                      streams_per_device=1, stream_seconds=4.0, confusables_per_speaker=2,
                      others_per_speaker=2, rooms_per_device=2)  # fmt: skip


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_same_seed_gives_byte_identical_corpus(tmp_path: Path) -> None:
    # Separate speech caches: both builds synthesize from scratch, so the engines'
    # determinism is checked too, not only the cache.
    m1 = build_corpus(
        tmp_path / "a", seed=3, profile=MICRO, progress=False, tts_cache_dir=tmp_path / "tts1"
    )
    m2 = build_corpus(
        tmp_path / "b", seed=3, profile=MICRO, progress=False, tts_cache_dir=tmp_path / "tts2"
    )
    d1, d2 = _digest(m1.parent), _digest(m2.parent)
    assert "manifest.csv" in d1 and len(d1) > 30
    assert d1 == d2
    # A rebuild in place gives the same bytes again.
    build_corpus(
        tmp_path / "a", seed=3, profile=MICRO, progress=False, tts_cache_dir=tmp_path / "tts1"
    )
    assert _digest(m1.parent) == d1
    # Another seed gives other audio.
    m3 = build_corpus(
        tmp_path / "c", seed=4, profile=MICRO, progress=False, tts_cache_dir=tmp_path / "tts1"
    )
    d3 = _digest(m3.parent)
    wavs = [k for k in d1 if k.endswith(".wav") and k in d3]
    assert sum(d1[k] != d3[k] for k in wavs) > 0.9 * len(wavs)


def test_refuses_to_write_into_a_foreign_folder(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        build_corpus(tmp_path, profile=MICRO, progress=False)
    with pytest.raises(ConfigError, match="profile"):
        build_corpus(tmp_path / "x", profile="huge", progress=False)


def test_speakers_are_disjoint_between_splits(tiny_corpus: Path) -> None:
    rows = read_manifest(tiny_corpus)
    by_split = {s: {r.speaker for r in rows if r.split == s} for s in ("train", "val", "test")}
    assert all(len(v) > 3 for v in by_split.values())
    assert not by_split["train"] & by_split["test"]
    assert not by_split["train"] & by_split["val"]
    assert not by_split["val"] & by_split["test"]
    # Positives come from many synthetic speakers.
    assert len({r.speaker for r in rows if r.label == 1}) >= 20


def test_every_file_decodes_at_16k_mono_with_its_duration(tiny_corpus: Path) -> None:
    rows = read_manifest(tiny_corpus)
    for r in rows:
        info = sf.info(str(r.resolve(tiny_corpus)))
        assert (info.samplerate, info.channels, info.subtype, info.format) == (
            16000,
            1,
            "PCM_16",
            "WAV",
        )
        assert info.frames == round(r.duration_s * 16000), r.path
        if r.kind == "clip":
            assert info.frames == CLIP_SAMPLES
    # Audio is not silence: positives carry speech well above the room tone.
    for r in [r for r in rows if r.label == 1][:50]:
        x, _ = sf.read(str(r.resolve(tiny_corpus)))
        assert np.max(np.abs(x)) > 0.02


def test_sizes_volumes_and_coverage(tiny_corpus: Path) -> None:
    rows = read_manifest(tiny_corpus)
    clips = [r for r in rows if r.kind == "clip"]
    assert 500 <= len(clips) <= 800
    devices = sorted({r.device_type for r in rows})
    assert devices == ["A", "B", "C", "D", "E"]
    train = Counter(r.device_type for r in clips if r.split == "train")
    assert max(train.values()) >= 3 * min(train.values())
    for d in devices:
        for split in ("val", "test"):
            sub = [r for r in clips if r.device_type == d and r.split == split]
            assert {r.label for r in sub} == {0, 1}, (d, split)
            assert {r.state for r in sub} == set(STATES), (d, split)
        streams = [r for r in rows if r.device_type == d and r.kind == "stream"]
        assert streams and all(r.label == 0 and r.duration_s >= 30 for r in streams)
    share_pos = np.mean([r.label for r in clips])
    assert 0.3 < share_pos < 0.6


def test_device_types_differ_measurably(tiny_corpus: Path) -> None:
    """A nearest-centroid classifier on five log band-energy shares, fitted on training
    clips, tells the device type of held-out clips far above chance (20 %)."""
    rows = [r for r in read_manifest(tiny_corpus) if r.kind == "clip"]
    feats = {r.path: band_features(sf.read(str(r.resolve(tiny_corpus)))[0]) for r in rows}
    assert nearest_centroid_accuracy(feats, rows) > 0.4
    devices = sorted({r.device_type for r in rows})
    centroids = {
        d: np.mean(
            [feats[r.path] for r in rows if r.split == "train" and r.device_type == d], axis=0
        )
        for d in devices
    }
    # The narrowband device (D) has far less energy above 4 kHz than the phone (B).
    assert centroids["D"][4] < centroids["B"][4] - 1.0


def test_each_stream_has_a_transcript_of_what_is_said_when(tiny_corpus: Path) -> None:
    from wakefl.tools.corpus.plan import PROFILES
    from wakefl.tools.corpus.speakers import make_speakers
    from wakefl.tools.corpus.transcripts import read_transcript

    speakers = {s.speaker_id: s for s in make_speakers(0, PROFILES["tiny"], "hey nova")}
    streams = [r for r in read_manifest(tiny_corpus) if r.kind == "stream"]
    assert streams
    louder = []
    for r in streams:
        path = r.resolve(tiny_corpus)
        said = read_transcript(path)
        assert said, r.path
        assert all(a.end_s <= b.start_s for a, b in zip(said, said[1:], strict=False))
        assert said[0].start_s > 0 and said[-1].end_s <= r.duration_s + 1e-3
        for u in said:
            spk = speakers[u.speaker]
            assert spk.split == r.split
            assert u.text in (spk.confusables if u.content == "conf" else spk.others)
        if r.state == "normal":
            # The transcript is where the speech is: those spans carry more energy than
            # the pauses between them.
            x, sr = sf.read(str(path))
            spoken = np.zeros(x.size, dtype=bool)
            for u in said:
                spoken[int(u.start_s * sr) : int(u.end_s * sr)] = True
            louder.append(np.mean(x[spoken] ** 2) > 2 * np.mean(x[~spoken] ** 2))
    assert louder and all(louder)


def test_a_clip_name_records_its_content(tiny_corpus: Path) -> None:
    from wakefl.tools.corpus.plan import POSITIVE_CONTENTS, clip_content

    rows = [r for r in read_manifest(tiny_corpus) if r.kind == "clip"]
    contents = [clip_content(r.path) for r in rows]
    assert {"pos", "conf", "other"} <= set(contents)
    assert [int(c in POSITIVE_CONTENTS) for c in contents] == [r.label for r in rows]
    # Names this recipe did not give (an imported recording, a stream, a look-alike) say nothing.
    for path in (
        "clips/A/train/000012_kitchen_other.wav",
        "clips/A/train/B_train_00001_other.wav",
        "clips/A/train/A_train_00001_whisper.wav",
        "streams/A_stream_000.wav",
    ):
        assert clip_content(path) == ""
    assert clip_content("clips/A/train/A_train_00001_conf_run.wav") == "conf_run"
