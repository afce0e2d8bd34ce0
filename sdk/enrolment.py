"""Enrolment: the user says the wake phrase a few times at set-up, and the device keeps the
takes as its own positives.

`Enrolment.add` checks each take (sdk/take_check.py: clipping, speech, length, and whether
it sounds like the user's other takes), refuses a bad one with the reason, and stores an
accepted one in the device's state folder (`<state>/enrolment/`) as the 16-bit WAV of the
phrase's window, with an index that says which takes train and which validate: accepted
takes alternate, training first (three takes: two train, one validates), so that the
served-model gate judges personalization on a take it did not train on. `enrolled_data`
joins them to the device's training and validation data; `DeviceClient.enrol` does both.

The takes stay in the state folder: only model parameters and scalars ever leave the
device (docs/PROTOCOL.md), and nothing here publishes anything.
"""

from __future__ import annotations

import io
import json
import wave
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from wakefl.errors import AudioError, ConfigError
from wakefl.sdk.atomic_files import write_atomic
from wakefl.sdk.local_training import dataset_size
from wakefl.sdk.manifest import CLIP_SAMPLES, SAMPLE_RATE, ManifestRow
from wakefl.sdk.take_check import (
    PHRASE_DISTANCE_BOUND,
    check_take,
    odd_takes,
    phrase_features,
)

ENROLMENT_DIR = "enrolment"
INDEX = "takes.json"
SPEAKER = "enrolment"  # every take is the one user's: one bootstrap unit for the gate
Take = str | Path | np.ndarray


@dataclass(frozen=True)
class TakeResult:
    """What became of one take: accepted (and whether it trains or validates) or refused,
    and why."""

    name: str
    accepted: bool
    reason: str = ""
    split: str = ""  # "train" or "val" when accepted


class Enrolment:
    """The enrolment takes kept in `folder` (created on the first accepted take)."""

    def __init__(self, folder: str | Path, window_samples: int = CLIP_SAMPLES) -> None:
        self.folder = Path(folder)
        self.window = int(window_samples)
        index = self.folder / INDEX
        self.takes: list[dict[str, Any]] = (
            json.loads(index.read_text())["takes"] if index.is_file() else []
        )

    def add(self, takes: Sequence[Take]) -> list[TakeResult]:
        """Check `takes` (WAV paths, or float waves at 16 kHz) and keep those that pass."""
        waves = [(_name(t, i), _wave(t)) for i, t in enumerate(takes)]
        checks = [check_take(w, self.window) for _, w in waves]
        passed = [i for i, c in enumerate(checks) if c.accepted]
        kept = [self._window(k) for k in range(len(self.takes))]
        features = [phrase_features(w[s:e]) for w, (s, e) in kept] + [
            phrase_features(waves[i][1][slice(*checks[i].speech)]) for i in passed
        ]
        nearest = odd_takes(features)[len(kept) :]
        single = len(features) == 1
        out: list[TakeResult] = []
        for i, (name, w) in enumerate(waves):
            c = checks[i]
            if not c.accepted:
                out.append(TakeResult(name, False, c.reason))
                continue
            d = nearest[passed.index(i)]
            if not single and d > PHRASE_DISTANCE_BOUND:
                out.append(TakeResult(name, False, _unlike(d)))
                continue
            split = "val" if len(self.takes) % 2 else "train"
            self._store(w, c.start, c.speech, split, name)
            out.append(
                TakeResult(name, True, "not compared: a single take" if single else "", split)
            )
        return out

    def count(self, split: str) -> int:
        return sum(1 for t in self.takes if t["split"] == split)

    def dataset(self, split: str, device_type: str = "") -> TakesDataset:
        """The kept takes of `split` as (wave, 1) items."""
        chosen = [t for t in self.takes if t["split"] == split]
        waves = [self._window(self.takes.index(t))[0] for t in chosen]
        return TakesDataset(waves, [t["file"] for t in chosen], split, device_type)

    def _window(self, k: int) -> tuple[np.ndarray, tuple[int, int]]:
        """The stored window of take `k` and where its speech lies in it."""
        t = self.takes[k]
        return _read_wav(self.folder / t["file"], self.window), (t["speech"][0], t["speech"][1])

    def _store(
        self, w: np.ndarray, start: int, speech: tuple[int, int], split: str, name: str
    ) -> None:
        cut = np.zeros(self.window, dtype=np.float64)
        piece = w[start : start + self.window]
        cut[: piece.size] = piece
        file = f"take-{len(self.takes) + 1:03d}.wav"
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomic(self.folder / file, _wav_bytes(cut))
        lo, hi = max(0, speech[0] - start), min(self.window, speech[1] - start)
        self.takes.append({"file": file, "split": split, "speech": [lo, hi], "source": name})
        write_atomic(self.folder / INDEX, json.dumps({"takes": self.takes}, indent=1).encode())


class TakesDataset(Dataset):
    """Enrolment takes as (float32 wave [window], 1) items, with manifest-like rows (the
    speaker is the user, `SPEAKER`) and labels."""

    def __init__(self, waves: list[np.ndarray], files: list[str], split: str, device_type: str):
        self.waves = [torch.from_numpy(w.astype(np.float32)) for w in waves]
        self.labels = np.ones(len(waves), dtype=np.int64)
        self.rows = [
            ManifestRow(
                f"{ENROLMENT_DIR}/{f}",
                1,
                device_type,
                "enrolment",
                SPEAKER,
                split,
                w.size / SAMPLE_RATE,
                "clip",
            )  # fmt: skip
            for f, w in zip(files, waves, strict=True)
        ]

    def __len__(self) -> int:
        return len(self.waves)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.waves[i], 1


class WithTakes(Dataset):
    """`base`'s items, then the takes'; `labels` joined, and `rows` when `base` has them
    (the gate's bootstrap units)."""

    def __init__(self, base: Dataset, takes: TakesDataset) -> None:
        self.base, self.takes = base, takes
        self._split = dataset_size(base)
        labels = getattr(base, "labels", None)
        if labels is None:
            labels = [int(base[i][1]) for i in range(self._split)]
        self.labels = np.concatenate([np.asarray(labels, dtype=np.int64), takes.labels])
        rows = getattr(base, "rows", None)
        if rows is not None:
            self.rows = [*rows, *takes.rows]
        self.window_samples = getattr(base, "window_samples", None)

    def __len__(self) -> int:
        return self._split + len(self.takes)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i < 0:
            i += len(self)
        if i < self._split:
            return self.base[i]
        return self.takes[i - self._split]


def enrolled_data(
    train: Any, validation: Dataset | None, enrolment: Enrolment, device_type: str = ""
) -> tuple[Any, Dataset | None]:
    """`train` and `validation` with the kept takes of each split joined (as given when
    there are none). Takes need a dataset to join: a custom `LocalProblem` takes none."""
    from wakefl.sdk.round_training import looks_like_problem

    if not enrolment.takes:
        return train, validation
    if looks_like_problem(train) and enrolment.count("train"):
        raise ConfigError("enrolment takes need training data given as a dataset")
    if enrolment.count("train"):
        train = WithTakes(train, enrolment.dataset("train", device_type))
    if enrolment.count("val"):
        val_takes = enrolment.dataset("val", device_type)
        validation = val_takes if validation is None else WithTakes(validation, val_takes)
    return train, validation


def _name(t: Take, i: int) -> str:
    return str(t) if isinstance(t, str | Path) else f"take {i + 1}"


def _wave(t: Take) -> np.ndarray:
    if isinstance(t, str | Path):
        from wakefl.edge_runtime.audio_input import load_audio

        return np.asarray(load_audio(t, SAMPLE_RATE), dtype=np.float64).reshape(-1)
    w = np.asarray(t, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(w)):
        raise AudioError("an enrolment take holds non-finite samples")
    return w


def _unlike(d: float) -> str:
    return (
        f"does not sound like the other takes (distance {d:.1f} to the nearest, above "
        f"{PHRASE_DISTANCE_BOUND:.1f}): a different phrase?"
    )


def _wav_bytes(w: np.ndarray) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(SAMPLE_RATE)
        f.writeframes((np.clip(w, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes())
    return buf.getvalue()


def _read_wav(path: Path, window: int) -> np.ndarray:
    with wave.open(str(path), "rb") as f:
        raw = f.readframes(f.getnframes())
    w = np.frombuffer(raw, dtype="<i2").astype(np.float64) / 32767.0
    return np.pad(w, (0, max(0, window - w.size)))[:window]


__all__ = [
    "ENROLMENT_DIR",
    "Enrolment",
    "TakeResult",
    "TakesDataset",
    "WithTakes",
    "enrolled_data",
]
