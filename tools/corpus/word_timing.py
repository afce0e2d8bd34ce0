"""The timing of a two-word utterance: where its first word ends, the pause after it, and
re-timing either side.

The training engines speak the wake phrase with their own, narrow timing: a model trained
on them alone rejects "hey nova" when "hey" is short, or when the pause of "hey, nova" is
cut out (tools/evaluation/probe_timing.py measures this). The probe uses these functions to re-time a
phrase; the `pretrain-timing` corpus profile uses them to train on such timings
(tools/CORPUS.md).
"""

from __future__ import annotations

import re

import numpy as np

_FRAME_S = 0.01
_ACTIVE_DB = -25.0  # the utterance spans the frames within this of its loudest frame
_DIP_DB = 2.0  # the least prominence (dB) of a dip that counts as a syllable boundary
_GAP_DB = -30.0  # a frame this far below the utterance's loudest frame is part of a pause
_FADE_S = 0.01  # the crossfade where a pause is cut out, so the cut does not click


def _frame_energy(wave: np.ndarray, sr: int) -> tuple[np.ndarray, int]:
    """Mean power of each whole 10 ms frame of `wave`, and the frame length in samples."""
    frame = max(1, int(_FRAME_S * sr))
    n = wave.size // frame
    return (wave[: n * frame].reshape(n, frame) ** 2).mean(axis=1), frame


def syllables(text: str) -> int:
    """A spelling's syllable count, estimated as its groups of vowel letters ("y" counts as
    one): "hey" 1, "nova" 2. Good enough to count the dips between a phrase's syllables."""
    return max(1, len(re.findall(r"[aeiouy]+", text.lower())))


def first_word_end(
    wave: np.ndarray, sr: int = 16000, first_syllables: int = 1, total_syllables: int = 3
) -> int:
    """The sample where the first word ends, for an utterance of `total_syllables` whose
    first word has `first_syllables`. Between syllables the energy dips (a consonant, a
    closure, a pause): the `total_syllables - 1` most prominent dips of the 10 ms energy
    envelope, in time order, are the syllable boundaries, and the first word ends at dip
    number `first_syllables`. Where the engine runs syllables together so that fewer dips
    show, the boundary is placed in proportion to the syllable counts instead."""
    from scipy.signal import find_peaks

    energy, frame = _frame_energy(wave, sr)
    n = energy.size
    if n < 3 or not energy.max() > 0:
        return wave.size // 2
    db = 10 * np.log10(energy / energy.max() + 1e-12)
    db = np.convolve(db, np.ones(3) / 3, mode="same")
    active = np.flatnonzero(db > _ACTIVE_DB)
    lo, hi = int(active[0]), int(active[-1]) + 1
    dips, props = find_peaks(-db[lo:hi], prominence=_DIP_DB)
    wanted = max(1, total_syllables - 1)
    if dips.size >= wanted and first_syllables <= wanted:
        bounds = np.sort(dips[np.argsort(-props["prominences"], kind="stable")[:wanted]])
        k = lo + int(bounds[first_syllables - 1])
    else:
        k = lo + int(round((hi - lo) * first_syllables / max(total_syllables, 1)))
    return k * frame + frame // 2


def retime(wave: np.ndarray, split: int, first: float, rest: float) -> np.ndarray:
    """The first `split` samples lasting `first` times as long, the rest `rest` times
    (librosa's phase vocoder, which keeps the pitch)."""
    import librosa

    parts = []
    for part, f in ((wave[:split], first), (wave[split:], rest)):
        parts.append(part if f == 1.0 else librosa.effects.time_stretch(part, rate=1.0 / f))
    return np.concatenate(parts)


def pause_around(wave: np.ndarray, split: int, sr: int = 16000) -> tuple[int, int]:
    """The pause that contains sample `split`, as [start, end) in samples: the run of 10 ms
    frames around it at least 30 dB below the utterance's loudest frame. Empty (start ==
    end) when the frame at `split` is not that quiet: the words already run together."""
    energy, frame = _frame_energy(wave, sr)
    n = energy.size
    if n == 0:
        return split, split
    quiet = energy <= energy.max() * 10 ** (_GAP_DB / 10)
    k = min(split // frame, n - 1)
    if not quiet[k]:
        return split, split
    lo, hi = k, k + 1
    while lo > 0 and quiet[lo - 1]:
        lo -= 1
    while hi < n and quiet[hi]:
        hi += 1
    return lo * frame, hi * frame


def close_pause(wave: np.ndarray, split: int, sr: int = 16000) -> tuple[np.ndarray, int]:
    """`wave` with the pause around `split` cut out and the two sides crossfaded over 10 ms,
    and the sample where the first word now ends."""
    start, end = pause_around(wave, split, sr)
    if end <= start or start == 0 or end >= wave.size:
        return wave, split
    fade = min(int(_FADE_S * sr), start, wave.size - end)
    ramp = np.linspace(1.0, 0.0, fade, endpoint=False)
    left, right = wave[:start], wave[end:]
    joint = left[start - fade :] * ramp + right[:fade] * (1.0 - ramp)
    out = np.concatenate([left[: start - fade], joint, right[fade:]])
    return out, start - fade // 2


def phrase_split(wave: np.ndarray, text: str, sr: int = 16000) -> int:
    """Where the first word of `text`, as spoken in `wave`, ends."""
    words = text.replace(",", " ").split()
    first = syllables(words[0]) if words else 1
    return first_word_end(wave, sr, first, sum(syllables(w) for w in words) or 1)


def run_together(wave: np.ndarray, text: str, first: float, sr: int = 16000) -> np.ndarray:
    """An utterance of `text` spoken without a pause after its first word and with that
    word lasting `first` times as long."""
    joined, split = close_pause(wave, phrase_split(wave, text, sr), sr)
    return retime(joined, split, first, 1.0)
