"""Speech around the talker: the training windows in which speech alone carries no label.

Every wake phrase of the pretraining corpus is said alone, and every window that holds
other speech is a negative; a model trained on that learns "speech beside the phrase means
no wake word" and misses "hey nova, turn on the lights" said in one breath. This stage puts
speech beside and under the foreground of a window, positives and negatives alike:
- the same speaker going on (another of their clips, the run's training negatives, so never
  the phrase) right after the foreground or just before it, with no pause at all down to
  0.3 s: a command said in one breath;
- other people: a single talker or babble (speech_backgrounds.py), only outside the
  foreground (before it, after it, or both) or over the whole window.
Its level is set on active speech (the frames within 35 dB of the loudest:
field_acoustics.active_rms), at a signal-to-background ratio drawn from [floor, 15] dB; the
floor comes down to -5 dB over a curriculum (`snr_floor`). The foreground itself is never
moved or cut, so a positive keeps its whole phrase.

Pure numpy, deterministic for a given generator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from wakefl.tools.acoustics.field_acoustics import active_rms

SAMPLE_RATE = 16000
FRAME = 160  # 10 ms
SNR_TOP_DB = 15.0
SNR_FLOOR_DB = -5.0  # where the curriculum ends
SNR_START_DB = 5.0  # where it starts
PLACEMENTS = ("same_speaker", "outside", "before", "after", "over")
# Shares of the placements above: a speaker going on, other speech apart from the
# foreground, and other speech over the whole window.
PLACEMENT_SHARES = (0.35, 0.15, 0.1, 0.1, 0.3)
GAP_S = (0.0, 0.3)  # pause between the foreground and the same speaker's next words
MARGIN_S = 0.05  # other speech "outside" the foreground keeps this far from it
FADE = 160  # 10 ms ramps where a background stretch starts and stops


def active_span(x: np.ndarray, floor_db: float = 25.0) -> tuple[int, int]:
    """[start, end) in samples of the 10 ms frames from the first to the last within
    `floor_db` of the loudest: where the foreground speaks. The whole window when silent."""
    n = x.size // FRAME
    if n == 0:
        return 0, x.size
    power = np.mean(np.square(x[: n * FRAME].astype(np.float64)).reshape(n, FRAME), axis=1)
    top = float(power.max())
    if top <= 0.0:
        return 0, x.size
    loud = np.flatnonzero(power >= top * 10.0 ** (-floor_db / 10.0))
    return int(loud[0]) * FRAME, int(loud[-1] + 1) * FRAME


def snr_floor(progress: float, start: float = SNR_START_DB, end: float = SNR_FLOOR_DB) -> float:
    """The lowest ratio drawn at `progress` (0..1) of the run: from `start` down to `end`,
    reached halfway, then held."""
    return start + (end - start) * min(1.0, max(0.0, 2.0 * progress))


def _faded(x: np.ndarray) -> np.ndarray:
    ramp = min(FADE, x.size // 2)
    if ramp:
        w = np.linspace(0.0, 1.0, ramp, dtype=np.float32)
        x = x.copy()
        x[:ramp] *= w
        x[-ramp:] *= w[::-1]
    return x


def _scaled(bg: np.ndarray, fg: np.ndarray, snr_db: float) -> np.ndarray:
    level = active_rms(bg)
    if level <= 0.0:
        return np.zeros_like(bg)
    return (bg * np.float32(active_rms(fg) / level / 10.0 ** (snr_db / 20.0))).astype(np.float32)


def continuation(
    fg: np.ndarray, words: np.ndarray, rng: np.random.Generator, snr_db: float
) -> np.ndarray:
    """`fg` with `words` (another clip of the same speaker) spoken right after its active
    span, or right before it, in the room the window leaves: a sentence in one breath."""
    start, end = active_span(fg)
    w0, w1 = active_span(words)
    speech = _faded(words[w0:w1])
    gap = int(rng.uniform(*GAP_S) * SAMPLE_RATE)
    out = fg.astype(np.float32).copy()
    scaled = _scaled(speech, fg[start:end], snr_db)
    if rng.random() < 0.7 and end + gap < fg.size:  # mostly the command after the phrase
        at = end + gap
        piece = scaled[: fg.size - at]
        out[at : at + piece.size] += piece
    elif start - gap > 0:
        at = start - gap
        piece = scaled[max(0, scaled.size - at) :]
        out[at - piece.size : at] += piece
    return out


def around(fg: np.ndarray, bg: np.ndarray, placement: str, snr_db: float) -> np.ndarray:
    """`fg` with the unit-level stretch `bg` (same length) under it: over the whole window,
    or only before, after, or outside (both) its active span, `MARGIN_S` clear of it."""
    start, end = active_span(fg)
    margin = int(MARGIN_S * SAMPLE_RATE)
    mask = np.zeros(fg.size, dtype=np.float32)
    if placement == "over":
        mask[:] = 1.0
    if placement in ("before", "outside"):
        mask[: max(0, start - margin)] = 1.0
    if placement in ("after", "outside"):
        mask[min(fg.size, end + margin) :] = 1.0
    if not mask.any():
        return fg.astype(np.float32)
    edges = np.flatnonzero(np.diff(np.concatenate([[0.0], mask, [0.0]])))
    shaped = np.zeros_like(mask)
    for a, b in zip(edges[::2], edges[1::2], strict=True):
        shaped[a:b] = _faded(np.ones(b - a, dtype=np.float32))
    # The ratio is the foreground's active level over the background's while it plays.
    return (fg + _scaled(bg, fg[start:end], snr_db) * shaped).astype(np.float32)


@dataclass(frozen=True)
class ContextSpeech:
    """Draws one context for a window: `same_speaker(rng)` gives another clip of the
    window's speaker (None when it has none), `others(rng, n)` a unit-level stretch of a
    talker or babble."""

    same_speaker: Callable[[np.random.Generator], np.ndarray | None]
    others: Callable[[np.random.Generator, int], np.ndarray]

    def apply(
        self, fg: np.ndarray, rng: np.random.Generator, floor_db: float, over: bool = True
    ) -> np.ndarray:
        """`fg` with speech beside or under it at a ratio in [floor_db, 15] dB; with `over`
        False, speech drawn to go over the whole window goes outside the foreground instead
        (the same draws, so every other window of a run is unchanged)."""
        placement = PLACEMENTS[int(rng.choice(len(PLACEMENTS), p=PLACEMENT_SHARES))]
        if placement == "over" and not over:
            placement = "outside"
        snr = float(rng.uniform(floor_db, SNR_TOP_DB))
        if placement == "same_speaker":
            words = self.same_speaker(rng)
            if words is not None:
                # The same voice goes on at about its own level, within 6 dB.
                return continuation(fg, words, rng, float(rng.uniform(-6.0, 6.0)))
            placement = "outside"
        return around(fg, self.others(rng, fg.size), placement, snr)
