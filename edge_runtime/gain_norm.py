"""PCEN and the log-domain AGC in numpy: the model's gain normalizations
(models/kws_cnn/gain_norm.py), for a device that computes the model's input features
outside the ONNX graph, and the reference the torch form is tested against (to 1e-4).

The exported graph computes PCEN itself from the log-mel this package feeds it, so the
streaming detector needs nothing from here; a port of the frontend to another runtime
(a microcontroller's C, say) follows this function. The recursion is run as written,
frame by frame, so it checks the torch form's matrix product too."""

from __future__ import annotations

import numpy as np

# s = 0.025 per 10 ms frame: a time constant of about 0.4 s. The paper's values, fixed.
PCEN_S = 0.025
PCEN_ALPHA = 0.98
PCEN_DELTA = 2.0
PCEN_R = 0.5
PCEN_EPS = 1e-6


def _smoothed_energy(x: np.ndarray) -> np.ndarray:
    """The causal smoother M of E = exp(x) per channel, started at each window's first frame."""
    energy = np.exp(x)
    smooth = np.empty_like(energy)
    smooth[..., 0] = energy[..., 0]
    for t in range(1, energy.shape[-1]):
        smooth[..., t] = (1.0 - PCEN_S) * smooth[..., t - 1] + PCEN_S * energy[..., t]
    return smooth


def pcen(log_mel: np.ndarray) -> np.ndarray:
    """[..., n_mels, frames] log-mel -> PCEN of the same shape (float32); the smoother starts
    at each window's first frame."""
    x = np.asarray(log_mel, dtype=np.float64)
    ratio = np.exp(x - PCEN_ALPHA * np.log(_smoothed_energy(x) + PCEN_EPS))
    return ((ratio + PCEN_DELTA) ** PCEN_R - PCEN_DELTA**PCEN_R).astype(np.float32)


def log_agc(log_mel: np.ndarray, alpha: float) -> np.ndarray:
    """[..., n_mels, frames] log-mel less `alpha` times the log of PCEN's smoother (the
    model's `gain_norm: log_agc`), float32; alpha 0 returns the log-mel as it was."""
    x = np.asarray(log_mel, dtype=np.float64)
    return (x - alpha * np.log(_smoothed_energy(x) + PCEN_EPS)).astype(np.float32)
