"""The detectors the side-by-side benchmark (`wakefl.tools.bench.peers`) streams audio
through: wakefl's ONNX model through the edge runtime, and openWakeWord's and microWakeWord's
own streaming paths ("hey jarvis"), each giving one `ScoreTrack` per stream."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from wakefl.errors import ConfigError

SAMPLE_RATE = 16000
PEER_MODEL = "hey_jarvis"
MISSING_EXTRA = (
    "openWakeWord and microWakeWord are not installed: pip install -e '.[peers]' "
    "(pyopen-wakeword, pymicro-wakeword, pymicro-features)"
)


@dataclass(frozen=True)
class ScoreTrack:
    """A detector's scores over one stream: `times_s[i]` is how much audio it had heard
    when it gave `scores[i]`."""

    times_s: np.ndarray
    scores: np.ndarray
    hop_s: float


class Detector(Protocol):
    name: str
    threshold: float
    hop_s: float

    def track(self, audio: np.ndarray) -> ScoreTrack:
        """Scores of a stream of int16 samples at 16 kHz, from a fresh streaming state."""
        ...


def _chunks(audio: np.ndarray, size: int) -> Iterator[tuple[int, np.ndarray]]:
    """(samples heard after the chunk, chunk) over `audio` in `size`-sample chunks."""
    for start in range(0, audio.size, size):
        chunk = audio[start : start + size]
        yield start + chunk.size, chunk


def _as_track(times: list[float], scores: list[float], hop_s: float) -> ScoreTrack:
    return ScoreTrack(np.asarray(times, np.float64), np.asarray(scores, np.float64), hop_s)


class WakeflDetector:
    """A wakefl ONNX model through the edge runtime's streaming detector; the score is its
    smoothed posterior, as it fires on."""

    def __init__(
        self, onnx_path: Path, threshold: float, hop_s: float, smoothing: int, name: str
    ) -> None:
        from wakefl.edge_runtime import OnnxScorer

        self.scorer = OnnxScorer(onnx_path, threads=1)
        self.name, self.threshold = name, threshold
        self.hop_s, self.smoothing = hop_s, smoothing

    def track(self, audio: np.ndarray) -> ScoreTrack:
        from wakefl.edge_runtime import StreamingDetector

        det = StreamingDetector(
            self.scorer, hop_s=self.hop_s, threshold=self.threshold, smoothing=self.smoothing
        )
        times: list[float] = []
        scores: list[float] = []
        for _, chunk in _chunks(audio, 10 * SAMPLE_RATE):
            posteriors, _ = det.feed(chunk)
            times += [t for t, _, _ in posteriors]
            scores += [s for _, _, s in posteriors]
        return _as_track(times, scores, det.hop_s)


class OpenWakeWordDetector:
    """openWakeWord's streaming path, fed its own 80 ms chunk at a time: each chunk gives one
    mel step, one embedding and (once 16 embeddings are in) one probability."""

    CHUNK = 1280

    def __init__(self) -> None:
        _require_peers()
        self.name, self.threshold, self.hop_s = f"openWakeWord {PEER_MODEL}", 0.5, 0.08

    def track(self, audio: np.ndarray) -> ScoreTrack:
        from pyopen_wakeword import Model, OpenWakeWord, OpenWakeWordFeatures

        features = OpenWakeWordFeatures.from_builtin()
        model = OpenWakeWord.from_builtin(Model.HEY_JARVIS)
        times: list[float] = []
        scores: list[float] = []
        # Whole chunks only: a shorter last one would shift its mel steps off the 80 ms grid.
        whole = audio[: audio.size // self.CHUNK * self.CHUNK]
        for heard, chunk in _chunks(whole, self.CHUNK):
            for emb in features.process_streaming(chunk.tobytes()):
                for prob in model.process_streaming(emb):
                    times.append(heard / SAMPLE_RATE)
                    scores.append(float(prob))
        return _as_track(times, scores, self.hop_s)


class MicroWakeWordDetector:
    """microWakeWord's streaming path, fed 10 ms at a time (one feature frame each); its
    model runs on every `stride`-th frame, and the score is the mean of the last
    `sliding_window_size` probabilities, the value its cutoff applies to."""

    CHUNK = 160

    def __init__(self) -> None:
        _require_peers()
        from pymicro_wakeword import MicroWakeWord, Model

        probe = MicroWakeWord.from_builtin(Model.HEY_JARVIS)
        self.name = f"microWakeWord {PEER_MODEL}"
        self.threshold = float(probe.probability_cutoff)
        self.stride = int(probe.stride)
        self.hop_s = self.stride * self.CHUNK / SAMPLE_RATE

    def track(self, audio: np.ndarray) -> ScoreTrack:
        from pymicro_wakeword import MicroWakeWord, MicroWakeWordFeatures, Model

        features = MicroWakeWordFeatures()
        model = MicroWakeWord.from_builtin(Model.HEY_JARVIS)
        times: list[float] = []
        scores: list[float] = []
        frames = 0
        for heard, chunk in _chunks(audio, self.CHUNK):
            for feat in features.process_streaming(chunk.tobytes()):
                prob = model.process_streaming_prob(feat)
                frames += 1
                # Between inferences it answers 0.0 without running the model: not a score.
                if prob is not None and frames % self.stride == 0:
                    times.append(heard / SAMPLE_RATE)
                    scores.append(float(prob))
        return _as_track(times, scores, self.hop_s)


def _require_peers() -> None:
    try:
        import pymicro_features  # noqa: F401
        import pymicro_wakeword  # noqa: F401
        import pyopen_wakeword  # noqa: F401
    except ImportError:
        raise ConfigError(MISSING_EXTRA) from None


def peers_available() -> bool:
    try:
        _require_peers()
    except ConfigError:
        return False
    return True
