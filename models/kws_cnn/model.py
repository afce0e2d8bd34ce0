"""The wake-word CNN: log-mel frontend, 7 convolution + 4 pooling layers (11 in total),
global average pooling and a small classification head. GroupNorm rather than BatchNorm:
there are no running statistics, so the trainable parameters are the model's whole state
and a flat parameter vector describes it completely (what federated averaging needs)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import ModelConfig
from .flat_params import head_slice
from .frontend import LogMelFrontend

# ("conv", channels at width 1.0) or ("pool", (freq, time) kernel). Channels grow as the
# map shrinks, so most parameters sit where the feature map is small and cheap to run.
LAYOUT: tuple[tuple[str, int | tuple[int, int]], ...] = (
    ("conv", 24),
    ("pool", (2, 3)),
    ("conv", 48),
    ("pool", (2, 2)),
    ("conv", 96),
    ("conv", 128),
    ("pool", (2, 2)),
    ("conv", 256),
    ("conv", 384),
    ("pool", (2, 2)),
    ("conv", 448),
)
HEAD_HIDDEN = 64
GROUPS = 8


def scaled_channels(base: int, width: float) -> int:
    """Channels at `width`, a multiple of the GroupNorm group count (at least one group)."""
    return max(GROUPS, int(round(base * width / GROUPS)) * GROUPS)


class KwsCnn(nn.Module):
    """wave [B, T] float32 -> logits [B, 2]; class 1 is the wake word."""

    def __init__(self, cfg: ModelConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else ModelConfig()
        self.frontend = LogMelFrontend(self.cfg)
        layers: list[nn.Module] = []
        cin = 1
        for kind, arg in LAYOUT:
            if kind == "conv":
                assert isinstance(arg, int)
                cout = scaled_channels(arg, self.cfg.width)
                # No conv bias: GroupNorm's shift makes it redundant.
                layers += [
                    nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                    nn.GroupNorm(GROUPS, cout),
                    nn.ReLU(inplace=True),
                ]
                cin = cout
            else:
                layers.append(nn.MaxPool2d(arg))
        self.features = nn.Sequential(*layers)
        # Registered last so the head's parameters come last in `parameters()` order.
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(cin, HEAD_HIDDEN),
            nn.ReLU(inplace=True),
            nn.Linear(HEAD_HIDDEN, self.cfg.n_classes),
        )

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        return self.classify(self.frontend(wave))

    def classify(self, log_mel: torch.Tensor) -> torch.Tensor:
        """log-mel [B, n_mels, frames] -> logits [B, 2]: the model after its frontend."""
        x = self.features(log_mel.unsqueeze(1))
        x = x.mean(dim=(2, 3))
        return self.head(x)

    def predict_proba(self, wave: torch.Tensor) -> torch.Tensor:
        """Probability of the wake word, [B]."""
        return torch.softmax(self.forward(wave), dim=-1)[:, 1]

    def num_trainable_params(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def layer_counts(self) -> dict[str, int]:
        return {
            "conv_layers": sum(isinstance(m, nn.Conv2d) for m in self.features),
            "pool_layers": sum(isinstance(m, nn.MaxPool2d) for m in self.features),
        }


class ProbabilityModel(nn.Module):
    """Wraps a `KwsCnn` so its forward returns the wake probability (what ONNX ships)."""

    def __init__(self, model: KwsCnn) -> None:
        super().__init__()
        self.model = model

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        return self.model.predict_proba(wave)


class LogMelProbabilityModel(nn.Module):
    """Wraps a `KwsCnn` so its forward takes the log-mel spectrogram and returns the wake
    probability (what ONNX ships: the edge runtime computes the log-mel itself)."""

    def __init__(self, model: KwsCnn) -> None:
        super().__init__()
        self.model = model

    def forward(self, log_mel: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.model.classify(log_mel), dim=-1)[:, 1]


def model_summary(model: KwsCnn) -> dict[str, Any]:
    """The model's size and input geometry, as `wakefl model info` prints them."""
    cfg = model.cfg
    hs = head_slice(model)
    return {
        "architecture": "kws_cnn",
        "trainable_params": model.num_trainable_params(),
        **model.layer_counts(),
        "conv_pool_layers": sum(model.layer_counts().values()),
        "head_params": hs.stop - hs.start,
        "width": cfg.width,
        "sample_rate": cfg.sample_rate,
        "window_s": cfg.window_s,
        "window_samples": cfg.window_samples,
        "n_mels": cfg.n_mels,
        "n_frames": cfg.n_frames,
        "win_ms": cfg.win_ms,
        "hop_ms": cfg.hop_ms,
        "version": cfg.version,
    }
