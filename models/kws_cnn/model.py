"""The wake-word CNN: log-mel frontend, 7 convolution + 4 pooling layers (11 in total),
pooling over the map and a small classification head. GroupNorm rather than BatchNorm:
there are no running statistics, so the trainable parameters are the model's whole state
and a flat parameter vector describes it completely (what federated averaging needs).

Version 1 (every model shipped so far) normalizes each convolution's output with
statistics over the whole 1.5 s window and averages the last map over time, so loud
speech half a second from the phrase rescales the phrase's features and outvotes its
frames. Version 2 (`ModelConfig.context_robust()`) keeps a phrase's score its own:
- GroupNorm per frame (`FrameGroupNorm`): each frame's statistics over its channels and
  frequencies, so nothing outside a frame's receptive field changes it;
- the head scores every frame of the last map, and the window's score is a log-mean-exp
  of those frame scores (a soft maximum): the frames that hold the phrase decide;
- PCEN on the log-mel (gain_norm.py): a gain that changes over time is divided out
  (or `gain_norm="log_agc"`, its gain stage alone, which a log-mel model can be moved to
  a little at a time);
- a first pool of 2 frames instead of 3, so a last-map frame sees about 1.0 s (102
  frames) rather than the whole window, with a frame every 160 ms.
Every choice keeps the parameter shapes, so a version-1 checkpoint initializes a
version-2 model (`--init-from`) and the federation's vector is the same length. Each can be
changed alone (`norm="group"` or `"causal"`, `time_pool="mean"`, ...): the ablation in
models/kws_cnn/pretrained/MODEL_CARD.md found that norms over a short span of time (per
frame, or `CausalGroupNorm`) train slower and end worse than the window's GroupNorm, and
that the pooled frame decisions are the choice that carries over from version-1 weights."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from wakefl.errors import ConfigError

from .config import ModelConfig
from .flat_params import head_slice
from .frontend import LogMelFrontend
from .gain_norm import LogAgc, Pcen

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
# The causal norm's memory: a frame's statistics weight the frames before it by
# exp(-age / CAUSAL_NORM_S), so speech a second before the phrase weighs a seventh as much
# as the phrase's own frames.
CAUSAL_NORM_S = 0.5


def scaled_channels(base: int, width: float) -> int:
    """Channels at `width`, a multiple of the GroupNorm group count (at least one group)."""
    return max(GROUPS, int(round(base * width / GROUPS)) * GROUPS)


class FrameGroupNorm(nn.GroupNorm):
    """GroupNorm with each time frame normalized on its own: statistics over a group's
    channels and the frame's frequencies, [B, C, F, T]. The same parameters as GroupNorm
    (a per-channel scale and shift), so the two load each other's weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Reduced over a view, not a transposed copy: the exported graph has no Transpose.
        b, c, f, t = x.shape
        g = x.reshape(b, self.num_groups, c // self.num_groups * f, t)
        centred = g - g.mean(dim=2, keepdim=True)
        var = centred.pow(2).mean(dim=2, keepdim=True)
        y = (centred / torch.sqrt(var + self.eps)).reshape(b, c, f, t)
        return y * self.weight.view(1, c, 1, 1) + self.bias.view(1, c, 1, 1)


def causal_average_matrix(frames: int, decay: float) -> torch.Tensor:
    """W [frames, frames] float64 with W[k, t] = decay^(t-k) for k <= t (0 after t), each
    column summing to 1: `stats @ W` is, at each frame, a decaying average of it and the
    frames before it (decay 0: that frame alone; decay 1: the mean from the window's start)."""
    t = torch.arange(frames, dtype=torch.float64)
    lag = t[None, :] - t[:, None]
    w = torch.where(lag >= 0, decay ** lag.clamp(min=0), torch.zeros((), dtype=torch.float64))
    return w / w.sum(dim=0, keepdim=True)


class CausalGroupNorm(nn.GroupNorm):
    """GroupNorm whose statistics at each time frame are a causal decaying average of the
    per-frame group statistics ([B, C, F, T], time constant CAUSAL_NORM_S): sound after a
    frame never changes it, sound long before it hardly does, and unlike a per-frame norm a
    frame keeps its level against the frames just before it (a word after a pause stays
    louder than the pause). The same parameters as GroupNorm."""

    def __init__(self, num_groups: int, num_channels: int, frames: int, frame_s: float) -> None:
        super().__init__(num_groups, num_channels)
        w = causal_average_matrix(frames, math.exp(-frame_s / CAUSAL_NORM_S))
        # Not persistent: checkpoints hold the trainable parameters only.
        self.register_buffer("average", w.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, f, t = x.shape
        g = x.reshape(b, self.num_groups, c // self.num_groups * f, t)
        w = self.get_buffer("average")
        mean = torch.matmul(g.mean(dim=2, keepdim=True), w)
        var = (torch.matmul(g.pow(2).mean(dim=2, keepdim=True), w) - mean.pow(2)).clamp_min(0)
        y = ((g - mean) / torch.sqrt(var + self.eps)).reshape(b, c, f, t)
        return y * self.weight.view(1, c, 1, 1) + self.bias.view(1, c, 1, 1)


def pooled_frame_logits(frame_logits: torch.Tensor, how: str) -> torch.Tensor:
    """[B, T, 2] per-frame logits -> [B, 2] window logits whose softmax is the sigmoid of
    the pooled wake log-odds: log-mean-exp ("lse", a soft maximum) or the maximum."""
    odds = frame_logits[..., 1] - frame_logits[..., 0]
    if how == "max":
        pooled = odds.amax(dim=1)
    else:
        pooled = torch.logsumexp(odds, dim=1) - math.log(odds.shape[1])
    half = 0.5 * pooled
    return torch.stack([-half, half], dim=1)


class KwsCnn(nn.Module):
    """wave [B, T] float32 -> logits [B, 2]; class 1 is the wake word."""

    def __init__(self, cfg: ModelConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else ModelConfig()
        self.frontend = LogMelFrontend(self.cfg)
        self.gain_norm = self._gain_norm()
        layers: list[nn.Module] = []
        cin = 1
        frames, frame_s = self.cfg.n_frames, self.cfg.hop_ms / 1000.0
        for i, (kind, arg) in enumerate(LAYOUT):
            if kind == "conv":
                assert isinstance(arg, int)
                cout = scaled_channels(arg, self.cfg.width)
                # No conv bias: GroupNorm's shift makes it redundant.
                layers += [
                    nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                    self._norm(cout, frames, frame_s),
                    nn.ReLU(inplace=True),
                ]
                cin = cout
            else:
                assert isinstance(arg, tuple)
                first = i == 1  # the first pool sets the last map's frame rate
                kernel = (arg[0], self.cfg.first_time_pool) if first else arg
                layers.append(nn.MaxPool2d(kernel))
                frames, frame_s = frames // kernel[1], frame_s * kernel[1]
        self.features = nn.Sequential(*layers)
        # Registered last so the head's parameters come last in `parameters()` order.
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(cin, HEAD_HIDDEN),
            nn.ReLU(inplace=True),
            nn.Linear(HEAD_HIDDEN, self.cfg.n_classes),
        )

    def _gain_norm(self) -> nn.Module | None:
        if self.cfg.gain_norm == "pcen":
            return Pcen(self.cfg.n_frames)
        if self.cfg.gain_norm == "log_agc":
            return LogAgc(self.cfg.n_frames, self.cfg.gain_alpha)
        return None

    def set_gain_alpha(self, alpha: float) -> None:
        """Moves a log_agc model's gain_alpha (config included, so a checkpoint saved now
        says what it computes): how a run brings log-mel weights over to the AGC."""
        if not isinstance(self.gain_norm, LogAgc):
            raise ConfigError("set_gain_alpha needs a model with gain_norm log_agc")
        self.cfg = dataclasses.replace(self.cfg, gain_alpha=float(alpha))
        self.gain_norm.alpha = self.cfg.gain_alpha

    def _norm(self, channels: int, frames: int, frame_s: float) -> nn.Module:
        if self.cfg.norm == "causal":
            return CausalGroupNorm(GROUPS, channels, frames, frame_s)
        return (FrameGroupNorm if self.cfg.norm == "frame" else nn.GroupNorm)(GROUPS, channels)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        return self.classify(self.frontend(wave))

    def classify(self, log_mel: torch.Tensor) -> torch.Tensor:
        """log-mel [B, n_mels, frames] -> logits [B, 2]: the model after its frontend."""
        if self.gain_norm is not None:
            log_mel = self.gain_norm(log_mel)
        x = self.features(log_mel.unsqueeze(1))
        if self.cfg.time_pool == "mean":
            return self.head(x.mean(dim=(2, 3)))
        return pooled_frame_logits(self.frame_logits(x), self.cfg.time_pool)

    def frame_logits(self, feature_map: torch.Tensor) -> torch.Tensor:
        """The head on each frame of the last map [B, C, F, T] (averaged over frequency):
        [B, T, 2]."""
        frames = feature_map.mean(dim=2).transpose(1, 2)
        return self.head[1:](frames)

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
