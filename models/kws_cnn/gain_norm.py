"""Per-channel energy normalization (PCEN) of the log-mel spectrogram, inside the model.

An automatic gain control per mel channel followed by root compression (Wang et al.,
"Trainable frontend for robust and far-field keyword spotting", 2017):

    M_t  = (1 - s) M_{t-1} + s E_t,   M_0 = E_0       (a causal smoother per channel)
    PCEN = (E_t / (eps + M_t)^alpha + delta)^r - delta^r

with E = exp(log-mel), the model's input. `log(mel + floor)` keeps a device's gain in every
feature, and a gain that changes over the window (what an AGC does) is then a change the
model has to learn to ignore; E / M^alpha with alpha near 1 divides it out frame by frame.
The smoother starts at the window's first frame, so a window's features depend on that
window alone (training and scoring see the same thing), and it is causal: sound after a
frame never changes that frame's value.

The recursion is written as one matrix product over the window's frames (`smoother_matrix`)
so that the ONNX graph is plain MatMul and elementwise operators; int8 export leaves it in
float (models/kws_cnn/quantize.py quantizes Conv and Gemm only). The constants are the
paper's, fixed (buffers, not parameters): the flat parameter vector the federation
averages is the CNN's alone. edge_runtime/gain_norm.py is the same function in numpy."""

from __future__ import annotations

import torch
from torch import nn

# One definition of the constants, in the torch-free package a device installs.
from wakefl.edge_runtime.gain_norm import PCEN_ALPHA, PCEN_DELTA, PCEN_EPS, PCEN_R, PCEN_S


def smoother_matrix(frames: int, s: float = PCEN_S) -> torch.Tensor:
    """K [frames, frames] float64 with M = E @ K for E [..., frames]: K[k, t] = s (1-s)^(t-k)
    for 1 <= k <= t, K[0, t] = (1-s)^t (the smoother starts at the first frame)."""
    t = torch.arange(frames, dtype=torch.float64)
    lag = t[None, :] - t[:, None]
    k = torch.where(lag >= 0, s * (1.0 - s) ** lag.clamp(min=0), torch.zeros(()))
    k[0] = (1.0 - s) ** t
    return k


def smoothed_energy(log_mel: torch.Tensor, smoother: torch.Tensor) -> torch.Tensor:
    """The smoother M of E = exp(log-mel) per channel, with `smoother` = smoother_matrix."""
    return torch.matmul(torch.exp(log_mel), smoother)


class Pcen(nn.Module):
    """log-mel [B, n_mels, frames] -> PCEN [B, n_mels, frames], for a fixed frame count."""

    def __init__(self, frames: int) -> None:
        super().__init__()
        # Not persistent: checkpoints hold the trainable parameters only.
        self.register_buffer("smoother", smoother_matrix(frames).float(), persistent=False)

    def forward(self, log_mel: torch.Tensor) -> torch.Tensor:
        smooth = smoothed_energy(log_mel, self.get_buffer("smoother"))
        # E / (eps + M)^alpha in the log domain: no overflow for a loud frame after silence.
        ratio = torch.exp(log_mel - PCEN_ALPHA * torch.log(smooth + PCEN_EPS))
        return (ratio + PCEN_DELTA) ** PCEN_R - PCEN_DELTA**PCEN_R


class LogAgc(nn.Module):
    """log-mel [B, n_mels, frames] -> log-mel less `alpha` times each channel's log level over
    the frames before (the PCEN smoother), for a fixed frame count."""

    def __init__(self, frames: int, alpha: float) -> None:
        super().__init__()
        self.alpha = float(alpha)
        self.register_buffer("smoother", smoother_matrix(frames).float(), persistent=False)

    def forward(self, log_mel: torch.Tensor) -> torch.Tensor:
        smooth = smoothed_energy(log_mel, self.get_buffer("smoother"))
        return log_mel - self.alpha * torch.log(smooth + PCEN_EPS)
