"""A device's own long recordings as negative examples: each negative stream of one device
type and split cut into model windows at a fixed hop, and a dataset that joins them to the
clips.

Why: a served-model gate that sees only clips sets its false-accept level on a few dozen
negative clips, while a device is judged by its false accepts per hour on running audio.
Windows of the device's validation streams put the audio it will hear (its users' near
misses and everyday speech in its rooms) among the gate's negatives, so a candidate that
fires on that audio is not admitted. Each window is scored as a clip is; the gate's
bootstrap unit of a window is the stretch of its stream it lies in (`UNIT_SECONDS`), as
windows of one stretch share their talk and background.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from wakefl.errors import ConfigError
from wakefl.sdk.dataset import load_audio
from wakefl.sdk.manifest import SAMPLE_RATE, ManifestRow, read_manifest

UNIT_SECONDS = 30.0
# The prefix of the bootstrap units of an add-on's streams (`wakefl device --val-streams`):
# it keeps them apart from the corpus's own streams of the same name, and it is the same
# wherever the add-on lies, so that a device's gate decides the same from the same audio.
# '+' sorts before the letters that begin the corpus's speakers and stream paths, so the
# add-on's units keep their place in the bootstrap's sorted units.
ADDON_UNIT_PREFIX = "+val-streams:"


def bootstrap_unit(stream: str, start_s: float) -> str:
    """The gate's bootstrap unit of a window starting `start_s` seconds into `stream`:
    "<stream>@<k>", the k-th `UNIT_SECONDS` stretch of it."""
    return f"{stream}@{int(start_s // UNIT_SECONDS)}"


class StreamWindows(Dataset):
    """(window float32 [window_samples], 0) for every `hop_s` of each negative stream of
    `device_type` and `split` (none when the manifest has no such stream). `rows` holds one
    row per window, its speaker the window's bootstrap unit "<unit_prefix><stream path>@<k>"
    (the k-th `UNIT_SECONDS` of the stream; the prefix keeps two manifests' streams of the
    same name apart); `labels` are all 0."""

    def __init__(
        self,
        manifest_path: str | Path,
        device_type: str,
        split: str,
        window_samples: int,
        hop_s: float,
        unit_prefix: str = "",
    ) -> None:
        if window_samples <= 0 or not hop_s > 0.0:
            raise ConfigError(
                f"stream windows need window_samples > 0 and hop_s > 0, got "
                f"{window_samples} and {hop_s}"
            )
        streams = [
            r
            for r in read_manifest(manifest_path)
            if r.kind == "stream"
            and r.label == 0
            and r.device_type == device_type
            and r.split == split
        ]
        hop = max(1, int(round(hop_s * SAMPLE_RATE)))
        self.window_samples = int(window_samples)
        self.waves = [load_audio(r.resolve(manifest_path)) for r in streams]
        self.index: list[tuple[int, int]] = []
        self.rows: list[ManifestRow] = []
        for k, (row, wave) in enumerate(zip(streams, self.waves, strict=True)):
            for start in range(0, max(wave.size - self.window_samples, 0) + 1, hop):
                self.index.append((k, start))
                self.rows.append(
                    replace(
                        row,
                        speaker=bootstrap_unit(f"{unit_prefix}{row.path}", start / SAMPLE_RATE),
                        duration_s=self.window_samples / SAMPLE_RATE,
                    )
                )
        self.labels = np.zeros(len(self.index), dtype=np.int64)
        self.streams = len(streams)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        k, start = self.index[i]
        window = np.zeros(self.window_samples, dtype=np.float32)
        piece = self.waves[k][start : start + self.window_samples]
        window[: piece.size] = piece
        return torch.from_numpy(window), 0


class JoinedDataset(Dataset):
    """`first`'s items, then `second`'s, with their `rows` and `labels` joined (both must
    have them, as WakeWordDataset and StreamWindows do)."""

    def __init__(self, first: Dataset, second: Dataset) -> None:
        self.parts = (first, second)
        self.rows: list[ManifestRow] = [*first.rows, *second.rows]  # type: ignore[attr-defined]
        self.labels = np.concatenate([first.labels, second.labels])  # type: ignore[attr-defined]
        self._split = len(first.rows)  # type: ignore[attr-defined]
        # The first part's window length, so that a joined dataset can be joined again.
        self.window_samples = getattr(first, "window_samples", None)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i < 0:
            i += len(self)
        if i < self._split:
            return self.parts[0][i]
        return self.parts[1][i - self._split]
