"""Import a user's own recordings into the corpus format.

Input: a CSV with columns path,label,device_type and optionally state,speaker,split; paths
are relative to the source folder (or absolute). Every file is decoded (WAV/FLAC/OGG via
soundfile, other formats via librosa), mixed to mono and resampled to 16 kHz.

Length rule (documented in tools/CORPUS.md):
- shorter than `min_clip_s` (0.25 s): rejected as too short;
- up to 1.5 s: a clip, zero-padded on both sides to 1.5 s;
- longer than 1.5 s and shorter than `stream_min_s` (10 s): a clip cropped to the loudest
  1.5 s (where the speech is);
- `stream_min_s` or longer: a negative becomes a stream (kept whole); a positive is rejected,
  since the phrase cannot be located in it reliably.

Every input row ends up either in the manifest or in the report with a reason; the import
fails with a WakeflError when the share of bad rows exceeds `max_bad_share`.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from wakefl.errors import ConfigError, WakeflError
from wakefl.sdk.manifest import (
    CLIP_SAMPLES,
    SAMPLE_RATE,
    SPLITS,
    STATES,
    ManifestRow,
    write_manifest,
)

REQUIRED = ("path", "label", "device_type")
OPTIONAL = ("state", "speaker", "split")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_LABELS = {"1": 1, "0": 0, "true": 1, "false": 0, "yes": 1, "no": 0, "positive": 1, "negative": 0}
# Split of speakers when the CSV gives none: a hash of the speaker name, so one speaker's
# files always land in the same split.
_SPLIT_SHARES = (("train", 0.7), ("val", 0.15), ("test", 0.15))


class BadFile(Exception):
    """One input row that cannot be imported; the message is the reason in the report."""


@dataclass(frozen=True)
class ImportResult:
    manifest: Path
    report: Path
    n_rows: int
    n_ok: int
    bad: list[dict[str, str]]


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


def loudest_window(wave: np.ndarray, n: int) -> np.ndarray:
    """The `n` consecutive samples with the most energy."""
    energy = np.concatenate([[0.0], np.cumsum(wave.astype(np.float64) ** 2)])
    windows = energy[n:] - energy[:-n]
    # Of the (near-)loudest windows, take the middle one so a short sound ends up centred.
    best = np.flatnonzero(windows >= windows.max() * 0.999)
    start = int(best[best.size // 2])
    return wave[start : start + n]


def fit_clip(wave: np.ndarray) -> tuple[np.ndarray, str]:
    if wave.size <= CLIP_SAMPLES:
        pad = CLIP_SAMPLES - wave.size
        return np.pad(wave, (pad // 2, pad - pad // 2)), "padded" if pad else "as is"
    return loudest_window(wave, CLIP_SAMPLES), "cropped to the loudest 1.5 s"


def _field(rec: dict[str, str | None], key: str) -> str:
    return (rec.get(key) or "").strip()


def _parse_row(rec: dict[str, str | None]) -> tuple[int, str, str, str, str | None]:
    label_text = _field(rec, "label").lower()
    if not label_text:
        raise BadFile("unlabeled: empty 'label'")
    if label_text not in _LABELS:
        raise BadFile(f"unlabeled: 'label' must be 0 or 1, got {label_text!r}")
    device = _field(rec, "device_type")
    if not _NAME_RE.match(device):
        raise BadFile(f"bad device_type {device!r}: use letters, digits, '_', '-', '.'")
    state = _field(rec, "state") or "normal"
    if state not in STATES:
        raise BadFile(f"bad state {state!r}: one of {', '.join(STATES)}")
    speaker = _field(rec, "speaker")
    if speaker and not _NAME_RE.match(speaker):
        raise BadFile(f"bad speaker {speaker!r}: use letters, digits, '_', '-', '.'")
    split = _field(rec, "split") or None
    if split is not None and split not in SPLITS:
        raise BadFile(f"bad split {split!r}: one of {', '.join(SPLITS)}")
    return _LABELS[label_text], device, state, speaker, split


def import_recordings(
    src: str | Path,
    csv_path: str | Path,
    out_dir: str | Path,
    max_bad_share: float = 0.1,
    min_clip_s: float = 0.25,
    stream_min_s: float = 10.0,
    progress: bool = True,
) -> ImportResult:
    """Import the listed recordings into `out_dir` (manifest.csv, clips/, streams/,
    import_report.json, import_report.csv). Raises WakeflError (after writing the report)
    when more than `max_bad_share` of the rows are bad."""
    from tqdm import tqdm

    if not 0.0 <= max_bad_share <= 1.0:
        raise ConfigError(f"--max-bad-share must be within [0, 1], got {max_bad_share}")
    src, csv_path, out = Path(src), Path(csv_path), Path(out_dir)
    if not src.is_dir():
        raise ConfigError(f"--src {src} is not a folder")
    if not csv_path.is_file():
        raise ConfigError(f"--manifest {csv_path} not found")
    try:
        with csv_path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in (reader.fieldnames or [])]
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
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty; choose a new folder")
    out.mkdir(parents=True, exist_ok=True)

    rows: list[ManifestRow] = []
    report: list[dict[str, str]] = []
    seen: dict[str, int] = {}
    for i, rec in enumerate(tqdm(records, desc="import", unit="file", disable=not progress)):
        line = i + 2
        raw_path = _field(rec, "path")
        entry = {"line": str(line), "path": raw_path, "status": "ok", "detail": ""}
        report.append(entry)
        try:
            if None in rec:
                raise BadFile("malformed row: more fields than the header")
            if not raw_path:
                raise BadFile("missing: empty 'path'")
            file = Path(raw_path) if Path(raw_path).is_absolute() else src / raw_path
            key = str(file.resolve())
            if key in seen:
                raise BadFile(f"duplicate: already listed on line {seen[key]}")
            seen[key] = line
            label, device, state, speaker, split = _parse_row(rec)
            wave = decode_audio(file)
            dur = wave.size / SAMPLE_RATE
            if dur < min_clip_s:
                raise BadFile(f"too short: {dur:.3f} s < {min_clip_s} s")
            speaker = speaker or _safe_name(f"file-{Path(raw_path).stem}-{line}")
            split = split or split_for_speaker(speaker)
            stem = _safe_name(Path(raw_path).stem)
            if dur >= stream_min_s:
                if label == 1:
                    raise BadFile(f"too long for a wake-word clip: {dur:.1f} s >= {stream_min_s} s")
                rel = f"streams/{device}/{line:06d}_{stem}.wav"
                action, kind, data = "stream", "stream", wave
            else:
                data, action = fit_clip(wave)
                rel = f"clips/{device}/{split}/{line:06d}_{stem}.wav"
                kind = "clip"
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            sf.write(str(out / rel), data, SAMPLE_RATE, subtype="PCM_16", format="WAV")
            rows.append(ManifestRow(rel, label, device, state, speaker, split, data.size / SAMPLE_RATE, kind))
            entry["detail"] = f"{action} ({dur:.2f} s) -> {rel}"
        except BadFile as exc:
            entry["status"] = "bad"
            entry["detail"] = str(exc)

    bad = [e for e in report if e["status"] == "bad"]
    share = len(bad) / len(report)
    report_json = out / "import_report.json"
    summary = {
        "source": str(src),
        "csv": str(csv_path),
        "rows": len(report),
        "imported": len(rows),
        "bad": len(bad),
        "bad_share": round(share, 4),
        "max_bad_share": max_bad_share,
        "bad_files": bad,
        "files": report,
    }
    report_json.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    with (out / "import_report.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["line", "path", "status", "detail"], lineterminator="\n")
        w.writeheader()
        w.writerows(report)
    if share > max_bad_share or not rows:
        reasons = "; ".join(f"{e['path'] or '(no path)'}: {e['detail']}" for e in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise WakeflError(
            f"{len(bad)} of {len(report)} files are bad ({share:.0%} > allowed {max_bad_share:.0%}); "
            f"see {report_json}. {reasons}{more}"
        )
    manifest = write_manifest(rows, out / "manifest.csv")
    return ImportResult(manifest, report_json, len(report), len(rows), bad)
