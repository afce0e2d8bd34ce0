"""Audio decoding for the edge runtime with the standard library and numpy only: RIFF/WAVE
PCM (8/16/24/32-bit) and IEEE float (32/64-bit), plain or WAVE_FORMAT_EXTENSIBLE. Stereo
is mixed down; other sample rates are resampled (band-limited, FFT-based)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from wakefl.errors import AudioError

_PCM = 1
_FLOAT = 3
_EXTENSIBLE = 0xFFFE
# A resampled file longer than this is refused rather than FFT-resampled in one piece.
_MAX_RESAMPLE_SAMPLES = 16000 * 60 * 30


_PLACEHOLDER_SIZES = (0, 0xFFFFFFFF)


def _parse_riff(data: bytes, name: str) -> tuple[int, int, int, int, bytes]:
    """(format tag, channels, sample rate, bits per sample, sample bytes)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise AudioError(
            f"{name}: not a WAV file (no RIFF/WAVE header); the edge runtime reads WAV only"
        )
    pos, fmt, samples = 12, None, None
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        body = data[pos + 8 : pos + 8 + size]
        if cid == b"fmt ":
            if len(body) < 16:
                raise AudioError(f"{name}: corrupt WAV (fmt chunk of {len(body)} bytes)")
            tag, ch, rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
            if tag == _EXTENSIBLE:
                if len(body) < 26:
                    raise AudioError(f"{name}: corrupt WAV (short extensible fmt chunk)")
                tag = struct.unpack("<H", body[24:26])[0]
            fmt = (tag, ch, rate, bits)
        elif cid == b"data":
            # A streaming writer that could not seek back leaves a placeholder size (0 or
            # 0xFFFFFFFF): take what exists. A real size the file does not hold is a file
            # cut short (a failed copy, a full disk), refused rather than read as a stub.
            if size not in _PLACEHOLDER_SIZES and len(body) < size:
                raise AudioError(
                    f"{name}: truncated WAV (its data chunk declares {size} bytes, the file "
                    f"holds {len(body)})"
                )
            samples = body
            break
        pos += 8 + size + (size & 1)
    if fmt is None:
        raise AudioError(f"{name}: corrupt WAV (no fmt chunk)")
    if samples is None:
        raise AudioError(f"{name}: corrupt WAV (no data chunk)")
    return (*fmt, samples)


def _decode(tag: int, channels: int, bits: int, raw: bytes, name: str) -> np.ndarray:
    """Samples as float32 in [-1, 1], shape [frames, channels]."""
    if channels < 1:
        raise AudioError(f"{name}: WAV declares {channels} channels")
    width = bits // 8
    if bits % 8 or width == 0:
        raise AudioError(f"{name}: unsupported WAV sample size {bits} bits")
    frame = width * channels
    n = len(raw) // frame
    if n == 0:
        raise AudioError(f"{name}: WAV holds no audio samples")
    raw = raw[: n * frame]
    if tag == _PCM:
        x = _decode_pcm(raw, width, bits, name)
    elif tag == _FLOAT:
        x = _decode_float(raw, width, bits, name)
    else:
        raise AudioError(f"{name}: unsupported WAV encoding (format tag {tag}); use PCM or float")
    return x.reshape(n, channels)


def _decode_pcm(raw: bytes, width: int, bits: int, name: str) -> np.ndarray:
    if width == 1:
        return (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 2:
        return np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    if width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = np.where(v >= 1 << 23, v - (1 << 24), v)
        return v.astype(np.float32) / float(1 << 23)
    if width == 4:
        return (np.frombuffer(raw, "<i4").astype(np.float64) / 2147483648.0).astype(np.float32)
    raise AudioError(f"{name}: unsupported PCM sample size {bits} bits")


def _decode_float(raw: bytes, width: int, bits: int, name: str) -> np.ndarray:
    if width == 4:
        x = np.frombuffer(raw, "<f4").astype(np.float32)
    elif width == 8:
        x = np.frombuffer(raw, "<f8").astype(np.float32)
    else:
        raise AudioError(f"{name}: unsupported float sample size {bits} bits")
    if not np.isfinite(x).all():
        raise AudioError(f"{name}: WAV holds NaN/Inf samples")
    return x


def resample(x: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """Band-limited resampling by truncating or zero-padding the spectrum (the ideal
    low-pass), float32 in and out."""
    if orig_rate == new_rate:
        return x.astype(np.float32, copy=False)
    if orig_rate <= 0 or new_rate <= 0:
        raise AudioError(f"invalid sample rates {orig_rate} -> {new_rate}")
    if len(x) > _MAX_RESAMPLE_SAMPLES:
        raise AudioError(
            f"audio of {len(x)} samples is too long to resample in one piece; "
            f"convert it to {new_rate} Hz first"
        )
    n_out = max(1, int(round(len(x) * new_rate / orig_rate)))
    spec = np.fft.rfft(x.astype(np.float64))
    keep = min(len(spec), n_out // 2 + 1)
    out_spec = np.zeros(n_out // 2 + 1, dtype=np.complex128)
    out_spec[:keep] = spec[:keep]
    y = np.fft.irfft(out_spec, n=n_out) * (n_out / len(x))
    return y.astype(np.float32)


def load_audio(path: Path | str, sample_rate: int = 16000) -> np.ndarray:
    """Mono float32 samples of the WAV file at `path`, at `sample_rate`. Raises
    AudioError for a missing, empty, corrupt or unsupported file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise AudioError(f"{path}: no such audio file") from exc
    except IsADirectoryError as exc:
        raise AudioError(f"{path}: is a directory, not an audio file") from exc
    except OSError as exc:
        raise AudioError(f"{path}: cannot read ({exc.strerror})") from exc
    if not data:
        raise AudioError(f"{path}: empty file")
    tag, channels, rate, bits, raw = _parse_riff(data, str(path))
    if rate <= 0:
        raise AudioError(f"{path}: WAV declares sample rate {rate}")
    x = _decode(tag, channels, bits, raw, str(path))
    mono = x.mean(axis=1, dtype=np.float32) if channels > 1 else x[:, 0]
    return resample(np.ascontiguousarray(mono, dtype=np.float32), rate, sample_rate)


def to_float32(chunk: np.ndarray) -> np.ndarray:
    """A streamed chunk as mono float32 in [-1, 1]: int16 is scaled by 1/32768; a 2-D
    [frames, channels] chunk is mixed down."""
    a = np.asarray(chunk)
    if a.dtype == np.int16:
        a = a.astype(np.float32) / 32768.0
    elif a.dtype.kind == "f":
        a = a.astype(np.float32, copy=False)
        if not np.isfinite(a).all():
            raise AudioError("audio chunk holds NaN/Inf samples")
    else:
        raise AudioError(f"audio chunk dtype must be int16 or float32, got {a.dtype}")
    if a.ndim == 2:
        a = a.mean(axis=1, dtype=np.float32)
    elif a.ndim != 1:
        raise AudioError(f"audio chunk must be 1-D (or [frames, channels]), got shape {a.shape}")
    return a
