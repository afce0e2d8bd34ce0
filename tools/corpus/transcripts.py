"""Transcripts of negative streams: what is said when, written beside each stream WAV, so
that a benchmark can print what a false accept heard."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from wakefl.errors import ConfigError


@dataclass(frozen=True)
class StreamUtterance:
    """One utterance of a negative stream, for telling what a false accept heard."""

    start_s: float
    end_s: float
    speaker: str
    content: str  # "conf" (a confusable phrase) or "other" (other speech)
    text: str


def transcript_path(stream: Path) -> Path:
    """Where the transcript of stream WAV `stream` is written: beside it, as CSV (a name of
    its own, so that a recording's other files beside it are never taken for one)."""
    return stream.with_suffix(".transcript.csv")


def write_transcript(path: Path, transcript: list[StreamUtterance]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["start_s", "end_s", "speaker", "content", "text"])
        for u in transcript:
            w.writerow([f"{u.start_s:.3f}", f"{u.end_s:.3f}", u.speaker, u.content, u.text])


def read_transcript(stream: Path) -> list[StreamUtterance]:
    """The transcript written beside stream WAV `stream`; empty when there is none (a corpus
    built before transcripts, or recordings brought in with `wakefl corpus import`)."""
    path = transcript_path(stream)
    if not path.is_file():
        return []
    try:
        with path.open(newline="", encoding="utf-8") as f:
            return [
                StreamUtterance(
                    float(r["start_s"]), float(r["end_s"]), r["speaker"], r["content"], r["text"]
                )
                for r in csv.DictReader(f)
            ]
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"{path}: not a stream transcript ({exc})") from None
