"""The wake-word model's configuration: architecture width and frontend parameters. It is
stored as JSON beside every checkpoint and inside every exported ONNX file, so a model can
always be rebuilt exactly and an edge device knows what audio to feed it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from wakefl.errors import ConfigError

ARCHITECTURE = "kws_cnn"
# Bump when the layer layout changes: old checkpoints then no longer describe the model.
ARCH_VERSION = 1
SUPPORTED_VERSIONS = (1,)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture width and log-mel frontend parameters of a `KwsCnn`."""

    width: float = 1.0
    sample_rate: int = 16000
    window_s: float = 1.5
    n_mels: int = 40
    win_ms: float = 25.0
    hop_ms: float = 10.0
    n_fft: int = 512
    f_min: float = 20.0
    f_max: float | None = None
    n_classes: int = 2
    version: int = ARCH_VERSION

    def __post_init__(self) -> None:
        if not (0.0 < self.width <= 4.0):
            raise ConfigError(f"width must be in (0, 4], got {self.width}")
        if self.sample_rate <= 0 or self.window_s <= 0:
            raise ConfigError("sample_rate and window_s must be positive")
        if self.win_length > self.n_fft:
            raise ConfigError(f"window of {self.win_length} samples exceeds n_fft={self.n_fft}")
        if self.hop_length <= 0 or self.n_mels <= 0:
            raise ConfigError("hop_ms and n_mels must be positive")
        if self.n_classes != 2:
            raise ConfigError("the wake-word model has exactly two classes")
        if self.version not in SUPPORTED_VERSIONS:
            raise ConfigError(
                f"unknown model version {self.version}; this build supports {SUPPORTED_VERSIONS}"
            )

    @property
    def window_samples(self) -> int:
        return int(round(self.window_s * self.sample_rate))

    @property
    def win_length(self) -> int:
        return int(round(self.win_ms * self.sample_rate / 1000.0))

    @property
    def hop_length(self) -> int:
        return int(round(self.hop_ms * self.sample_rate / 1000.0))

    @property
    def n_frames(self) -> int:
        """Spectrogram frames per window (centered STFT)."""
        return 1 + self.window_samples // self.hop_length

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"model config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        try:
            return cls(**d)
        except TypeError as exc:
            raise ConfigError(f"invalid model config: {exc}") from exc
