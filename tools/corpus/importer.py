"""Import a user's own recordings into the corpus format.

Input: a CSV with columns path,label,device_type and optionally state,speaker,split and
onset_s,offset_s (where the wake phrase lies in the file, in seconds); paths are relative
to the source folder (or absolute). Every file is decoded (WAV/FLAC/OGG via soundfile,
other formats via librosa), mixed to mono and resampled to 16 kHz.

Length rule (documented in tools/CORPUS.md):
- shorter than `min_clip_s` (0.25 s): rejected as too short;
- up to 1.5 s: a clip, padded on both sides to 1.5 s with the file's own background
  (noise shaped like its quietest part, at its measured floor), never digital zeros;
- longer than 1.5 s: a clip cropped to 1.5 s around the phrase: the onset/offset columns
  when given, else the speech a voice-activity model finds (sdk/phrase_locator.py), which
  tells the phrase from louder music, alarms, beeps and knocks;
- `stream_min_s` or longer: a negative becomes a stream (kept whole); a positive needs
  onset/offset columns, as no rule locates a phrase in minutes of audio reliably.

Names: `state`, `split` and speaker names are normalized (case, surrounding and inner
whitespace); only what stays ambiguous is refused. A speaker in more than one split is
refused (it would leak between training and test) unless allowed. Splits the CSV leaves
open: see `_fill_splits`. Background-only rows (label 0 with no speaker, or a speaker such
as `background`) become `nospeech-<line>`: each is its own unit in the speaker bootstrap.

Every input row ends up either in the manifest or in the report with a reason; the import
fails with a WakeflError when the share of bad rows exceeds `max_bad_share`. The output is
built in a temporary folder beside `--out` and moved into place at the end, so a failed
import leaves only its report there, which a retry replaces.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import soundfile as sf

from wakefl.errors import ConfigError, WakeflError
from wakefl.progress_bars import bar_disabled
from wakefl.sdk.manifest import (
    CLIP_SAMPLES,
    SAMPLE_RATE,
    SPLITS,
    STATES,
    ManifestRow,
    write_manifest,
)
from wakefl.sdk.phrase_locator import frames as frame_view
from wakefl.sdk.phrase_locator import locate_phrase

REQUIRED = ("path", "label", "device_type")
OPTIONAL = ("state", "speaker", "split", "onset_s", "offset_s")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_LABELS = {"1": 1, "0": 0, "true": 1, "false": 0, "yes": 1, "no": 0, "positive": 1, "negative": 0}
_SPLIT_WORDS = {"training": "train", "validation": "val", "valid": "val", "testing": "test"}
# Speaker values that say "nobody speaks here" (compared after normalization).
_NO_SPEAKER = {"", "none", "background", "nospeech", "no-speech", "noise", "-", "n-a", "na"}
NO_SPEECH_PREFIX = "nospeech-"
# Split of speakers when the CSV gives none (`_fill_splits`).
_SPLIT_SHARES = (("train", 0.7), ("val", 0.15), ("test", 0.15))
# Quietest share of a file's frames taken as its background, and the floor used when even
# that is digital silence (about the self-noise of a good 16-bit microphone chain).
_FLOOR_SHARE = 0.1
_MIN_FLOOR_RMS = 10 ** (-72 / 20)
_REPORT = "import_report.json"


class BadFile(Exception):
    """One input row that cannot be imported; the message is the reason in the report."""


@dataclass(frozen=True)
class ImportResult:
    manifest: Path
    report: Path
    n_rows: int
    n_ok: int
    bad: list[dict[str, str]]
    # Rows the CSV gave no split and whose split was drawn by the speaker hash (70/15/15).
    drawn_splits: int = 0


@dataclass
class _Row:
    """One CSV row after parsing and name normalization (or the reason it is bad)."""

    line: int
    raw_path: str
    label: int = 0
    device: str = ""
    state: str = "normal"
    speaker: str = ""
    split: str | None = None
    onset: float | None = None
    offset: float | None = None
    error: str = ""
    entry: dict[str, str] = field(default_factory=dict)


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", text).strip("._-") or "x"


def split_for_speaker(speaker: str) -> str:
    h = int(hashlib.sha256(speaker.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    acc = 0.0
    for name, share in _SPLIT_SHARES:
        acc += share
        if h <= acc:
            return name
    return _SPLIT_SHARES[-1][0]


def decode_audio(path: Path) -> np.ndarray:
    """float32 mono 16 kHz samples of any file soundfile or librosa can read; BadFile otherwise."""
    if not path.exists():
        raise BadFile("missing: no such file")
    if not path.is_file():
        raise BadFile("unreadable: not a regular file")
    if not os.access(path, os.R_OK):
        raise BadFile("unreadable: permission denied")
    if path.stat().st_size == 0:
        raise BadFile("empty: the file has 0 bytes")
    try:
        wave, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError) as sf_exc:
        try:
            import librosa

            with warnings.catch_warnings():
                # librosa announces its audioread fallback; the outcome is reported instead.
                warnings.simplefilter("ignore")
                wave, sr = librosa.load(str(path), sr=None, mono=False)
            wave = np.atleast_2d(wave).T.astype(np.float32)
        except Exception as exc:  # librosa re-raises decoder errors of many types
            raise BadFile(f"corrupt: cannot decode ({sf_exc}; {type(exc).__name__})") from None
    except OSError as exc:
        raise BadFile(f"unreadable: {exc.strerror or exc}") from None
    if wave.size == 0:
        raise BadFile("empty: no audio samples")
    wave = wave.mean(axis=1)
    if not np.all(np.isfinite(wave)):
        raise BadFile("corrupt: non-finite samples (NaN/Inf)")
    if not np.any(wave):
        raise BadFile("silent: every sample is zero")
    if sr != SAMPLE_RATE:
        import librosa

        wave = librosa.resample(wave, orig_sr=int(sr), target_sr=SAMPLE_RATE)
    return np.clip(wave, -1.0, 1.0).astype(np.float32)


def background_floor(wave: np.ndarray) -> tuple[float, np.ndarray]:
    """The file's background: the RMS of its quietest 10% of 20 ms frames and their mean
    magnitude spectrum (its colour). A file with digitally silent frames has no background
    to copy: a plain floor of `_MIN_FLOOR_RMS` then."""
    frame = 320
    if wave.size < 2 * frame:
        return max(float(np.sqrt(np.mean(wave.astype(np.float64) ** 2))), _MIN_FLOOR_RMS), np.ones(
            frame // 2 + 1
        )
    frames = frame_view(wave.astype(np.float64), frame, frame)
    rms = np.sqrt(np.mean(frames**2, axis=1))
    if rms.min() < _MIN_FLOOR_RMS:  # digital silence: no background to copy, use a plain floor
        return _MIN_FLOOR_RMS, np.ones(frame // 2 + 1)
    quiet = frames[rms <= np.quantile(rms, _FLOOR_SHARE)]
    floor = float(np.sqrt(np.mean(quiet**2)))
    return floor, np.abs(np.fft.rfft(quiet * np.hanning(frame), axis=1)).mean(axis=0)


def background_noise(wave: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` samples of noise with the spectrum and level of `wave`'s background."""
    floor, colour = background_floor(wave)
    spec = np.fft.rfft(rng.standard_normal(n))
    shape = np.interp(np.linspace(0.0, 1.0, spec.size), np.linspace(0.0, 1.0, colour.size), colour)
    noise = np.fft.irfft(spec * shape, n)
    return (noise * floor / (np.sqrt(np.mean(noise**2)) + 1e-20)).astype(np.float32)


def fit_clip(
    wave: np.ndarray,
    rng: np.random.Generator,
    onset: float | None = None,
    offset: float | None = None,
) -> tuple[np.ndarray, str, tuple[float, float]]:
    """The 1.5 s clip of `wave`, how it was made, and the crop (start, end) in seconds of
    the source (a negative start: background padding before the file)."""
    if wave.size <= CLIP_SAMPLES:
        pad = CLIP_SAMPLES - wave.size
        before = pad // 2
        if not pad:
            return wave, "as is", (0.0, wave.size / SAMPLE_RATE)
        noise = background_noise(wave, pad, rng)
        data = np.concatenate([noise[:before], wave, noise[before:]])
        return (
            data,
            "padded with the file's background",
            (-before / SAMPLE_RATE, (wave.size + pad - before) / SAMPLE_RATE),
        )
    if onset is not None and offset is not None:
        centre = int(round((onset + offset) / 2 * SAMPLE_RATE))
        start, rule = centre - CLIP_SAMPLES // 2, "cropped around the onset/offset columns"
    else:
        found = locate_phrase(wave)
        start, rule = found.start, f"cropped around the speech found by the {found.rule}"
    start = int(min(max(start, 0), wave.size - CLIP_SAMPLES))
    return (
        wave[start : start + CLIP_SAMPLES],
        rule,
        (start / SAMPLE_RATE, (start + CLIP_SAMPLES) / SAMPLE_RATE),
    )


def _field(rec: dict[str, str | None], key: str) -> str:
    return " ".join((rec.get(key) or "").split())  # surrounding and repeated whitespace


def normalize_speaker(text: str) -> str:
    """A speaker name in the manifest's alphabet: case folded, whitespace runs and other
    characters outside letters, digits, '_', '-', '.' turned into '-'."""
    name = re.sub(r"[^a-z0-9_.\-]+", "-", " ".join(text.split()).casefold())
    return name.strip("_.-")


def _choice(
    text: str, options: tuple[str, ...], what: str, synonyms: dict[str, str] | None = None
) -> str:
    value = text.casefold()
    value = (synonyms or {}).get(value, value)
    if value not in options:
        raise BadFile(f"bad {what} {text!r}: one of {', '.join(options)} (any case)")
    return value


def _seconds(rec: dict[str, str | None], key: str) -> float | None:
    text = _field(rec, key)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise BadFile(f"bad {key} {text!r}: a number of seconds") from None
    if not np.isfinite(value) or value < 0:
        raise BadFile(f"bad {key} {text!r}: a number of seconds >= 0")
    return value


def _parse_row(rec: dict[str, str | None], row: _Row) -> None:
    label_text = _field(rec, "label").casefold()
    if not label_text:
        raise BadFile("unlabeled: empty 'label'")
    if label_text not in _LABELS:
        raise BadFile(f"unlabeled: 'label' must be 0 or 1, got {label_text!r}")
    row.label = _LABELS[label_text]
    row.device = _field(rec, "device_type")
    if not _NAME_RE.match(row.device):
        raise BadFile(f"bad device_type {row.device!r}: use letters, digits, '_', '-', '.'")
    row.state = _choice(_field(rec, "state") or "normal", STATES, "state")
    split = _field(rec, "split")
    row.split = _choice(split, SPLITS, "split", _SPLIT_WORDS) if split else None
    speaker = _field(rec, "speaker")
    row.speaker = normalize_speaker(speaker)
    if speaker and not row.speaker:
        raise BadFile(f"bad speaker {speaker!r}: no letter or digit to name it by")
    if row.label == 0 and row.speaker in _NO_SPEAKER:
        row.speaker = f"{NO_SPEECH_PREFIX}{row.line}"  # background only: its own bootstrap unit
    elif not row.speaker:
        row.speaker = _safe_name(f"file-{Path(row.raw_path).stem}-{row.line}").casefold()
    row.onset, row.offset = _seconds(rec, "onset_s"), _seconds(rec, "offset_s")
    if (row.onset is None) != (row.offset is None):
        raise BadFile("give both onset_s and offset_s, or neither")
    if row.onset is not None and row.offset is not None:
        if row.offset <= row.onset:
            raise BadFile(f"offset_s {row.offset} is not after onset_s {row.onset}")
        if row.offset - row.onset > CLIP_SAMPLES / SAMPLE_RATE:
            raise BadFile(
                f"the phrase ({row.offset - row.onset:.2f} s) is longer than the 1.5 s window"
            )


def _ambiguous_speakers(rows: list[_Row], raw: dict[int, str]) -> None:
    """Mark rows whose speaker name only matches another spelling after normalization
    beyond case and whitespace ("o'brien" and "o.brien" stay apart; "O'Brien" and "o'brien"
    are one speaker)."""
    spellings: dict[str, set[str]] = {}
    for r in rows:
        if not r.error and r.line in raw:
            spellings.setdefault(r.speaker, set()).add(" ".join(raw[r.line].split()).casefold())
    for r in rows:
        forms = spellings.get(r.speaker, set())
        if not r.error and len(forms) > 1:
            r.error = (
                f"bad speaker {raw[r.line]!r}: ambiguous, the spellings "
                f"{', '.join(repr(f) for f in sorted(forms))} all become {r.speaker!r}"
            )


def speaker_leaks(rows: list[_Row]) -> dict[str, dict[str, list[int]]]:
    """Speakers listed in more than one split: speaker -> split -> CSV lines."""
    where: dict[str, dict[str, list[int]]] = {}
    for r in rows:
        if not r.error and r.split is not None:
            where.setdefault(r.speaker, {}).setdefault(r.split, []).append(r.line)
    return {s: splits for s, splits in where.items() if len(splits) > 1}


def _check_leakage(rows: list[_Row], csv_path: Path) -> None:
    leaks = speaker_leaks(rows)
    if not leaks:
        return
    lines = [
        f"{s}: "
        + ", ".join(
            f"{sp} (line {ls[0]}{'…' if len(ls) > 1 else ''})" for sp, ls in sorted(by.items())
        )
        for s, by in sorted(leaks.items())[:5]
    ]
    more = f" and {len(leaks) - 5} more" if len(leaks) > 5 else ""
    raise ConfigError(
        f"{csv_path}: {len(leaks)} speaker(s) appear in more than one split, so the test split would "
        f"hear voices the model was trained on: {'; '.join(lines)}{more}. Give each speaker one "
        "split, or pass --allow-speaker-leakage to import as listed"
    )


def _fill_splits(rows: list[_Row], default_split: str | None) -> int:
    """A row without a split takes its speaker's split from the speaker's other rows, or
    else `default_split` (`--split test` for recordings meant for evaluation, which scores
    one split), or else one drawn by a hash of the speaker name, 70/15/15 as training
    wants, so one speaker's files share a split. Returns how many rows were drawn so."""
    given: dict[str, set[str]] = {}
    for r in rows:
        if not r.error and r.split is not None:
            given.setdefault(r.speaker, set()).add(r.split)
    open_rows = [r for r in rows if not r.error and r.split is None]
    drawn = 0
    for r in open_rows:
        known = given.get(r.speaker, set())
        drawn += len(known) != 1 and default_split is None
        r.split = next(iter(known)) if len(known) == 1 else default_split
        r.split = r.split or split_for_speaker(r.speaker)
    return drawn


def _read_csv(csv_path: Path) -> list[dict[str, str | None]]:
    try:
        with csv_path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            header = [h.strip().casefold() for h in (reader.fieldnames or [])]
            reader.fieldnames = header
            records = list(reader)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{csv_path}: not a readable CSV ({exc})") from None
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise ConfigError(
            f"{csv_path}: missing column(s) {', '.join(missing)}; required: {','.join(REQUIRED)}, "
            f"optional: {','.join(OPTIONAL)}"
        )
    if not records:
        raise ConfigError(f"{csv_path}: lists no files")
    return records


def _parse_rows(records: list[dict[str, str | None]], src: Path) -> list[_Row]:
    """Phase 1: every row parsed and named, duplicates and ambiguous speakers marked (the
    splits the CSV leaves open are filled after)."""
    rows: list[_Row] = []
    seen: dict[str, int] = {}
    raw_speakers: dict[int, str] = {}
    for i, rec in enumerate(records):
        row = _Row(line=i + 2, raw_path=_field(rec, "path"))
        row.entry = {
            "line": str(row.line),
            "path": row.raw_path,
            "status": "ok",
            "detail": "",
            "crop": "",
        }
        rows.append(row)
        try:
            if None in rec:
                raise BadFile("malformed row: more fields than the header")
            if not row.raw_path:
                raise BadFile("missing: empty 'path'")
            key = str(_source(src, row.raw_path).resolve())
            if key in seen:
                raise BadFile(f"duplicate: already listed on line {seen[key]}")
            seen[key] = row.line
            _parse_row(rec, row)
            if _field(rec, "speaker") and not row.speaker.startswith(NO_SPEECH_PREFIX):
                raw_speakers[row.line] = _field(rec, "speaker")
        except BadFile as exc:
            row.error = str(exc)
    _ambiguous_speakers(rows, raw_speakers)
    return rows


def _source(src: Path, raw_path: str) -> Path:
    return Path(raw_path) if Path(raw_path).is_absolute() else src / raw_path


def _import_row(
    row: _Row, src: Path, work: Path, min_clip_s: float, stream_min_s: float
) -> ManifestRow:
    """Phase 2: decode one row's file and write its clip or stream into `work`."""
    wave = decode_audio(_source(src, row.raw_path))
    dur = wave.size / SAMPLE_RATE
    if dur < min_clip_s:
        raise BadFile(f"too short: {dur:.3f} s < {min_clip_s} s")
    if row.offset is not None and row.offset > dur + 0.05:
        raise BadFile(f"offset_s {row.offset} lies beyond the end of the file ({dur:.2f} s)")
    stem = _safe_name(Path(row.raw_path).stem)
    if dur >= stream_min_s and not (row.label == 1 and row.onset is not None):
        if row.label == 1:
            raise BadFile(
                f"too long for a wake-word clip without onset_s/offset_s: {dur:.1f} s >= {stream_min_s} s"
            )
        rel, data = f"streams/{row.device}/{row.line:06d}_{stem}.wav", wave
        row.entry["detail"] = f"stream ({dur:.2f} s) -> {rel}"
        kind = "stream"
    else:
        rng = np.random.default_rng(
            [row.line, int(hashlib.sha256(row.raw_path.encode()).hexdigest()[:8], 16)]
        )
        data, action, (a, b) = fit_clip(wave, rng, row.onset, row.offset)
        rel = f"clips/{row.device}/{row.split}/{row.line:06d}_{stem}.wav"
        row.entry["detail"] = f"{action} ({dur:.2f} s) -> {rel}"
        row.entry["crop"] = f"{a:.3f}-{b:.3f} s"
        kind = "clip"
    (work / rel).parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(work / rel), data, SAMPLE_RATE, subtype="PCM_16", format="WAV")
    return ManifestRow(
        rel,
        row.label,
        row.device,
        row.state,
        row.speaker,
        row.split or "train",
        data.size / SAMPLE_RATE,
        kind,
    )


def _write_report(
    work: Path,
    rows: list[_Row],
    src: Path,
    csv_path: Path,
    n_ok: int,
    max_bad_share: float,
    failed: bool,
) -> list[dict[str, str]]:
    report = [r.entry for r in rows]
    bad = [e for e in report if e["status"] == "bad"]
    summary = {
        "status": "failed" if failed else "ok",
        "source": str(src),
        "csv": str(csv_path),
        "rows": len(report),
        "imported": n_ok,
        "bad": len(bad),
        "bad_share": round(len(bad) / len(report), 4),
        "max_bad_share": max_bad_share,
        "bad_files": bad,
        "files": report,
    }
    (work / _REPORT).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    with (work / "import_report.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(
            f, fieldnames=["line", "path", "status", "detail", "crop"], lineterminator="\n"
        )
        w.writeheader()
        w.writerows(report)
    return bad


def _check_out(out: Path, force: bool) -> None:
    """Refuse an --out that holds anything but a previous import's output (which --force, or
    a failed import's report alone, lets this import replace)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder")
    content = list(out.iterdir())
    if not content:
        return
    report = out / _REPORT
    previous = report.is_file()
    failed = previous and not (out / "manifest.csv").exists()
    if failed or (previous and force):
        return
    if previous:
        raise ConfigError(f"--out {out} holds a previous import; pass --force to replace it")
    raise ConfigError(
        f"--out {out} is not empty and holds no previous import; choose a new folder "
        "(--force only replaces an import's output)"
    )


def _move_into_place(work: Path, out: Path) -> None:
    """Replace `out` by the finished `work` folder (same parent, so renames are atomic)."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    work.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def import_recordings(
    src: str | Path,
    csv_path: str | Path,
    out_dir: str | Path,
    max_bad_share: float = 0.1,
    min_clip_s: float = 0.25,
    stream_min_s: float = 10.0,
    progress: bool = True,
    force: bool = False,
    allow_speaker_leakage: bool = False,
    default_split: str | None = None,
) -> ImportResult:
    """Import the listed recordings into `out_dir` (manifest.csv, clips/, streams/,
    import_report.json, import_report.csv). Raises WakeflError (after writing the report
    into `out_dir`, and nothing else) when more than `max_bad_share` of the rows are bad.
    `force` replaces a previous import's output; a failed import's is always replaced.
    `default_split` is the split of the files the CSV gives none (and whose speaker has
    none elsewhere): `test` keeps every such file in what an evaluation scores; None draws
    one per speaker, 70/15/15, as training wants."""
    from tqdm import tqdm

    if not 0.0 <= max_bad_share <= 1.0:
        raise ConfigError(f"--max-bad-share must be within [0, 1], got {max_bad_share}")
    src, csv_path, out = Path(src), Path(csv_path), Path(out_dir)
    if not src.is_dir():
        raise ConfigError(f"--src {src} is not a folder")
    if not csv_path.is_file():
        raise ConfigError(f"--manifest {csv_path} not found")
    if default_split is not None and default_split not in SPLITS:
        raise ConfigError(f"--split must be one of {', '.join(SPLITS)}, got {default_split!r}")
    rows = _parse_rows(_read_csv(csv_path), src)
    drawn = _fill_splits(rows, default_split)
    if not allow_speaker_leakage:
        _check_leakage(rows, csv_path)
    _check_out(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))
    try:
        manifest_rows = []
        for row in tqdm(rows, desc="import", unit="file", disable=bar_disabled(progress)):
            try:
                if row.error:
                    raise BadFile(row.error)
                manifest_rows.append(_import_row(row, src, work, min_clip_s, stream_min_s))
            except BadFile as exc:
                row.entry.update(status="bad", detail=str(exc))
        res = _finish(work, out, rows, manifest_rows, src, csv_path, max_bad_share)
        return replace(res, drawn_splits=drawn)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _finish(
    work: Path,
    out: Path,
    rows: list[_Row],
    manifest_rows: list[ManifestRow],
    src: Path,
    csv_path: Path,
    max_bad_share: float,
) -> ImportResult:
    """Phase 3: the report, then the manifest and the move into place, or the failure with
    only the report left in `out`."""
    n_bad = sum(1 for r in rows if r.entry["status"] == "bad")
    share = n_bad / len(rows)
    failed = share > max_bad_share or not manifest_rows
    bad = _write_report(work, rows, src, csv_path, len(manifest_rows), max_bad_share, failed)
    if failed:
        report_only = Path(tempfile.mkdtemp(prefix=f".{out.name}.failed-", dir=out.parent))
        for name in (_REPORT, "import_report.csv"):
            shutil.copy(work / name, report_only / name)
        _move_into_place(report_only, out)
        reasons = "; ".join(f"{e['path'] or '(no path)'}: {e['detail']}" for e in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise WakeflError(
            f"{len(bad)} of {len(rows)} files are bad ({share:.0%} > allowed {max_bad_share:.0%}); "
            f"see {out / _REPORT}. {reasons}{more}"
        )
    write_manifest(manifest_rows, work / "manifest.csv")
    _move_into_place(work, out)
    return ImportResult(out / "manifest.csv", out / _REPORT, len(rows), len(manifest_rows), bad)
