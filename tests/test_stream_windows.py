"""Negative windows of a device's own streams, joined to its validation clips for the
served-model gate (sdk/stream_windows.py, `wakefl device --val-stream-hop`)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from wakefl.errors import ConfigError
from wakefl.sdk.dataset import WakeWordDataset
from wakefl.sdk.manifest import SAMPLE_RATE, ManifestRow, write_manifest
from wakefl.sdk.stream_windows import (
    ADDON_UNIT_PREFIX,
    UNIT_SECONDS,
    JoinedDataset,
    StreamWindows,
)

WINDOW = 24000


def _corpus(tmp_path: Path, stream_s: float = 70.0) -> Path:
    """Two training and two validation clips and one validation stream of type A (a ramp,
    so every window's place in the stream can be read from its samples), one stream of
    type B, and one of each other split of A."""
    rng = np.random.default_rng(0)
    rows = []
    (tmp_path / "clips").mkdir(parents=True)
    for split in ("train", "val"):
        for i, label in enumerate((1, 0)):
            rel = f"clips/A_{split}_{i}.wav"
            wave = rng.uniform(-0.1, 0.1, WINDOW).astype(np.float32)
            sf.write(tmp_path / rel, wave, SAMPLE_RATE)
            rows.append(ManifestRow(rel, label, "A", "normal", f"spk{i}", split, 1.5, "clip"))
    n = int(stream_s * SAMPLE_RATE)
    ramp = (np.arange(n) / n * 0.5).astype(np.float32)
    (tmp_path / "streams").mkdir()
    streams = (("a_val", "A", "val"), ("b_val", "B", "val"), ("a_test", "A", "test"),
               ("a_train", "A", "train"))  # fmt: skip
    for name, dev, split in streams:
        sf.write(tmp_path / f"streams/{name}.wav", ramp, SAMPLE_RATE, subtype="FLOAT")
        rows.append(
            ManifestRow(f"streams/{name}.wav", 0, dev, "normal", "mixed-val", split, stream_s,
                        "stream")
        )  # fmt: skip
    return write_manifest(rows, tmp_path / "manifest.csv")


def test_stream_windows_cover_the_split_streams_of_the_device_type(tmp_path):
    manifest = _corpus(tmp_path)
    windows = StreamWindows(manifest, "A", "val", WINDOW, hop_s=0.5)
    n = int(70.0 * SAMPLE_RATE)
    starts = list(range(0, n - WINDOW + 1, SAMPLE_RATE // 2))
    assert windows.streams == 1 and len(windows) == len(starts)
    assert windows.labels.tolist() == [0] * len(starts)
    ramp = (np.arange(n) / n * 0.5).astype(np.float32)
    for i in (0, 7, len(starts) - 1):
        wave, label = windows[i]
        assert label == 0 and wave.shape == (WINDOW,)
        np.testing.assert_allclose(wave.numpy(), ramp[starts[i] : starts[i] + WINDOW], atol=1e-6)
    # Bootstrap units: the 30-second stretches of the stream.
    units = [r.speaker for r in windows.rows]
    expected = {f"streams/a_val.wav@{k}" for k in range(int(70.0 // UNIT_SECONDS) + 1)}
    assert set(units) == expected
    assert all(r.split == "val" and r.device_type == "A" for r in windows.rows)
    assert len(StreamWindows(manifest, "C", "val", WINDOW, hop_s=0.5)) == 0
    with pytest.raises(ConfigError):
        StreamWindows(manifest, "A", "val", WINDOW, hop_s=0.0)


def test_joined_dataset_keeps_the_clips_first_then_the_windows(tmp_path):
    manifest = _corpus(tmp_path)
    clips = WakeWordDataset(manifest, "A", "val", window_samples=WINDOW)
    windows = StreamWindows(manifest, "A", "val", WINDOW, hop_s=2.0)
    joined = JoinedDataset(clips, windows)
    assert len(joined) == len(clips) + len(windows)
    assert joined.labels.tolist() == clips.labels.tolist() + [0] * len(windows)
    assert [r.speaker for r in joined.rows[:2]] == ["spk0", "spk1"]
    np.testing.assert_array_equal(joined[1][0].numpy(), clips[1][0].numpy())
    np.testing.assert_array_equal(joined[2][0].numpy(), windows[0][0].numpy())
    np.testing.assert_array_equal(joined[-1][0].numpy(), windows[len(windows) - 1][0].numpy())


def test_device_gate_sees_the_validation_stream_windows(tmp_path):
    from wakefl.tools.cli.device import _load_clips

    manifest = _corpus(tmp_path)
    said: list[str] = []

    def args(hop: float, train_hop: float = 0.0) -> argparse.Namespace:
        return argparse.Namespace(
            data=manifest, device_type="A", device_id="devA", width=0.25, fleet="f",
            val_stream_hop=hop, train_stream_hop=train_hop,
        )  # fmt: skip

    _, val = _load_clips(args(0.5), said.append)
    assert isinstance(val, JoinedDataset) and len(val) == 2 + len(val.parts[1])
    assert "2 validation examples" not in said[-1] and "2 clips and" in said[-1]
    _, clips_only = _load_clips(args(0.0), said.append)
    assert isinstance(clips_only, WakeWordDataset) and len(clips_only) == 2
    with pytest.raises(ConfigError):
        _load_clips(args(-1.0), said.append)
    # Training streams join the training clips only when asked.
    train, _ = _load_clips(args(0.0), said.append)
    assert isinstance(train, WakeWordDataset) and len(train) == 2
    train, _ = _load_clips(args(0.0, train_hop=1.5), said.append)
    assert isinstance(train, JoinedDataset) and train.labels.sum() == 1
    assert len(train) == 2 + (int(70.0 * SAMPLE_RATE) - WINDOW) // int(1.5 * SAMPLE_RATE) + 1
    assert {r.split for r in train.rows} == {"train"}


def test_a_devices_gate_takes_more_validation_streams_from_an_addon(tmp_path):
    from wakefl.tools.cli.device import _load_clips

    manifest = _corpus(tmp_path / "corpus")
    addon = _corpus(tmp_path / "addon", stream_s=40.0)  # the same stream names, shorter
    said: list[str] = []

    def args(**kw) -> argparse.Namespace:
        base = {"data": manifest, "device_type": "A", "device_id": "devA", "width": 0.25,
                "fleet": "f", "val_stream_hop": 0.5, "train_stream_hop": 0.0}  # fmt: skip
        return argparse.Namespace(**(base | kw))

    _, own = _load_clips(args(), said.append)
    _, more = _load_clips(args(val_streams=addon), said.append)
    extra = StreamWindows(addon, "A", "val", WINDOW, hop_s=0.5)
    assert len(more) == len(own) + len(extra)
    assert more.labels.tolist() == own.labels.tolist() + [0] * len(extra)
    assert f"{len(extra)} windows of 1 stream(s) of {addon}" in said[-1]
    # The add-on's stream is its own bootstrap unit, though its file has the corpus's name.
    own_units = {r.speaker for r in own.rows}
    addon_units = {r.speaker for r in more.rows[len(own) :]}
    assert addon_units and not addon_units & own_units
    assert all(u.startswith(f"{ADDON_UNIT_PREFIX}streams/a_val.wav@") for u in addon_units)
    # The same add-on elsewhere: the same units, so the gate draws the same bootstrap.
    moved = tmp_path / "moved"
    shutil.copytree(addon.parent, moved)
    _, there = _load_clips(args(val_streams=moved / addon.name), said.append)
    assert [r.speaker for r in there.rows] == [r.speaker for r in more.rows]
    # ... and they sort before the corpus's own units, where the bootstrap counts them first.
    assert max(addon_units) < min(own_units)
    # Training is untouched, and a missing add-on is refused with its name.
    train, _ = _load_clips(args(val_streams=addon), said.append)
    assert isinstance(train, WakeWordDataset) and len(train) == 2
    with pytest.raises(ConfigError, match="no such manifest"):
        _load_clips(args(val_streams=tmp_path / "missing.csv"), said.append)
    with pytest.raises(ConfigError, match="needs --val-stream-hop"):
        _load_clips(args(val_streams=addon, val_stream_hop=0.0), said.append)
