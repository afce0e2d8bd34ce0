"""Vocal-tract-length perturbation on log-mel spectrograms, for pretraining.

A speaker with a shorter or longer vocal tract has the same formant pattern scaled in
frequency. Scaling each example's spectrum by a random factor alpha (a formant at f moves to
alpha * f) lets a model trained on a few speech engines hear more of the voices it has never
met. Tape-speed augmentation also scales the formants, but only together with the tempo and
over a one-sided range (tools/augmentation/wave_augment.py); this warp is independent of both.

The warp acts on the frontend's output: the value of mel band i after the warp is the value
the unwarped spectrogram has at frequency centre_i / alpha, interpolated between bands on the
Slaney mel scale the frontend uses (models/kws_cnn/frontend.py). Bands whose source lies
beyond the first or last band repeat that band's value.
"""

from __future__ import annotations

import math

import numpy as np

# The Slaney mel scale: linear below 1 kHz, logarithmic above.
_LINEAR_HZ_PER_MEL = 200.0 / 3.0
_BREAK_HZ = 1000.0
_BREAK_MEL = _BREAK_HZ / _LINEAR_HZ_PER_MEL
_LOG_STEP = math.log(6.4) / 27.0


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney mel of frequencies in Hz (librosa's `hz_to_mel(htk=False)`)."""
    hz = np.asarray(hz, dtype=np.float64)
    log_part = _BREAK_MEL + np.log(np.maximum(hz, _BREAK_HZ) / _BREAK_HZ) / _LOG_STEP
    return np.where(hz < _BREAK_HZ, hz / _LINEAR_HZ_PER_MEL, log_part)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    """Inverse of `hz_to_mel`."""
    mel = np.asarray(mel, dtype=np.float64)
    log_part = _BREAK_HZ * np.exp(_LOG_STEP * (np.maximum(mel, _BREAK_MEL) - _BREAK_MEL))
    return np.where(mel < _BREAK_MEL, mel * _LINEAR_HZ_PER_MEL, log_part)


def source_positions(n_mels: int, f_min: float, f_max: float, alpha: np.ndarray) -> np.ndarray:
    """Fractional band index [len(alpha), n_mels] that each band of a spectrum scaled by
    alpha reads from; alpha = 1 gives 0, 1, ..., n_mels - 1."""
    edges = np.linspace(hz_to_mel(np.array(f_min)), hz_to_mel(np.array(f_max)), n_mels + 2)
    step = edges[1] - edges[0]
    centres = mel_to_hz(edges[1:-1])
    alpha = np.asarray(alpha, dtype=np.float64).reshape(-1, 1)
    pos = (hz_to_mel(centres[None, :] / alpha) - edges[0]) / step - 1.0
    return np.clip(pos, 0.0, n_mels - 1.0)


def warp_log_mel(feats, alpha, f_min: float, f_max: float):
    """Log-mel [B, n_mels, frames] (torch) with each example's spectrum scaled by its
    alpha [B] (linear interpolation between bands)."""
    import torch

    from wakefl.tools.augmentation.spectrogram_interp import interpolate_at

    pos = torch.as_tensor(
        source_positions(feats.shape[1], f_min, f_max, np.asarray(alpha)),
        dtype=feats.dtype,
        device=feats.device,
    )
    return interpolate_at(feats, pos, dim=1)
