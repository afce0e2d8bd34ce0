"""The model's log-mel frontend in numpy, for ONNX models that take log-mel input.

onnxruntime runs a window's STFT far slower than numpy's FFT does (about 0.8 ms against
0.1 ms for the 151 frames of a 1.5 s window on one core), so the exported model can start
at the log-mel spectrogram and the device computes it here. The recipe is torchaudio's
MelSpectrogram as the model's frontend configures it (models/kws_cnn/frontend.py): a
periodic Hann window of `win_length` samples centred in `n_fft`, frames every
`hop_length` samples over the window reflect-padded by n_fft / 2 on both sides, power
spectrum, Slaney-scale mel filters with Slaney normalisation, then log(mel + floor).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wakefl.errors import AudioError, ConfigError


def _hz_to_mel_slaney(f: np.ndarray | float) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3.0, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, np.log(6.4) / 27.0
    return np.where(
        f >= min_log_hz,
        min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep,
        f / f_sp,
    )


def _mel_to_hz_slaney(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3.0, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, np.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


def mel_filterbank(
    n_freqs: int, f_min: float, f_max: float, n_mels: int, sample_rate: int
) -> np.ndarray:
    """[n_freqs, n_mels] triangular filters on the Slaney mel scale, each scaled to unit
    area (Slaney normalisation), as torchaudio.functional.melscale_fbanks builds them."""
    all_freqs = np.linspace(0.0, sample_rate // 2, n_freqs)
    m_pts = np.linspace(_hz_to_mel_slaney(f_min), _hz_to_mel_slaney(f_max), n_mels + 2)
    f_pts = _mel_to_hz_slaney(m_pts)
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = f_pts[None, :] - all_freqs[:, None]
    down = -slopes[:, :-2] / f_diff[:-1]
    up = slopes[:, 2:] / f_diff[1:]
    fb = np.maximum(0.0, np.minimum(down, up))
    return fb * (2.0 / (f_pts[2 : n_mels + 2] - f_pts[:n_mels]))[None, :]


@dataclass(frozen=True)
class LogMelSpec:
    """The frontend's settings, as the ONNX metadata carries them."""

    sample_rate: int
    window_samples: int
    n_fft: int
    win_length: int
    hop_length: int
    n_mels: int
    f_min: float
    f_max: float
    log_floor: float

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> LogMelSpec:
        try:
            spec = cls(
                sample_rate=int(meta["sample_rate"]),
                window_samples=int(meta["window_samples"]),
                n_fft=int(meta["n_fft"]),
                win_length=int(meta["win_length"]),
                hop_length=int(meta["hop_length"]),
                n_mels=int(meta["n_mels"]),
                f_min=float(meta["f_min"]),
                f_max=float(meta["f_max"]),
                log_floor=float(meta["log_floor"]),
            )
        except (KeyError, ValueError) as exc:
            raise ConfigError(
                f"ONNX metadata lacks the log-mel frontend's settings: {exc}"
            ) from None
        if not (0 < spec.win_length <= spec.n_fft and spec.hop_length > 0 and spec.n_mels > 0):
            raise ConfigError(f"ONNX metadata holds an impossible log-mel frontend: {spec}")
        if spec.window_samples <= spec.n_fft // 2:
            raise ConfigError("the window is too short for the frontend's reflect padding")
        return spec

    @property
    def frames(self) -> int:
        return 1 + self.window_samples // self.hop_length


class LogMel:
    """windows [B, window_samples] -> log-mel [B, n_mels, frames] float32."""

    def __init__(self, spec: LogMelSpec) -> None:
        self.spec = spec
        n = np.arange(spec.win_length)
        self._window = 0.5 - 0.5 * np.cos(2.0 * np.pi * n / spec.win_length)  # periodic Hann
        self._fb = mel_filterbank(
            spec.n_fft // 2 + 1, spec.f_min, spec.f_max, spec.n_mels, spec.sample_rate
        )
        # The window's non-zero taps start this far into each n_fft-sample frame.
        self._offset = (spec.n_fft - spec.win_length) // 2

    def __call__(self, windows: np.ndarray) -> np.ndarray:
        s = self.spec
        w = np.asarray(windows, dtype=np.float64)
        if w.ndim != 2 or w.shape[1] != s.window_samples:
            raise AudioError(f"windows must be [B, {s.window_samples}], got {w.shape}")
        frames = self.taps(w)[:, : s.frames]
        return self.frame_log_mel(frames).transpose(0, 2, 1).astype(np.float32)

    def taps(self, w: np.ndarray) -> np.ndarray:
        """[B, frames, win_length] views of the reflect-padded windows."""
        pad = self.spec.n_fft // 2
        padded = np.pad(w, ((0, 0), (pad, pad)), mode="reflect")
        taps = np.lib.stride_tricks.sliding_window_view(padded, self.spec.win_length, axis=1)
        return taps[:, self._offset :: self.spec.hop_length]

    def frame_log_mel(self, frames: np.ndarray) -> np.ndarray:
        """[..., win_length] frame taps -> [..., n_mels] float64."""
        # The power spectrum does not depend on where the taps sit inside the n_fft frame.
        spectrum = np.fft.rfft(frames * self._window, n=self.spec.n_fft, axis=-1)
        power = spectrum.real**2 + spectrum.imag**2
        return np.log(power @ self._fb + self.spec.log_floor)

    def interior(self) -> np.ndarray:
        """The frames whose taps lie inside the window (no reflect padding): the same in
        every window that covers them, so a stream computes each of them once."""
        s = self.spec
        start = np.arange(s.frames) * s.hop_length + self._offset - s.n_fft // 2
        return (start >= 0) & (start + s.win_length <= s.window_samples)


class StreamingLogMel:
    """Log-mel of overlapping stream windows that computes each interior frame once.

    Windows of a stream start at multiples of the detector's hop; when that hop is a
    multiple of the frontend's, window k's interior frame f is stream frame k * step + f,
    already computed for an earlier window unless it is new. Only the new frames and the
    few frames that see the window's reflect padding are computed: 14 of 151 frames a
    window at the shipped 0.1 s hop. Equal to `LogMel` on every window (tested)."""

    def __init__(self, log_mel: LogMel, hop_samples: int) -> None:
        if hop_samples % log_mel.spec.hop_length:
            raise ConfigError(
                f"a hop of {hop_samples} samples is not a multiple of the frontend's "
                f"{log_mel.spec.hop_length}"
            )
        self.log_mel = log_mel
        self.step = hop_samples // log_mel.spec.hop_length
        interior = log_mel.interior()
        inner = np.flatnonzero(interior)  # one contiguous run of frames
        self._lo, self._hi = int(inner[0]), int(inner[-1]) + 1
        self._edges = np.flatnonzero(~interior)
        self.reset()

    def reset(self) -> None:
        # Stream frames [_first, _first + len(_frames)) computed so far.
        self._first = 0
        self._frames = np.zeros((0, self.log_mel.spec.n_mels))

    def window(self, wave: np.ndarray, index: int) -> np.ndarray:
        """[n_mels, frames] float32 of the stream's `index`-th window `wave`."""
        spec = self.log_mel.spec
        lo, hi = index * self.step + self._lo, index * self.step + self._hi  # stream frames
        have_end = self._first + len(self._frames)
        if not (self._first <= lo <= have_end):  # a jump: nothing to reuse
            self._first, self._frames = lo, self._frames[:0]
            have_end = lo
        taps = self.log_mel.taps(np.asarray(wave, dtype=np.float64)[None, :])[0]
        new_from = have_end - lo + self._lo  # the window's first frame not yet computed
        todo = np.concatenate([self._edges, np.arange(new_from, self._hi)])
        computed = self.log_mel.frame_log_mel(taps[todo])
        n_edges = len(self._edges)
        self._frames = np.concatenate([self._frames[lo - self._first :], computed[n_edges:]])
        self._first = lo
        out = np.empty((spec.frames, spec.n_mels))
        out[self._edges] = computed[:n_edges]
        out[self._lo : self._hi] = self._frames[: hi - lo]
        return out.T.astype(np.float32)
