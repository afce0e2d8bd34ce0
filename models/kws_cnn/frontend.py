"""Log-mel frontend inside the model: waveform in, log-mel spectrogram out. Its window and
mel filterbank are buffers, not parameters, so flat parameter vectors hold only the
trainable weights."""

from __future__ import annotations

import torch
import torchaudio
from torch import nn

from .config import ModelConfig

LOG_FLOOR = 1e-6


def mel_kwargs(cfg: ModelConfig) -> dict:
    """MelSpectrogram settings; librosa.feature.melspectrogram reproduces them with
    (n_fft, win_length, hop_length, center=True, pad_mode='reflect', power=2, n_mels, fmin,
    fmax, htk=False, norm='slaney')."""
    return dict(
        sample_rate=cfg.sample_rate,
        n_fft=cfg.n_fft,
        win_length=cfg.win_length,
        hop_length=cfg.hop_length,
        f_min=cfg.f_min,
        f_max=cfg.f_max if cfg.f_max is not None else cfg.sample_rate / 2.0,
        n_mels=cfg.n_mels,
        power=2.0,
        center=True,
        pad_mode="reflect",
        norm="slaney",
        mel_scale="slaney",
    )


class LogMelFrontend(nn.Module):
    """wave [B, T] float32 in [-1, 1] -> log-mel [B, n_mels, frames]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(**mel_kwargs(cfg))
        for p in self.mel.parameters():  # pragma: no cover - torchaudio uses buffers
            p.requires_grad_(False)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        return torch.log(self.mel(wave) + LOG_FLOOR)
