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
# Version 2 adds the choices below (normalization, time pooling, gain normalization, the
# first pool's time stride); a version-1 file names none of them and means their first
# values, which are the dataclass defaults, so every version-1 file still loads as it was.
ARCH_VERSION = 1
SUPPORTED_VERSIONS = (1, 2)
# GroupNorm over the whole window, per frame, or over a causal decaying average of frames
NORMS = ("group", "frame", "causal")
TIME_POOLS = ("mean", "lse", "max")  # features averaged, or frame decisions pooled
# log-mel as is, per-channel energy normalization, or its gain stage alone in the log domain
GAIN_NORMS = ("none", "pcen", "log_agc")
# What the model trained for speech around the phrase uses (models/kws_cnn/model.py), and
# what every version-1 model is.
CONTEXT_ROBUST = {"norm": "frame", "time_pool": "lse", "gain_norm": "pcen", "first_time_pool": 2}
V1_CHOICES = {
    "norm": "group",
    "time_pool": "mean",
    "gain_norm": "none",
    "first_time_pool": 3,
    "gain_alpha": 0.98,
}


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
    norm: str = "group"
    time_pool: str = "mean"
    gain_norm: str = "none"
    first_time_pool: int = 3  # the first pooling layer's time kernel (3: 30 ms frames)
    # log_agc's share of each channel's recent level taken out (gain_norm.py LogAgc); a
    # file names it only with gain_norm "log_agc", so every other file stays as it was.
    gain_alpha: float = 0.98

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
        self._check_choices()

    def _check_choices(self) -> None:
        for name, allowed in (
            ("norm", NORMS),
            ("time_pool", TIME_POOLS),
            ("gain_norm", GAIN_NORMS),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}")
        if not 0.0 <= self.gain_alpha <= 1.0:  # False for NaN too
            raise ConfigError(f"gain_alpha must be in [0, 1], got {self.gain_alpha}")
        if self.gain_norm != "log_agc" and self.gain_alpha != V1_CHOICES["gain_alpha"]:
            raise ConfigError("gain_alpha applies to gain_norm log_agc only")
        if self.first_time_pool not in (2, 3):
            raise ConfigError(f"first_time_pool must be 2 or 3, got {self.first_time_pool}")
        if self.version == 1 and self.architecture_choices() != V1_CHOICES:
            raise ConfigError("a version-1 model has GroupNorm, mean pooling and log-mel only")

    def architecture_choices(self) -> dict[str, Any]:
        """The version-2 choices of this model (norm, time pooling, gain, first pool, alpha)."""
        return {k: getattr(self, k) for k in V1_CHOICES}

    @classmethod
    def context_robust(cls, **kw: Any) -> ModelConfig:
        """A version-2 config with the choices that keep a phrase's score its own when
        other speech shares the window (per-frame norm, pooled frame decisions, PCEN)."""
        return cls(**{"version": 2, **CONTEXT_ROBUST, **kw})

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
        d = dataclasses.asdict(self)
        if self.version == 1:  # version-1 files stay byte-for-byte what they were
            for k in V1_CHOICES:
                d.pop(k)
        elif self.gain_norm != "log_agc":
            d.pop("gain_alpha")
        return d

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
