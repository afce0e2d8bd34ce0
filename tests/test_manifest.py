"""The manifest format and the torch Dataset loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from wakefl.errors import ConfigError
from wakefl.sdk.dataset import WakeWordDataset, list_device_types
from wakefl.sdk.manifest import COLUMNS, ManifestRow, read_manifest, write_manifest

HEADER = ",".join(COLUMNS)
GOOD = "clips/a.wav,1,A,normal,spk001,train,1.5000,clip"


def _write(tmp_path: Path, *lines: str, header: str = HEADER) -> Path:
    p = tmp_path / "manifest.csv"
    p.write_text("\n".join([header, *lines]) + "\n", encoding="utf-8")
    return p


def test_round_trip_is_exact(tmp_path: Path) -> None:
    rows = [
        ManifestRow("clips/a.wav", 1, "A", "normal", "spk001", "train", 1.5, "clip"),
        ManifestRow("streams/s.wav", 0, "B", "alarm", "mixed-test", "test", 61.25, "stream"),
    ]
    p = write_manifest(rows, tmp_path / "manifest.csv")
    assert read_manifest(p) == rows
    first = p.read_bytes()
    write_manifest(read_manifest(p), p)
    assert p.read_bytes() == first


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("clips/a.wav,2,A,normal,spk001,train,1.5,clip", "'label' must be 0 or 1"),
        ("clips/a.wav,,A,normal,spk001,train,1.5,clip", "'label' must be 0 or 1"),
        ("clips/a.wav,1,,normal,spk001,train,1.5,clip", "'device_type'"),
        ("clips/a.wav,1,A,party,spk001,train,1.5,clip", "'state' must be one of"),
        ("clips/a.wav,1,A,normal,,train,1.5,clip", "'speaker'"),
        ("clips/a.wav,1,A,normal,spk001,dev,1.5,clip", "'split' must be one of"),
        ("clips/a.wav,1,A,normal,spk001,train,abc,clip", "not a number"),
        ("clips/a.wav,1,A,normal,spk001,train,nan,clip", "positive finite"),
        ("clips/a.wav,1,A,normal,spk001,train,2.0,clip", "must last 1.5 s"),
        ("clips/a.wav,1,A,normal,spk001,train,1.5,song", "'kind' must be one of"),
        ("s.wav,1,A,normal,spk001,test,90,stream", "label must be 0"),
        ("/abs/a.wav,1,A,normal,spk001,train,1.5,clip", "relative"),
        ("../a.wav,1,A,normal,spk001,train,1.5,clip", "relative"),
        ("clips/a.wav,1,A,normal,spk001,train", "wrong number of fields"),
    ],
)
def test_bad_rows_are_named_with_line_and_field(tmp_path: Path, line: str, message: str) -> None:
    p = _write(tmp_path, GOOD.replace("a.wav", "ok.wav"), line)
    with pytest.raises(ConfigError, match=message) as exc:
        read_manifest(p)
    assert f"{p}:3" in str(exc.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        read_manifest(tmp_path / "none.csv")
    with pytest.raises(ConfigError, match="missing column"):
        read_manifest(_write(tmp_path, "x.wav,1,A", header="path,label,device_type"))
    with pytest.raises(ConfigError, match="no files"):
        read_manifest(_write(tmp_path))
    with pytest.raises(ConfigError, match="already listed"):
        read_manifest(_write(tmp_path, GOOD, GOOD))
    with pytest.raises(ConfigError, match="label"):
        write_manifest(
            [ManifestRow("a.wav", 3, "A", "normal", "s", "train", 1.5, "clip")], tmp_path / "m.csv"
        )


def test_dataset_shapes_labels_and_augmentation(tiny_corpus: Path) -> None:
    assert list_device_types(tiny_corpus) == ["A", "B", "C", "D", "E"]
    rows = read_manifest(tiny_corpus)
    want = [r for r in rows if r.device_type == "C" and r.split == "val" and r.kind == "clip"]
    ds = WakeWordDataset(tiny_corpus, "C", "val")
    assert len(ds) == len(want)
    wave, label = ds[0]
    assert wave.dtype == torch.float32 and wave.shape == (24000,)
    assert [ds[i][1] for i in range(len(ds))] == [r.label for r in want]
    assert 0 < float(wave.abs().max()) <= 1.0

    aug = WakeWordDataset(tiny_corpus, "C", "val", augment=True, seed=5)
    again = WakeWordDataset(tiny_corpus, "C", "val", augment=True, seed=5)
    a0, b0 = aug[0][0], again[0][0]
    assert torch.equal(a0, b0)  # same seed, epoch and index: same draw
    assert not torch.equal(a0, wave)
    aug.set_epoch(1)
    assert not torch.equal(aug[0][0], a0)
    assert aug[0][1] == label

    short = WakeWordDataset(tiny_corpus, "C", "val", window_samples=16000)
    assert short[0][0].shape == (16000,)
    loader = torch.utils.data.DataLoader(ds, batch_size=8)
    xb, yb = next(iter(loader))
    assert xb.shape == (8, 24000) and yb.dtype == torch.int64
    assert np.isfinite(xb.numpy()).all()


def test_dataset_errors(tiny_corpus: Path) -> None:
    with pytest.raises(ConfigError, match="device types present: A, B, C, D, E"):
        WakeWordDataset(tiny_corpus, "Z", "train")
    with pytest.raises(ConfigError, match="split"):
        WakeWordDataset(tiny_corpus, "A", "dev")
