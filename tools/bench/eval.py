"""Benchmark of stream scoring in `wakefl eval`: the time to run one negative stream through
the streaming detector for FA per hour, against the model's raw batched inference on the
same windows, measured in the same run.

    .venv/bin/python tools/bench/eval.py [--minutes 10] [--width 1.0] [--batch 64]

Three timings on one stream (music and room tone, written to WAV and decoded back):
* raw: `scorer.score` on the stream's windows, pre-cut into contiguous batches: the floor;
* before: the previous evaluation path, the streaming detector fed the whole stream with a
  cache of window scores keyed by a hash of each window, run at the device type's and the
  pooled threshold (as `wakefl eval` did for every stream);
* after: `stream_posteriors` (windows cut from the stream and scored in batches, the
  detector's posteriors bit for bit) once, then the events at both thresholds.
The stream is timed in pieces, each by all three paths in a rotating order, so that
the load of a shared machine hits them alike. Timings are scaled to one hour of stream; the model is an untrained one of `--width`,
exported to ONNX and run by onnxruntime on one thread, as `wakefl eval` does.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402


class _HashCachedScorer:
    """The score cache of the previous evaluation path, kept here to time it: every
    window's score keyed by a hash of its samples."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sample_rate = inner.sample_rate
        self.window_samples = inner.window_samples
        self._cache: dict[bytes, float] = {}

    def score(self, windows: np.ndarray) -> np.ndarray:
        w = np.ascontiguousarray(windows, dtype=np.float32)
        keys = [hashlib.sha1(row.tobytes()).digest() for row in w]
        todo = [i for i, k in enumerate(keys) if k not in self._cache]
        if todo:
            fresh = np.asarray(self.inner.score(w[todo]), dtype=np.float64).reshape(-1)
            for i, s in zip(todo, fresh, strict=True):
                self._cache[keys[i]] = float(s)
        return np.array([self._cache[k] for k in keys], dtype=np.float32)


def _stream(seconds: float, folder: Path) -> np.ndarray:
    import soundfile as sf

    from wakefl.edge_runtime import load_audio
    from wakefl.tools.acoustics.background_sounds import ambient_noise, music_like

    rng = np.random.default_rng(0)
    n = int(seconds * 16000)
    x = 0.1 * music_like(rng, n) + 0.02 * ambient_noise(rng, n, 1.0)
    sf.write(folder / "stream.wav", np.clip(x, -1, 1).astype(np.float32), 16000, subtype="PCM_16")
    return load_audio(folder / "stream.wav", 16000)


def _model(width: float, folder: Path) -> Path:
    import torch

    from wakefl.models.kws_cnn import KwsCnn, ModelConfig, export_onnx

    torch.manual_seed(0)
    return export_onnx(KwsCnn(ModelConfig(width=width)).eval(), folder / "model.onnx")


def _time_raw(scorer: Any, wave: np.ndarray, hop: int, batch: int) -> tuple[float, int]:
    from numpy.lib.stride_tricks import sliding_window_view

    view = sliding_window_view(wave, scorer.window_samples)[::hop]
    total = 0.0
    for s in range(0, len(view), batch):
        chunk = np.ascontiguousarray(view[s : s + batch])  # cut outside the timed call
        t0 = time.perf_counter()
        scorer.score(chunk)
        total += time.perf_counter() - t0
    return total, len(view)


def _time_before(
    scorer: Any, wave: np.ndarray, thresholds: tuple[float, ...]
) -> tuple[float, list]:
    from wakefl.edge_runtime import detect_audio

    t0 = time.perf_counter()
    cached = _HashCachedScorer(scorer)
    events = [
        [e.time_s for e in detect_audio(cached, wave, hop_s=0.1, threshold=t).events]
        for t in thresholds
    ]
    return time.perf_counter() - t0, events


def _time_after(
    scorer: Any, wave: np.ndarray, thresholds: tuple[float, ...], batch: int
) -> tuple[float, list]:
    from wakefl.tools.evaluation.model_scoring import detection_times, stream_posteriors

    t0 = time.perf_counter()
    post = stream_posteriors(scorer, wave, hop_s=0.1, batch=batch)
    events = [detection_times(post, t) for t in thresholds]
    return time.perf_counter() - t0, events


def run(minutes: float, width: float, batch: int, rounds: int = 5) -> dict[str, float]:
    """The stream is cut into `rounds` pieces; each piece is timed by all three paths in a
    rotating order, so a load that drifts on a shared machine hits them alike."""
    from wakefl.tools.evaluation.model_scoring import load_scorer

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        wave = _stream(minutes * 60.0, folder)
        scorer = load_scorer(_model(width, folder))
    scorer.score(np.zeros((2, scorer.window_samples), np.float32))  # session warm-up
    thresholds = (0.5, 0.6)  # a device type's and the pooled operating point
    totals = {"raw": 0.0, "before": 0.0, "after": 0.0}
    n_windows = 0
    for i, piece in enumerate(np.array_split(wave, rounds)):
        paths = ["raw", "before", "after"]
        for name in paths[i % 3 :] + paths[: i % 3]:
            if name == "raw":
                seconds, n = _time_raw(scorer, piece, 1600, batch)
                n_windows += n
            elif name == "before":
                seconds, before = _time_before(scorer, piece, thresholds)
            else:
                seconds, after = _time_after(scorer, piece, thresholds, batch)
            totals[name] += seconds
        if after != before:
            raise SystemExit("the batched path's events differ from the streaming detector's")
    scale = 60.0 / minutes
    return {
        "minutes": minutes,
        "windows": n_windows,
        **{f"{k}_s": v for k, v in totals.items()},
        **{f"{k}_1h_s": v * scale for k, v in totals.items()},
        "after_over_raw": totals["after"] / totals["raw"],
        "before_over_raw": totals["before"] / totals["raw"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--minutes", type=float, default=10.0, help="stream length timed (scaled to 1 h)"
    )
    p.add_argument("--width", type=float, default=1.0, help="model width (1.0: the full model)")
    p.add_argument(
        "--batch", type=int, default=64, help="windows per scoring batch (wakefl eval's default)"
    )
    p.add_argument("--rounds", type=int, default=5, help="pieces the stream is timed in")
    args = p.parse_args(argv)
    r = run(args.minutes, args.width, args.batch, args.rounds)
    print(
        f"stream {r['minutes']:g} min ({r['windows']} windows at hop 0.1 s), width {args.width} "
        f"ONNX model, 1 thread; times scaled to a 1-hour stream:"
    )
    print(f"  raw batched inference   {r['raw_1h_s']:8.1f} s/h   ({r['raw_s']:.1f} s measured)")
    print(
        f"  before (detector+cache) {r['before_1h_s']:8.1f} s/h   ({r['before_s']:.1f} s measured)  "
        f"{r['before_over_raw']:.2f}x raw"
    )
    print(
        f"  after (batched windows) {r['after_1h_s']:8.1f} s/h   ({r['after_s']:.1f} s measured)  "
        f"{r['after_over_raw']:.2f}x raw (target <= 1.5x); events identical: yes"
    )
    return 0


if __name__ == "__main__":
    from wakefl.tools.script_errors import run_script

    raise SystemExit(run_script(main, __file__))
