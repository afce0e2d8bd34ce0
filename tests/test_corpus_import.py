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
from wakefl.tools.corpus.importer import import_recordings


def _espeak(text: str) -> tuple[np.ndarray, int]:
    out = subprocess.run(
        ["espeak-ng", "-v", "en-us", "--stdout", text], capture_output=True, check=True
    )
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
    sf.write(
        src / "neg_3s.wav",
        np.concatenate([np.zeros(sr), sentence[: len(phrase)], np.zeros(sr)]),
        sr,
    )
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
    res = import_recordings(
        recordings, recordings / "list.csv", out, max_bad_share=0.9, progress=False
    )
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
        import_recordings(
            recordings, recordings / "list.csv", out, max_bad_share=0.1, progress=False
        )
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


# --- locating the phrase, background padding, names, leakage, --force ----------------------


def _trimmed_phrase() -> np.ndarray:
    """ "hey nova" from espeak-ng at 16 kHz, without its leading and trailing silence."""
    import librosa

    x, sr = _espeak("hey nova")
    x = librosa.resample(x, orig_sr=sr, target_sr=16000)
    on = np.flatnonzero(np.abs(x) > 0.02 * np.abs(x).max())
    return x[on[0] : on[-1] + 1]


def _write_csv(path: Path, header: list[str], rows: list[tuple]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def _report_rows(out: Path) -> dict[str, dict[str, str]]:
    return {e["path"]: e for e in json.loads((out / "import_report.json").read_text())["files"]}


def test_long_positives_are_cropped_around_the_phrase_not_the_loud_music(tmp_path: Path) -> None:
    from wakefl.tools.acoustics.background_sounds import alarm_tones, music_like

    phrase = _trimmed_phrase()
    level = np.sqrt(np.mean(phrase**2))
    src = tmp_path / "src"
    src.mkdir()
    placed, rows = {}, []
    cases = [
        ("music", music_like, 4.0, 0.6),
        ("music", music_like, 6.0, 4.1),
        ("music", music_like, 5.0, 2.2),
        ("alarm", alarm_tones, 4.5, 3.0),
        ("alarm", alarm_tones, 7.0, 0.9),
    ]
    for i, (kind, make, seconds, offset) in enumerate(cases):
        # Background twice as loud (RMS) as the speech: the loudest 1.5 s is not the phrase.
        x = 2.0 * level * make(np.random.default_rng(i), int(seconds * 16000))
        start = int(offset * 16000)
        x[start : start + phrase.size] += phrase
        name = f"{kind}{i}.wav"
        sf.write(src / name, np.clip(x, -1, 1).astype(np.float32), 16000, subtype="PCM_16")
        placed[name] = (offset, offset + phrase.size / 16000)
        rows.append((name, "1", "A", "playback", f"spk{i}", "test", "", ""))
    sf.write(
        src / "marked.wav",
        np.clip(2.0 * level * music_like(np.random.default_rng(9), 12 * 16000), -1, 1),
        16000,
    )
    rows.append(("marked.wav", "1", "A", "playback", "spk9", "test", "7.25", "8.0"))
    out = tmp_path / "out"
    _write_csv(
        src / "list.csv",
        ["path", "label", "device_type", "state", "speaker", "split", "onset_s", "offset_s"],
        rows,
    )
    import_recordings(src, src / "list.csv", out, progress=False)
    report = _report_rows(out)
    for name, (a, b) in placed.items():
        lo, hi = (float(v) for v in report[name]["crop"].removesuffix(" s").split("-"))
        assert lo <= a and b <= hi, (name, (a, b), (lo, hi))
        # The rule is named: the voice-activity model, or where music drowns the voice for
        # it, the band-energy rule.
        assert "cropped around the speech found by the " in report[name]["detail"]
    # The onset/offset columns win, also in a file longer than a stream (12 s).
    assert report["marked.wav"]["crop"] == "6.875-8.375 s"
    assert "onset/offset" in report["marked.wav"]["detail"]


def _beep(n: int) -> np.ndarray:
    """An alarm beep: a 440 Hz square wave."""
    return np.sign(np.sin(2 * np.pi * 440 * np.arange(n) / 16000))


def _clatter(n: int, rng: np.random.Generator) -> np.ndarray:
    """Knocks and dishes: broadband hits that ring down in a few milliseconds."""
    x = np.zeros(n)
    for at in rng.uniform(0, n - 1600, 6).astype(int):
        hit = rng.standard_normal(1600) * np.exp(-np.arange(1600) / rng.uniform(150, 500))
        x[at : at + 1600] += hit / np.abs(hit).max()
    return x


@pytest.mark.parametrize("burst", ["beep", "clatter"])
def test_a_short_loud_burst_does_not_pull_the_crop_off_the_phrase(
    burst: str, tmp_path: Path
) -> None:
    """6 s recordings with the phrase before or after a 1 s burst peaking four times as
    high: the crop keeps at least 90% of the phrase."""
    phrase = _trimmed_phrase()
    phrase = 0.2 * phrase / np.abs(phrase).max()
    src = tmp_path / "src"
    src.mkdir()
    placed, rows = {}, []
    for i, (at, burst_at) in enumerate([(0.4, 3.0), (1.2, 4.5), (4.6, 1.0), (3.5, 0.3)]):
        rng = np.random.default_rng(i)
        x = 0.002 * rng.standard_normal(6 * 16000)
        noise = _beep(16000) if burst == "beep" else _clatter(16000, rng)
        x[int(burst_at * 16000) : int(burst_at * 16000) + 16000] += 0.8 * noise
        x[int(at * 16000) : int(at * 16000) + phrase.size] += phrase
        name = f"{burst}{i}.wav"
        sf.write(src / name, x.astype(np.float32), 16000, subtype="PCM_16")
        placed[name] = (at, at + phrase.size / 16000)
        rows.append((name, "1", "A", "normal", f"spk{i}", "test"))
    _write_csv(
        src / "list.csv", ["path", "label", "device_type", "state", "speaker", "split"], rows
    )
    import_recordings(src, src / "list.csv", tmp_path / "out", progress=False)
    report = _report_rows(tmp_path / "out")
    for name, (a, b) in placed.items():
        lo, hi = (float(v) for v in report[name]["crop"].removesuffix(" s").split("-"))
        kept = max(0.0, min(b, hi) - max(a, lo)) / (b - a)
        assert kept >= 0.9, (name, (a, b), (lo, hi))
        assert "voice-activity model (silero-vad" in report[name]["detail"]


@pytest.mark.parametrize(
    ("prob", "total", "start"),
    [
        ([0.0] * 60, 60 * 512, None),  # no speech: the band-energy rule decides
        ([0.0] * 30 + [0.9] * 10 + [0.0] * 20, 60 * 512, 35 * 512 - 12000),  # centred on it
        ([0.9] * 4 + [0.0] * 56, 60 * 512, 0),  # at the start: the window cannot go before
        ([0.0] * 56 + [0.9] * 4, 60 * 512, 60 * 512 - 24000),  # at the end
        # Two words 0.2 s apart are one stretch, centred as a whole.
        ([0.0] * 20 + [0.9] * 6 + [0.1] * 6 + [0.9] * 6 + [0.0] * 22, 60 * 512, 29 * 512 - 12000),
        ([0.9] * 5, 24000, 0),  # no longer than a window
    ],
)
def test_the_window_is_centred_on_the_speech(prob: list[float], total: int, start: int | None):
    from wakefl.sdk.phrase_locator import window_start

    assert window_start(np.array(prob), total) == start


def test_short_clips_are_padded_with_the_files_background(tmp_path: Path) -> None:
    phrase = _trimmed_phrase()[:16000]
    rng = np.random.default_rng(0)
    noisy = phrase + 0.01 * rng.standard_normal(phrase.size).astype(np.float32)
    src = tmp_path / "src"
    src.mkdir()
    sf.write(src / "noisy.wav", noisy, 16000, subtype="PCM_16")
    sf.write(
        src / "clean.wav",
        np.concatenate([np.zeros(800, np.float32), phrase]),
        16000,
        subtype="PCM_16",
    )
    _write_csv(
        src / "list.csv",
        ["path", "label", "device_type"],
        [("noisy.wav", 1, "A"), ("clean.wav", 1, "A")],
    )
    res = import_recordings(src, src / "list.csv", tmp_path / "out", progress=False)
    clips = {
        r.path.split("_", 1)[1]: sf.read(str(r.resolve(res.manifest)))[0]
        for r in read_manifest(res.manifest)
    }
    pad = (24000 - noisy.size) // 2
    edge = clips["noisy.wav"][: pad - 10]
    assert np.count_nonzero(edge == 0.0) < 0.05 * edge.size  # not digital silence
    assert 0.5 < np.sqrt(np.mean(edge**2)) / 0.01 < 2.0  # at the file's own noise floor
    # A file whose quietest part is digital zeros gets a low-level floor, not zeros either.
    head = clips["clean.wav"][:3000]
    assert np.count_nonzero(head) > 0.5 * head.size and np.sqrt(np.mean(head**2)) < 1e-3
    assert "background" in _report_rows(tmp_path / "out")["clean.wav"]["detail"]


def test_names_are_normalized_and_only_ambiguity_is_refused(
    recordings: Path, tmp_path: Path
) -> None:
    from wakefl.tools.evaluation.cells import bootstrap_units

    rows = [
        ("pos_22k.wav", "1", "phone", " Playback ", "Alice  Smith", "TEST"),
        ("pos_stereo.flac", "1", "phone", "ALARM", "alice smith", ""),
        ("neg.ogg", "0", "phone", "normal", "O'Brien", "Train"),
        ("neg_3s.wav", "0", "phone", "normal", "o brien", "train"),
        ("neg_long.wav", "0", "phone", "Normal", "background", "validation"),
        ("silent.wav", "0", "phone", "sleeping", "x", "train"),
    ]
    _write_csv(
        tmp_path / "list.csv", ["path", "label", "device_type", "state", "speaker", "split"], rows
    )
    (tmp_path / "sub").mkdir()
    sf.write(
        tmp_path / "sub" / "bg.wav",
        np.random.default_rng(1).standard_normal(8000).astype(np.float32) * 0.05,
        16000,
    )
    res = import_recordings(
        recordings, tmp_path / "list.csv", tmp_path / "out", max_bad_share=0.6, progress=False
    )
    got = {r.path.split("_", 1)[1].rsplit(".", 1)[0]: r for r in read_manifest(res.manifest)}
    assert (got["pos_22k"].state, got["pos_22k"].split, got["pos_22k"].speaker) == (
        "playback",
        "test",
        "alice-smith",
    )
    # The same speaker without a split takes the split of its other rows.
    assert (got["pos_stereo"].speaker, got["pos_stereo"].split, got["pos_stereo"].state) == (
        "alice-smith",
        "test",
        "alarm",
    )
    assert got["neg_long"].speaker.startswith("nospeech-") and got["neg_long"].split == "val"
    bad = {e["path"]: e["detail"] for e in res.bad}
    assert "ambiguous" in bad["neg.ogg"] and "ambiguous" in bad["neg_3s.wav"]
    assert bad["silent.wav"].startswith("bad state 'sleeping'")
    # Background-only rows are each their own bootstrap unit.
    assert len(set(bootstrap_units(["nospeech-5", "nospeech-6", "alice"]).tolist())) == 3


def test_speaker_leakage_is_refused_unless_allowed(recordings: Path, tmp_path: Path) -> None:
    rows = [
        ("pos_22k.wav", "1", "phone", "", "bob", "train"),
        ("neg.ogg", "0", "phone", "", "Bob", "test"),
    ]
    _write_csv(
        tmp_path / "list.csv", ["path", "label", "device_type", "state", "speaker", "split"], rows
    )
    with pytest.raises(
        WakeflError,
        match=r"1 speaker\(s\) appear in more than one split.*bob: test \(line 3\), train \(line 2\).*--allow-speaker-leakage",
    ):
        import_recordings(recordings, tmp_path / "list.csv", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    res = import_recordings(
        recordings,
        tmp_path / "list.csv",
        tmp_path / "out",
        progress=False,
        allow_speaker_leakage=True,
    )
    assert {r.split for r in read_manifest(res.manifest)} == {"train", "test"}


def test_failed_import_leaves_only_its_report_and_force_replaces(
    recordings: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    with pytest.raises(WakeflError):
        import_recordings(
            recordings, recordings / "list.csv", out, max_bad_share=0.1, progress=False
        )
    assert sorted(p.name for p in out.iterdir()) == ["import_report.csv", "import_report.json"]
    assert json.loads((out / "import_report.json").read_text())["status"] == "failed"
    # The retry is not refused: a failed import's folder is replaced.
    res = import_recordings(
        recordings, recordings / "list.csv", out, max_bad_share=0.9, progress=False
    )
    assert res.n_ok == 5 and (out / "clips").is_dir()
    with pytest.raises(WakeflError, match="holds a previous import; pass --force"):
        import_recordings(
            recordings, recordings / "list.csv", out, max_bad_share=0.9, progress=False
        )
    (out / "stale.txt").write_text("left by an old run")
    import_recordings(
        recordings, recordings / "list.csv", out, max_bad_share=0.9, progress=False, force=True
    )
    assert not (out / "stale.txt").exists() and (out / "manifest.csv").is_file()
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("not an import")
    with pytest.raises(WakeflError, match="holds no previous import"):
        import_recordings(
            recordings,
            recordings / "list.csv",
            other,
            max_bad_share=0.9,
            progress=False,
            force=True,
        )
    assert (other / "notes.txt").is_file()
    assert not [
        p for p in tmp_path.iterdir() if p.name.startswith(".")
    ]  # no temporary folders left
