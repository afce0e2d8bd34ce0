"""Whether one enrolment take holds the wake phrase, said cleanly: pure checks on a 16 kHz
wave (numpy, and the phrase locator's voice-activity model through onnxruntime).

A take is refused, with the reason, when it is clipped (too many samples at full scale:
the model would learn the distortion), when the voice-activity model hears no speech in
it, when its speech is too short to be a phrase or longer than the model's window (a
sentence, not the phrase alone), and, among several takes of one user, when it does not
sound like any of the others (`odd_takes`: the distance between two takes' cepstra after
dynamic time warping). A take that passes is cut to the window the phrase locator centres
on its speech (sdk/phrase_locator.py).

Limits: the checks hear speech, not words. A single take cannot be compared with anything,
and a different phrase as short as the wake phrase passes the duration checks; only the
comparison among takes catches it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wakefl.sdk.manifest import CLIP_SAMPLES, SAMPLE_RATE
from wakefl.sdk.phrase_locator import (
    SPEECH,
    VAD_FRAME,
    speech_probability,
    speech_stretch,
    window_start,
)

# A sample at or above this magnitude sits at full scale (int16's 32767 / 32768 = 0.99997).
FULL_SCALE = 0.999
# More than this share of samples at full scale is clipping, not a peak that touched it:
# 0.1 % is 24 samples of a 1.5 s take.
MAX_CLIPPED_SHARE = 0.001
# Speech shorter than this is a cough or a click, not a two-word phrase.
MIN_SPEECH_S = 0.25
# Two takes of one phrase by one voice lie 1.2-3.0 apart after time warping, other phrases
# by the same voice 6.6-14 (espeak-ng's "hey nova" at three speeds and two pitches against
# "good morning", "hello there", "hey novel" and a sentence): 5 lies between.
PHRASE_DISTANCE_BOUND = 5.0
_N_CEPSTRA = 12


@dataclass(frozen=True)
class TakeCheck:
    """The verdict on one take: accepted or not and why, where its speech lies (samples)
    and the start of the window that holds the phrase."""

    accepted: bool
    reason: str
    speech: tuple[int, int] = (0, 0)
    start: int = 0


def clipped_share(wave: np.ndarray) -> float:
    """The share of samples at full scale."""
    if wave.size == 0:
        return 0.0
    return float(np.count_nonzero(np.abs(wave) >= FULL_SCALE)) / wave.size


def check_take(wave: np.ndarray, window: int = CLIP_SAMPLES) -> TakeCheck:
    """Check one take (float, 16 kHz, in [-1, 1]) and locate the phrase's `window`."""
    if wave.size == 0:
        return TakeCheck(False, "the take is empty")
    share = clipped_share(wave)
    if share > MAX_CLIPPED_SHARE:
        return TakeCheck(
            False,
            f"clipped: {share:.1%} of its samples are at full scale (say it further from the "
            "microphone or more softly)",
        )
    prob = speech_probability(wave)
    if prob.size == 0 or prob.max() < SPEECH:
        return TakeCheck(False, "no speech heard: the voice-activity model found none")
    stretch = speech_stretch(prob >= SPEECH, int(np.argmax(prob)))
    assert stretch is not None  # the most certain frame is speech
    lo, hi = stretch[0] * VAD_FRAME, min(wave.size, (stretch[1] + 1) * VAD_FRAME)
    seconds = (hi - lo) / SAMPLE_RATE
    if seconds < MIN_SPEECH_S:
        return TakeCheck(False, f"only {seconds:.2f} s of speech: too short for the phrase")
    if hi - lo > window:
        return TakeCheck(
            False,
            f"{seconds:.1f} s of speech, longer than the phrase window of "
            f"{window / SAMPLE_RATE:.1f} s: say the wake phrase alone",
        )
    start = window_start(prob, wave.size, window)
    return TakeCheck(True, "", (lo, hi), 0 if start is None else start)


def phrase_features(speech: np.ndarray) -> np.ndarray:
    """Mean-normalised cepstra (12 per 10 ms frame) of a stretch of speech: what the
    comparison among takes warps and measures."""
    n, hop, n_fft, n_mels = 400, 160, 512, 40
    x = np.asarray(speech, dtype=np.float64)
    if x.size < n:
        x = np.pad(x, (0, n - x.size))
    frames = np.lib.stride_tricks.sliding_window_view(x, n)[::hop] * np.hanning(n)
    power = np.abs(np.fft.rfft(frames, n_fft)) ** 2
    from wakefl.edge_runtime.log_mel import mel_filterbank

    log_mel = np.log(
        power @ mel_filterbank(n_fft // 2 + 1, 20.0, 8000.0, n_mels, SAMPLE_RATE) + 1e-6
    )
    k = np.arange(n_mels)
    dct = np.cos(np.pi / n_mels * (k[None, :] + 0.5) * np.arange(1, _N_CEPSTRA + 1)[:, None])
    cep = log_mel @ (dct.T * np.sqrt(2.0 / n_mels))
    return cep - cep.mean(axis=0)


def phrase_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The mean frame distance of `phrase_features` a and b along their best time warping
    (dynamic time warping, normalised by the path's length bound)."""
    d = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1))
    acc = np.full(b.shape[0] + 1, np.inf)
    acc[0] = 0.0
    for i in range(a.shape[0]):
        row = np.full(b.shape[0] + 1, np.inf)
        for j in range(b.shape[0]):
            row[j + 1] = d[i, j] + min(acc[j + 1], row[j], acc[j])
        acc = row
    return float(acc[-1] / (a.shape[0] + b.shape[0]))


def odd_takes(features: list[np.ndarray], bound: float = PHRASE_DISTANCE_BOUND) -> list[float]:
    """Each take's distance to the nearest other take (inf for a lone take): a take above
    `bound` does not sound like any other take of the same phrase."""
    out = []
    for i, a in enumerate(features):
        others = [phrase_distance(a, b) for j, b in enumerate(features) if j != i]
        out.append(min(others) if others else float("inf"))
    return out


__all__ = [
    "MAX_CLIPPED_SHARE",
    "PHRASE_DISTANCE_BOUND",
    "TakeCheck",
    "check_take",
    "clipped_share",
    "odd_takes",
    "phrase_distance",
    "phrase_features",
]
