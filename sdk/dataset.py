"""A torch Dataset over the clips of one device type and split of a corpus manifest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from torch.utils.data import Dataset

from wakefl.errors import AudioError, ConfigError
from wakefl.sdk.manifest import SAMPLE_RATE, SPLITS, ManifestRow, read_manifest
from wakefl.sdk.manifest import device_types as _device_types

# Light augmentation: small enough that a positive stays a positive (the phrase is never
# shifted out of the window by more than 0.1 s) and the device's own colouring survives.
_MAX_GAIN_DB = 6.0
_MAX_SHIFT_S = 0.1
_NOISE_SNR_DB = (20.0, 40.0)


def list_device_types(manifest_path: str | Path) -> list[str]:
    """Sorted device types present in the manifest."""
    return _device_types(read_manifest(manifest_path))


def _check_wav_complete(path: Path) -> None:
    """A WAV whose data chunk declares more bytes than the file holds was cut short (a
    failed copy, a full disk): libsndfile reads what is there, and a 100-byte stub would
    become a near-silent training clip, so it is refused instead."""
    import struct

    try:
        with open(path, "rb") as f:
            head = f.read(12)
            if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
                return  # not a WAV: libsndfile judges it
            size = path.stat().st_size
            pos = 12
            while pos + 8 <= size:
                f.seek(pos)
                cid, n = struct.unpack("<4sI", f.read(8))
                if cid == b"data":
                    if pos + 8 + n > size:
                        raise AudioError(
                            f"{path}: truncated WAV (its data chunk declares {n} bytes, "
                            f"the file holds {size - pos - 8})"
                        )
                    return
                pos += 8 + n + (n & 1)
    except OSError as exc:
        raise AudioError(f"cannot read {path}: {exc}") from None
    raise AudioError(f"{path}: truncated WAV (no complete data chunk)")


def load_clip(path: Path, window_samples: int) -> np.ndarray:
    """Decode one clip as float32 mono at 16 kHz, padded or cropped to `window_samples`."""
    wave = load_audio(path)
    if wave.size >= window_samples:
        start = (wave.size - window_samples) // 2
        return np.ascontiguousarray(wave[start : start + window_samples])
    pad = window_samples - wave.size
    return np.pad(wave, (pad // 2, pad - pad // 2))


def load_audio(path: Path) -> np.ndarray:
    """Decode a whole recording as float32 mono at 16 kHz (AudioError when it cannot)."""
    _check_wav_complete(Path(path))
    try:
        wave, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, OSError) as exc:
        raise AudioError(f"cannot decode {path}: {exc}") from None
    if sr != SAMPLE_RATE:
        raise AudioError(f"{path}: sample rate {sr} Hz, the corpus must be {SAMPLE_RATE} Hz")
    wave = wave.mean(axis=1)
    if wave.size == 0:
        raise AudioError(f"{path}: empty audio")
    if not np.all(np.isfinite(wave)):
        raise AudioError(f"{path}: non-finite samples")
    return np.ascontiguousarray(wave, dtype=np.float32)


def augment_wave(wave: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random gain, a small time shift (zero-filled) and white noise at 20-40 dB SNR."""
    out = wave * np.float32(10.0 ** (rng.uniform(-_MAX_GAIN_DB, _MAX_GAIN_DB) / 20.0))
    shift = int(rng.integers(-int(_MAX_SHIFT_S * SAMPLE_RATE), int(_MAX_SHIFT_S * SAMPLE_RATE) + 1))
    if shift > 0:
        out = np.concatenate([np.zeros(shift, np.float32), out[:-shift]])
    elif shift < 0:
        out = np.concatenate([out[-shift:], np.zeros(-shift, np.float32)])
    power = float(np.mean(out.astype(np.float64) ** 2))
    if power > 0:
        snr = rng.uniform(*_NOISE_SNR_DB)
        sigma = np.sqrt(power / 10.0 ** (snr / 10.0))
        out = out + rng.standard_normal(out.size).astype(np.float32) * np.float32(sigma)
    return np.clip(out, -1.0, 1.0).astype(np.float32)


class WakeWordDataset(Dataset):
    """(wave float32 [window_samples], label int) for the clips of one device type and split.

    Augmentation is drawn from a generator seeded by (seed, epoch, index), so an item's
    augmentation does not depend on the order of access or on DataLoader workers; call
    `set_epoch` to get fresh draws per epoch.
    """

    def __init__(
        self,
        manifest_path: str | Path,
        device_type: str,
        split: str,
        window_samples: int = 24000,
        augment: bool = False,
        seed: int = 0,
        preload: bool = True,
    ) -> None:
        if split not in SPLITS:
            raise ConfigError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        if window_samples <= 0:
            raise ConfigError(f"window_samples must be positive, got {window_samples}")
        self.manifest_path = Path(manifest_path)
        all_rows = read_manifest(self.manifest_path)
        self.rows: list[ManifestRow] = [
            r
            for r in all_rows
            if r.kind == "clip" and r.device_type == device_type and r.split == split
        ]
        if not self.rows:
            present = ", ".join(_device_types(all_rows))
            raise ConfigError(
                f"{self.manifest_path}: no clips for device type {device_type!r} and split {split!r} "
                f"(device types present: {present})"
            )
        self.device_type = device_type
        self.split = split
        self.window_samples = int(window_samples)
        self.augment = bool(augment)
        self.seed = int(seed)
        self.epoch = 0
        self.labels = np.array([r.label for r in self.rows], dtype=np.int64)
        self._cache: list[np.ndarray] | None = None
        if preload:
            self._cache = [self._load(i) for i in range(len(self.rows))]

    def _load(self, index: int) -> np.ndarray:
        return load_clip(self.rows[index].resolve(self.manifest_path), self.window_samples)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index < 0:
            index += len(self.rows)
        wave = self._cache[index] if self._cache is not None else self._load(index)
        if self.augment:
            rng = np.random.default_rng([self.seed, self.epoch, index])
            wave = augment_wave(wave, rng)
        return torch.from_numpy(np.array(wave, dtype=np.float32, copy=True)), int(
            self.labels[index]
        )
