"""Where the wake phrase lies in a recording: for `wakefl corpus import` and enrolment.

The rule: a voice-activity model (Silero VAD, from the pinned `silero-vad` package, run with
onnxruntime) gives each 32 ms frame a speech probability; the 1.5 s window with the most
speech wins, then is centred on the stretch of speech around its most certain frame when
that stretch fits. A voice-activity model was trained to tell speech from doors, beeps and
dishes, which a band-energy rule cannot: a short loud beep or knock outscores a phrase on
energy. When the model hears no speech at all, a band-energy rule (`locate_speech`: where
the speech band stands out from the file's own background) decides, and the report says
so."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from wakefl.sdk.manifest import CLIP_SAMPLES, SAMPLE_RATE

VAD_PACKAGE = "silero-vad"
VAD_FRAME = 512  # samples per probability at 16 kHz (32 ms)
_VAD_CONTEXT = 64  # samples of the previous frame the model sees with each frame
SPEECH = 0.5  # probability above which a frame counts as speech
BRIDGE_S = 0.3  # pauses shorter than this stay inside one stretch of speech


def frames(wave: np.ndarray, frame: int, hop: int) -> np.ndarray:
    """Every `frame`-sample frame of `wave`, `hop` samples apart (a view)."""
    from numpy.lib.stride_tricks import sliding_window_view

    return sliding_window_view(wave, frame)[::hop]


@dataclass(frozen=True)
class PhraseLocation:
    """The start sample of the window holding the phrase, and the rule that found it."""

    start: int
    rule: str


@cache
def _vad_session() -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.inter_op_num_threads = opts.intra_op_num_threads = 1
    model = resources.files("silero_vad.data").joinpath("silero_vad.onnx")
    return ort.InferenceSession(str(model), sess_options=opts, providers=["CPUExecutionProvider"])


def speech_probability(wave: np.ndarray) -> np.ndarray:
    """Speech probability of every 32 ms frame of a 16 kHz wave (the last one zero-padded)."""
    session = _vad_session()
    x = np.concatenate([wave.astype(np.float32), np.zeros((-wave.size) % VAD_FRAME, np.float32)])
    state = np.zeros((2, 1, 128), dtype=np.float32)
    context = np.zeros(_VAD_CONTEXT, dtype=np.float32)
    sr = np.array(SAMPLE_RATE, dtype=np.int64)
    out = np.empty(x.size // VAD_FRAME)
    for i in range(out.size):
        frame = x[i * VAD_FRAME : (i + 1) * VAD_FRAME]
        prob, state = session.run(
            None, {"input": np.concatenate([context, frame])[None], "state": state, "sr": sr}
        )
        out[i] = float(np.asarray(prob).reshape(-1)[0])
        context = frame[-_VAD_CONTEXT:]
    return out


def speech_stretch(on: np.ndarray, peak: int) -> tuple[int, int] | None:
    """First and last speech frame of the stretch of `on` holding frame `peak` (pauses
    under `BRIDGE_S` bridged); None when `peak` is not speech."""
    if not on[peak]:
        return None
    bridge = max(1, int(BRIDGE_S * SAMPLE_RATE / VAD_FRAME))
    speech = np.flatnonzero(on)
    gaps = np.flatnonzero(np.diff(speech) > bridge)  # a pause this long ends a stretch
    k = int(np.searchsorted(speech, peak))
    lo = int(speech[gaps[gaps < k][-1] + 1]) if (gaps < k).any() else int(speech[0])
    hi = int(speech[gaps[gaps >= k][0]]) if (gaps >= k).any() else int(speech[-1])
    return lo, hi


def window_start(prob: np.ndarray, total: int, n: int = CLIP_SAMPLES) -> int | None:
    """Start sample of the `n`-sample window (of a `total`-sample wave) that holds the
    speech found in per-frame probabilities `prob`; None when no frame is speech. The window
    with the most speech, centred on the stretch around its most certain frame (pauses
    under `BRIDGE_S` bridged) when that stretch fits in `n`."""
    if total <= n:
        return 0
    if prob.size == 0 or prob.max() < SPEECH:
        return None
    per_window = max(1, n // VAD_FRAME)
    if prob.size > per_window:
        first = int(np.argmax(np.convolve(prob, np.ones(per_window), mode="valid")))
    else:
        first = 0
    start = first * VAD_FRAME
    stretch = speech_stretch(
        prob >= SPEECH, first + int(np.argmax(prob[first : first + per_window]))
    )
    if stretch is not None and (stretch[1] - stretch[0] + 1) * VAD_FRAME <= n:
        start = (stretch[0] + stretch[1] + 1) * VAD_FRAME // 2 - n // 2
    return int(min(max(start, 0), total - n))


def speech_activity(wave: np.ndarray, frame: int = 512, hop: int = 160) -> np.ndarray:
    """Per 10 ms frame, how far the 300-3400 Hz spectrum stands out from the file's own
    background: the mean over frequency bins of the level above the bin's median over the
    whole file (minus 6 dB, at most 30 dB). Music and alarms that go on through the file
    set their bins' median high, so they score little even when louder than the voice,
    while speech moves its energy across many bins and lights up those the background
    leaves quiet."""
    spec = (
        np.abs(np.fft.rfft(frames(wave.astype(np.float64), frame, hop) * np.hanning(frame), axis=1))
        ** 2
    )
    freqs = np.fft.rfftfreq(frame, 1.0 / SAMPLE_RATE)
    level = 10.0 * np.log10(spec[:, (freqs >= 300) & (freqs <= 3400)] + 1e-10)
    return np.clip(level - np.median(level, axis=0) - 6.0, 0.0, 30.0).mean(axis=1)


def locate_speech(wave: np.ndarray, n: int = CLIP_SAMPLES) -> int:
    """Start sample of the `n`-sample window that holds the phrase: the window with the
    most speech activity, then centred on the active stretch around its peak (frames above
    a quarter of the peak, gaps under 0.3 s bridged) when that stretch fits in `n`."""
    frame, hop = 512, 160
    if wave.size <= n:
        return 0
    act = speech_activity(wave, frame, hop)
    per_window = (n - frame) // hop + 1
    total = np.convolve(act, np.ones(per_window), mode="valid")
    first = int(np.argmax(total))
    smooth = np.convolve(act, np.ones(5) / 5, mode="same")
    peak = first + int(np.argmax(smooth[first : first + per_window]))
    on = smooth > 0.25 * smooth[peak]
    bridge = int(0.3 * SAMPLE_RATE / hop)
    lo = hi = peak
    while lo > 0 and on[max(0, lo - bridge) : lo].any():
        lo -= 1
    while hi < on.size - 1 and on[hi + 1 : hi + 1 + bridge].any():
        hi += 1
    a, b = lo * hop, hi * hop + frame
    start = (a + b) // 2 - n // 2 if b - a <= n else first * hop
    return int(min(max(start, 0), wave.size - n))


def locate_phrase(wave: np.ndarray, n: int = CLIP_SAMPLES) -> PhraseLocation:
    """Where the `n`-sample window of the phrase starts in `wave`, and by which rule."""
    from importlib.metadata import version

    start = window_start(speech_probability(wave), wave.size, n)
    if start is not None:
        return PhraseLocation(start, f"voice-activity model ({VAD_PACKAGE} {version(VAD_PACKAGE)})")
    return PhraseLocation(
        locate_speech(wave, n), "band-energy rule (the voice-activity model heard no speech)"
    )
