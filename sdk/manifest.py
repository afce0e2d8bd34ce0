"""The corpus manifest: one CSV (`manifest.csv` at the corpus root) that training, the
federation and evaluation read, whether the corpus was synthesized or imported.

Columns: path,label,device_type,state,speaker,split,duration_s,kind. `path` is relative to
the manifest's folder; `label` 1 = wake word, 0 = not; `kind` is `clip` (exactly one model
window, 1.5 s) or `stream` (a long negative recording for false accepts per hour).
"""

from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from wakefl.errors import ConfigError
from wakefl.sdk.atomic_files import write_atomic

SAMPLE_RATE = 16000
CLIP_SECONDS = 1.5
CLIP_SAMPLES = 24000
STATES = ("normal", "playback", "alarm")
SPLITS = ("train", "val", "test")
KINDS = ("clip", "stream")
COLUMNS = ("path", "label", "device_type", "state", "speaker", "split", "duration_s", "kind")

# Names end up in file paths and MQTT topics, so they are kept to a safe alphabet.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
# A clip's duration may differ from 1.5 s by less than one sample.
_CLIP_TOLERANCE_S = 0.5 / SAMPLE_RATE


@dataclass(frozen=True)
class ManifestRow:
    path: str
    label: int
    device_type: str
    state: str
    speaker: str
    split: str
    duration_s: float
    kind: str

    def resolve(self, manifest_path: str | Path) -> Path:
        """Absolute path of the audio file this row names."""
        return Path(manifest_path).resolve().parent / self.path


def validate_row(row: ManifestRow, where: str = "row") -> ManifestRow:
    """Check every field of one row; raise ConfigError naming the field and the value."""
    if not row.path:
        raise ConfigError(f"{where}: empty 'path'")
    p = PurePosixPath(row.path)
    if p.is_absolute() or ".." in p.parts or "\\" in row.path:
        raise ConfigError(
            f"{where}: 'path' must be relative to the manifest and stay inside its folder, got {row.path!r}"
        )
    if row.label not in (0, 1) or isinstance(row.label, bool):
        raise ConfigError(f"{where}: 'label' must be 0 or 1, got {row.label!r}")
    if not _NAME_RE.match(row.device_type or ""):
        raise ConfigError(
            f"{where}: 'device_type' must be a non-empty name of letters, digits, '_', '-', '.', got {row.device_type!r}"
        )
    if row.state not in STATES:
        raise ConfigError(f"{where}: 'state' must be one of {', '.join(STATES)}, got {row.state!r}")
    if not _NAME_RE.match(row.speaker or ""):
        raise ConfigError(
            f"{where}: 'speaker' must be a non-empty name of letters, digits, '_', '-', '.', got {row.speaker!r}"
        )
    if row.split not in SPLITS:
        raise ConfigError(f"{where}: 'split' must be one of {', '.join(SPLITS)}, got {row.split!r}")
    if row.kind not in KINDS:
        raise ConfigError(f"{where}: 'kind' must be one of {', '.join(KINDS)}, got {row.kind!r}")
    d = row.duration_s
    if not isinstance(d, (int, float)) or not math.isfinite(d) or d <= 0:
        raise ConfigError(f"{where}: 'duration_s' must be a positive finite number, got {d!r}")
    if row.kind == "clip" and abs(d - CLIP_SECONDS) > _CLIP_TOLERANCE_S:
        raise ConfigError(f"{where}: a clip must last {CLIP_SECONDS} s, got duration_s={d}")
    if row.kind == "stream" and row.label != 0:
        raise ConfigError(f"{where}: a stream is a negative recording, its label must be 0")
    return row


def _parse_int_label(text: str, where: str) -> int:
    if text.strip() not in ("0", "1"):
        raise ConfigError(f"{where}: 'label' must be 0 or 1, got {text!r}")
    return int(text)


def _parse_duration(text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{where}: 'duration_s' is not a number: {text!r}") from None


def read_manifest(path: str | Path) -> list[ManifestRow]:
    """Read and validate a manifest; every problem is a ConfigError with file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"manifest not found: {path}")
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            header = tuple(reader.fieldnames or ())
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                raise ConfigError(
                    f"{path}: missing column(s) {', '.join(missing)}; expected {','.join(COLUMNS)}"
                )
            rows: list[ManifestRow] = []
            seen: dict[str, int] = {}
            for lineno, rec in enumerate(reader, start=2):
                where = f"{path}:{lineno}"
                if None in rec or any(rec[c] is None for c in COLUMNS):
                    raise ConfigError(f"{where}: wrong number of fields")
                row = ManifestRow(
                    path=rec["path"].strip(),
                    label=_parse_int_label(rec["label"], where),
                    device_type=rec["device_type"].strip(),
                    state=rec["state"].strip(),
                    speaker=rec["speaker"].strip(),
                    split=rec["split"].strip(),
                    duration_s=_parse_duration(rec["duration_s"], where),
                    kind=rec["kind"].strip(),
                )
                validate_row(row, where)
                if row.path in seen:
                    raise ConfigError(
                        f"{where}: path {row.path!r} already listed on line {seen[row.path]}"
                    )
                seen[row.path] = lineno
                rows.append(row)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text manifest ({exc.reason})") from None
    except csv.Error as exc:
        raise ConfigError(f"{path}: malformed CSV ({exc})") from None
    if not rows:
        raise ConfigError(f"{path}: the manifest lists no files")
    return rows


def write_manifest(rows: list[ManifestRow], path: str | Path) -> Path:
    """Validate and write rows; the output is byte-stable (fixed column order, `\\n` endings)."""
    path = Path(path)
    for i, row in enumerate(rows):
        validate_row(row, f"row {i}")
    buf = io.StringIO(newline="")
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        d = asdict(row)
        d["duration_s"] = f"{row.duration_s:.4f}"
        writer.writerow([d[c] for c in COLUMNS])
    write_atomic(path, buf.getvalue().encode("utf-8"))
    return path


def device_types(rows: list[ManifestRow]) -> list[str]:
    """Sorted device types present in a manifest."""
    return sorted({r.device_type for r in rows})
