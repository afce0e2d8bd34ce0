"""Log-mel frontend inside the model: waveform in, log-mel spectrogram out. Its window and
mel filterbank are buffers, not parameters, so flat parameter vectors hold only the
trainable weights. The ONNX export leaves it out by default (the edge runtime computes the
same log-mel in numpy, edge_runtime/log_mel.py); `DftLogMelFrontend` is its form for a
waveform-in export."""

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


class DftLogMelFrontend(nn.Module):
    """The same log-mel as `LogMelFrontend`, with the short-time Fourier transform written
    as a 1-D convolution against a windowed DFT basis: what the ONNX export runs.

    onnxruntime's STFT kernel took 2.2 ms of the full model's 4.4 ms per window on one
    core; a float Conv over the same frames is an ordinary GEMM there. The basis covers
    only the window's `win_length` non-zero taps (the window sits centred in `n_fft`, as
    torch.stft places it). Equal to `LogMelFrontend` to float rounding (tested)."""

    def __init__(self, frontend: LogMelFrontend) -> None:
        super().__init__()
        spec = frontend.mel.spectrogram
        n_fft, win_length = int(spec.n_fft), int(spec.win_length)
        if spec.power != 2.0 or not spec.center or spec.pad_mode != "reflect" or spec.normalized:
            raise ValueError("DftLogMelFrontend reproduces a centred, reflect-padded power STFT")
        self.offset = (n_fft - win_length) // 2
        self.pad = n_fft // 2
        self.hop = int(spec.hop_length)
        self.bins = n_fft // 2 + 1
        k = torch.arange(self.bins, dtype=torch.float64)[:, None]
        n = torch.arange(self.offset, self.offset + win_length, dtype=torch.float64)[None, :]
        angle = 2.0 * torch.pi * k * n / n_fft
        window = spec.window.to(torch.float64)[None, :]
        basis = torch.cat([torch.cos(angle) * window, -torch.sin(angle) * window])
        # Buffers out of the state dict: the checkpoint format does not change.
        self.register_buffer("basis", basis.float()[:, None, :], persistent=False)
        self.register_buffer("fb", frontend.mel.mel_scale.fb.clone(), persistent=False)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(wave[:, None, :], (self.pad, self.pad), mode="reflect")
        basis, fb = self.get_buffer("basis"), self.get_buffer("fb")
        y = torch.nn.functional.conv1d(x[:, :, self.offset :], basis, stride=self.hop)
        power = y[:, : self.bins] ** 2 + y[:, self.bins :] ** 2
        mel = torch.matmul(power.transpose(1, 2), fb).transpose(1, 2)
        return torch.log(mel + LOG_FLOOR)
