"""Importing a user's recordings: decoding, resampling, length rule and the error report."""

from __future__ import annotations

import csv
import io
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from wakefl.errors import WakeflError
from wakefl.sdk.manifest import read_manifest
from wakefl.tools.cli import main
from wakefl.tools.corpus_import import import_recordings


def _espeak(text: str) -> tuple[np.ndarray, int]:
    out = subprocess.run(["espeak-ng", "-v", "en-us", "--stdout", text], capture_output=True, check=True)
    return sf.read(io.BytesIO(out.stdout), dtype="float32")


@pytest.fixture(scope="module")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real speech in several formats and rates, plus broken files of every kind."""
    src = tmp_path_factory.mktemp("recordings")
    phrase, sr = _espeak("hey nova")  # 22.05 kHz mono
    sentence, _ = _espeak("turn on the lights in the kitchen please")
    sf.write(src / "pos_22k.wav", phrase, sr)
    up = np.interp(np.arange(0, len(phrase), 0.5), np.arange(len(phrase)), phrase)  # 44.1 kHz
    sf.write(src / "pos_stereo.flac", np.stack([up, 0.5 * up], axis=1), 2 * sr)
    sf.write(src / "neg.ogg", sentence, sr, format="OGG", subtype="VORBIS")
    sf.write(src / "neg_long.wav", np.tile(sentence, 6), sr)  # > 10 s: becomes a stream
    sf.write(src / "neg_3s.wav", np.concatenate([np.zeros(sr), sentence[: len(phrase)], np.zeros(sr)]), sr)
    sf.write(src / "short.wav", phrase[: int(0.1 * sr)], sr)
    (src / "corrupt.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunk" + bytes(range(200)))
    (src / "empty.wav").write_bytes(b"")
    sf.write(src / "nolabel.wav", phrase, sr)
    sf.write(src / "silent.wav", np.zeros(sr, np.float32), sr)
    (src / "folder.wav").mkdir()
    rows = [
        ("pos_22k.wav", "1", "phone", "normal", "alice", ""),
        ("pos_stereo.flac", "1", "phone", "", "bob", "test"),
        ("neg.ogg", "0", "speaker", "playback", "", ""),
        ("neg_long.wav", "0", "speaker", "", "carol", ""),
        ("neg_3s.wav", "0", "phone", "alarm", "alice", ""),
        ("short.wav", "1", "phone", "", "", ""),
        ("corrupt.wav", "0", "phone", "", "", ""),
        ("empty.wav", "1", "phone", "", "", ""),
        ("nolabel.wav", "", "phone", "", "", ""),
        ("silent.wav", "0", "phone", "", "", ""),
        ("missing.wav", "0", "phone", "", "", ""),
        ("folder.wav", "0", "phone", "", "", ""),
        ("pos_22k.wav", "1", "phone", "", "", ""),
    ]
    with (src / "list.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "device_type", "state", "speaker", "split"])
        w.writerows(rows)
    return src


EXPECTED_BAD = {
    "short.wav": "too short",
    "corrupt.wav": "corrupt",
    "empty.wav": "empty",
    "nolabel.wav": "unlabeled",
    "silent.wav": "silent",
    "missing.wav": "missing",
    "folder.wav": "unreadable",
}


def test_report_lists_every_bad_file_with_its_reason(recordings: Path, tmp_path: Path) -> None:
    out = tmp_path / "imp"
    res = import_recordings(recordings, recordings / "list.csv", out, max_bad_share=0.9, progress=False)
    report = json.loads(res.report.read_text())
    assert report["rows"] == 13 and report["imported"] == 5 and report["bad"] == 8
    reasons = {e["path"]: e["detail"] for e in report["bad_files"]}
    for name, reason in EXPECTED_BAD.items():
        assert reasons[name].startswith(reason), (name, reasons[name])
    dup = [e for e in report["bad_files"] if e["path"] == "pos_22k.wav"]
    assert len(dup) == 1 and dup[0]["detail"].startswith("duplicate")
    with (out / "import_report.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 13  # every input row, good or bad

    rows = read_manifest(res.manifest)
    by_src = {r.path.split("_", 1)[1].rsplit(".", 1)[0]: r for r in rows}
    assert set(by_src) == {"pos_22k", "pos_stereo", "neg", "neg_long", "neg_3s"}
    assert by_src["neg_long"].kind == "stream" and by_src["neg_long"].duration_s > 10
    assert by_src["neg"].state == "playback" and by_src["neg_3s"].state == "alarm"
    assert by_src["pos_stereo"].split == "test"
    # The same speaker always lands in the same split.
    assert by_src["pos_22k"].split == by_src["neg_3s"].split
    for r in rows:
        x, sr = sf.read(str(r.resolve(res.manifest)), always_2d=True)
        assert sr == 16000 and x.shape[1] == 1
        assert x.shape[0] == round(r.duration_s * 16000)
        if r.kind == "clip":
            assert x.shape[0] == 24000
    # A 3 s file is cropped around its speech, centred, not to its leading silence.
    x3, _ = sf.read(str(by_src["neg_3s"].resolve(res.manifest)))
    src3, sr3 = sf.read(str(recordings / "neg_3s.wav"))
    assert np.sum(x3**2) / 16000 > 0.98 * np.sum(src3**2) / sr3  # energy per second of audio
    assert np.sum(x3[:4000] ** 2) < 0.01 * np.sum(x3**2)
    assert np.sum(x3[10000:14000] ** 2) > 0.1 * np.sum(x3**2)


def test_import_fails_loudly_above_the_bad_share(recordings: Path, tmp_path: Path) -> None:
    out = tmp_path / "imp"
    with pytest.raises(WakeflError, match=r"8 of 13 files are bad") as exc:
        import_recordings(recordings, recordings / "list.csv", out, max_bad_share=0.1, progress=False)
    assert "corrupt.wav" in str(exc.value)
    assert (out / "import_report.json").is_file()
    assert not (out / "manifest.csv").exists()


def test_cli_import(recordings: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["corpus", "import", "--src", str(recordings), "--manifest", str(recordings / "list.csv"),
                 "--out", str(tmp_path / "bad"), "--quiet"])  # fmt: skip
    assert code == 2
    assert "files are bad" in capsys.readouterr().err
    code = main(["corpus", "import", "--src", str(recordings), "--manifest", str(recordings / "list.csv"),
                 "--out", str(tmp_path / "ok"), "--max-bad-share", "0.9", "--quiet"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "imported 5 of 13 files" in printed and "missing.wav" in printed
    (tmp_path / "cols.csv").write_text("file,label\nx.wav,1\n")
    assert main(["corpus", "import", "--src", str(recordings), "--manifest", str(tmp_path / "cols.csv"),
                 "--out", str(tmp_path / "c")]) == 2  # fmt: skip
    assert "missing column(s) path, device_type" in capsys.readouterr().err
