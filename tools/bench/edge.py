"""Edge benchmark: per-window latency of torch eager, onnxruntime fp32 and onnxruntime
int8 (batch 1, 1 thread), the streaming detector's real-time factor and CPU share at the
default hop, model sizes on disk, int8-vs-fp32 decision agreement, and, for trained weights
with an operating-point card, the int8 detector's detection delay after "hey nova" (espeak-ng
voices) at hop 0.1 s and 0.2 s.

    .venv/bin/python tools/bench/edge.py [--width 1.0 | --weights W.safetensors]

`--layouts ARCH ARCH ...` instead compares the int8 graphs of model layouts (`--arch` of
`wakefl model pretrain`) at `--width`: the cost does not depend on the weights, so each is
an untrained model; their windows are timed in turns, the fastest of several rounds kept,
so that another process's load moves every layout alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from wakefl.edge_runtime.gate_rule import DEFAULT_GATE_THRESHOLD  # noqa: E402

SENTENCES = (
    "hey nova",
    "turn on the kitchen lights",
    "hey nova, what is the weather tomorrow",
    "set a timer for ten minutes",
    "play some music in the living room",
    "hey nova stop",
)


def bench_audio(seconds: float, sample_rate: int, workdir: Path) -> np.ndarray:
    """Speech from espeak-ng with noisy pauses, looped to `seconds`; noise and tones when
    espeak-ng is missing."""
    from wakefl.edge_runtime import load_audio

    rng = np.random.default_rng(0)
    parts: list[np.ndarray] = []
    if shutil.which("espeak-ng"):
        for i, text in enumerate(SENTENCES):
            p = workdir / f"s{i}.wav"
            subprocess.run(["espeak-ng", "-w", str(p), text], check=True, capture_output=True)
            parts += [
                load_audio(p, sample_rate),
                (0.01 * rng.standard_normal(int(0.7 * sample_rate))).astype(np.float32),
            ]
    else:
        t = np.arange(sample_rate) / sample_rate
        parts = [
            (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32),
            (0.02 * rng.standard_normal(sample_rate)).astype(np.float32),
        ]
    one = np.concatenate(parts)
    reps = int(np.ceil(seconds * sample_rate / one.size))
    return np.tile(one, reps)[: int(seconds * sample_rate)]


DELAY_VOICES = ("en-us", "en-gb-x-rp", "en-gb-scotland", "en-029", "en-gb-x-gbclan", "en")
DELAY_RATES = (140, 175, 210)
# (hop s, smoothing): the shipped detector, and the larger hop whose moving average spans
# the same 0.2 s of window ends, and that hop without smoothing.
DELAY_CONFIGS = ((0.1, 3), (0.2, 2), (0.2, 1))


def speech_end(wave: np.ndarray, sample_rate: int, frame_s: float = 0.01) -> int:
    """The sample where speech ends: the end of the last 10 ms frame whose RMS is above
    10% of the loudest frame's (espeak-ng pads its output with near-silence)."""
    n = int(frame_s * sample_rate)
    frames = wave[: wave.size // n * n].reshape(-1, n)
    rms = np.sqrt(np.mean(frames.astype(np.float64) ** 2, axis=1))
    loud = np.flatnonzero(rms > 0.1 * rms.max())
    return int((loud[-1] + 1) * n)


def delay_streams(sample_rate: int, workdir: Path) -> list[tuple[np.ndarray, int, int]]:
    """(stream, phrase start, phrase end) for "hey nova" in each espeak-ng voice and rate,
    each between 2 s and 2.5 s of low noise; empty without espeak-ng."""
    from wakefl.edge_runtime import load_audio

    if not shutil.which("espeak-ng"):
        return []
    rng = np.random.default_rng(1)
    out = []
    for voice in DELAY_VOICES:
        for rate in DELAY_RATES:
            p = workdir / f"delay-{voice}-{rate}.wav"
            subprocess.run(
                ["espeak-ng", "-v", voice, "-s", str(rate), "-w", str(p), "hey nova"],
                check=True,
                capture_output=True,
            )
            utt = load_audio(p, sample_rate)
            utt = 0.5 * utt / max(1e-6, float(np.abs(utt).max()))
            pre, post = int(2.0 * sample_rate), int(2.5 * sample_rate)
            noise = 0.005 * rng.standard_normal(pre + utt.size + post)
            stream = noise.astype(np.float32)
            stream[pre : pre + utt.size] += utt
            out.append((stream, pre, pre + speech_end(utt, sample_rate)))
    return out


def detection_delay(
    scorer: Any,
    streams: list,
    threshold: float,
    hop_s: float,
    smoothing: int,
    gate: Any = None,
) -> dict[str, Any]:
    """Share of the phrases detected and the delay from the end of the phrase's speech to
    the detection event, streaming 10 ms chunks through the detector at (hop, smoothing)
    (two-stage with a `gate`)."""
    from wakefl.edge_runtime import StreamingDetector

    delays = []
    for stream, start, end in streams:
        det = StreamingDetector(
            scorer, hop_s=hop_s, threshold=threshold, smoothing=smoothing, gate=gate
        )
        chunk = int(0.01 * scorer.sample_rate)
        events = [e for i in range(0, stream.size, chunk) for e in det.push(stream[i : i + chunk])]
        hits = [e.time_s for e in events if e.time_s * scorer.sample_rate >= start]
        if hits:
            delays.append(hits[0] - end / scorer.sample_rate)
    d = np.array(delays)
    return {
        "hop_s": hop_s,
        "smoothing": smoothing,
        "phrases": len(streams),
        "detected": len(delays),
        "delay_median_ms": float(np.median(d) * 1e3) if d.size else None,
        "delay_p90_ms": float(np.percentile(d, 90) * 1e3) if d.size else None,
        "delay_max_ms": float(d.max() * 1e3) if d.size else None,
    }


def latency_ms(fn, windows: np.ndarray, n: int, label: str) -> dict[str, float]:
    for w in windows[:5]:
        fn(w[None])
    times = []
    for i in tqdm(range(n), desc=label, leave=False, file=sys.stderr):
        w = windows[i % len(windows)][None]
        t0 = time.perf_counter()
        fn(w)
        times.append(time.perf_counter() - t0)
    ms = np.array(times) * 1e3
    return {"median_ms": float(np.median(ms)), "p95_ms": float(np.percentile(ms, 95))}


def stream_cost(
    scorer, audio: np.ndarray, hop_s: float, chunk_s: float = 0.01, gate: Any = None
) -> dict:
    from wakefl.edge_runtime import StreamingDetector

    det = StreamingDetector(scorer, hop_s=hop_s, gate=gate)
    pcm = np.round(audio * 32767).astype(np.int16)
    chunk = int(chunk_s * scorer.sample_rate)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(0, pcm.size, chunk):
        det.push(pcm[i : i + chunk])
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    dur = audio.size / scorer.sample_rate
    out = {"audio_s": dur, "real_time_factor": wall / dur, "cpu_share_of_one_core": cpu / dur}
    if gate is not None:
        out["main_window_share"] = det.main_windows / max(1, det.windows)
    return out


def _print_summary(res: dict, width: float, hop: float) -> None:
    print(f"width {width}, {res['trainable_params']} trainable params, hop {hop} s")
    for k, v in res["size_bytes"].items():
        print(f"  size {k:12s} {v / 1e6:8.2f} MB")
    for k, v in res["latency_batch1_1thread"].items():
        print(f"  latency {k:12s} median {v['median_ms']:7.2f} ms  p95 {v['p95_ms']:7.2f} ms")
    for k, v in res["streaming"].items():
        print(
            f"  streaming {k:10s} RTF {v['real_time_factor']:.4f}  CPU "
            f"{100 * v['cpu_share_of_one_core']:.2f}% of one core ({v['audio_s']:.0f} s audio)"
        )
    st = res["streaming"]
    for ref in ("onnx_int8_wave_stft", "onnx_int8_wave_dft"):
        ratio = st["onnx_int8"]["cpu_share_of_one_core"] / st[ref]["cpu_share_of_one_core"]
        print(f"  int8 streaming CPU against {ref}: {ratio:.2f}x")
    if "onnx_int8_two_stage" in st:
        two = st["onnx_int8_two_stage"]
        ratio = two["cpu_share_of_one_core"] / st["onnx_int8"]["cpu_share_of_one_core"]
        print(
            f"  two-stage against int8 alone: {ratio:.2f}x, the main model on "
            f"{100 * two['main_window_share']:.1f} % of the windows"
        )
    delays = [("int8", d) for d in res.get("detection_delay", [])]
    if "detection_delay_two_stage" in res:
        delays.append(("two-stage int8", res["detection_delay_two_stage"]))
    for label, d in delays:
        med = d["delay_median_ms"]
        figures = (
            f"delay median {med:.0f} ms, p90 {d['delay_p90_ms']:.0f} ms, "
            f"max {d['delay_max_ms']:.0f} ms"
            if med is not None
            else "no detection"
        )
        print(
            f"  {label} detection at hop {d['hop_s']} s, smoothing {d['smoothing']}: "
            f"{d['detected']}/{d['phrases']} phrases detected, {figures}"
        )
    a = res["int8_vs_fp32"]
    print(
        f"  int8 vs fp32: decisions differ on {100 * a['decision_differs_share']:.2f}% of "
        f"{a['windows']} windows at threshold {a['threshold']:.3f}; "
        f"max |dp| {a['max_abs_prob_diff']:.4f}"
    )


def _calibration(windows: np.ndarray) -> np.ndarray:
    """Up to 32 of the streamed windows, spread over the audio: what each int8 export of
    this benchmark calibrates on."""
    return windows[:: max(1, len(windows) // 32)][:32]


def _int8_exports(model: Any, windows: np.ndarray, tmp: Path) -> tuple[Path, dict[str, Path]]:
    """The int8 export, and the references: the same int8 model taking the waveform, its
    STFT as onnxruntime's STFT operator (the export before log-mel input) or as a DFT
    convolution."""
    from wakefl.models.kws_cnn import export_onnx

    calib = _calibration(windows)
    int8 = export_onnx(model, tmp / "model_int8.onnx", int8=True, calibration_windows=calib)
    refs = {
        f: export_onnx(
            model, tmp / f"{f}_int8.onnx", int8=True, calibration_windows=calib, frontend=f
        )
        for f in ("stft", "dft")
    }
    return int8, refs


def _measure(model: Any, args: argparse.Namespace, tmp: Path, res: dict) -> None:
    """Sizes, latencies, streaming cost and int8 agreement of `model`, into `res`."""
    import torch

    from wakefl.edge_runtime import OnnxScorer
    from wakefl.models.kws_cnn import export_onnx, save_model

    cfg = model.cfg
    audio = _stream_audio(args, cfg.sample_rate, tmp)
    hop = int(args.hop * cfg.sample_rate)
    windows = np.stack(
        [
            audio[i : i + cfg.window_samples]
            for i in range(0, audio.size - cfg.window_samples + 1, hop)
        ]
    )
    print(
        f"[bench] exporting width {cfg.width} ({res['trainable_params']} params)", file=sys.stderr
    )
    st = save_model(model, tmp / "model.safetensors")
    fp32 = export_onnx(model, tmp / "model.onnx")
    int8, refs = _int8_exports(model, windows, tmp)
    res["size_bytes"] = {
        "safetensors": st.stat().st_size,
        "onnx_fp32": fp32.stat().st_size,
        "onnx_int8": int8.stat().st_size,
    }
    s32, s8 = OnnxScorer(fp32, threads=1), OnnxScorer(int8, threads=1)

    def torch_fn(w: np.ndarray) -> None:
        with torch.inference_mode():
            model.predict_proba(torch.from_numpy(w))

    res["latency_batch1_1thread"] = {
        "torch_eager": latency_ms(torch_fn, windows, args.iterations, "torch"),
        "onnx_fp32": latency_ms(s32.score, windows, args.iterations, "onnx fp32"),
        "onnx_int8": latency_ms(s8.score, windows, args.iterations, "onnx int8"),
    }
    print("[bench] streaming", file=sys.stderr)
    res["streaming"] = {
        "onnx_fp32": stream_cost(s32, audio, args.hop),
        "onnx_int8": stream_cost(s8, audio, args.hop),
        **{
            f"onnx_int8_wave_{f}": stream_cost(OnnxScorer(p, threads=1), audio, args.hop)
            for f, p in refs.items()
        },
    }
    gate = _gate(args, windows, tmp)
    if gate is not None:
        # The gate's model alone, then the two detectors over the same audio.
        res["streaming"]["onnx_int8_gate_alone"] = stream_cost(gate.scorer, audio, args.hop)
        res["streaming"]["onnx_int8_two_stage"] = stream_cost(s8, audio, args.hop, gate=gate)
    _delays(args, s8, gate, tmp, res)
    res["int8_vs_fp32"] = _agreement(s32, s8, windows, args.weights is not None)


def _stream_audio(args: argparse.Namespace, sample_rate: int, tmp: Path) -> np.ndarray:
    """What is streamed: `--stream-wav`'s first `--stream-s` seconds, or espeak-ng's sentences."""
    if args.stream_wav is None:
        return bench_audio(args.stream_s, sample_rate, tmp)
    from wakefl.edge_runtime import load_audio

    return load_audio(args.stream_wav, sample_rate)[: int(args.stream_s * sample_rate)]


def _delays(args: argparse.Namespace, s8: Any, gate: Any, tmp: Path, res: dict) -> None:
    """Detection delays at the card's threshold, for trained weights with a card."""
    from wakefl.models.kws_cnn.pretrained import card_beside

    card = None if args.weights is None else card_beside(args.weights)
    if card is None:
        return
    print("[bench] detection delay", file=sys.stderr)
    streams = delay_streams(s8.sample_rate, tmp)
    thr = float(card["threshold"])
    res["detection_delay"] = [
        detection_delay(s8, streams, thr, hop, smoothing) for hop, smoothing in DELAY_CONFIGS
    ]
    if gate is not None:
        hop, smoothing = DELAY_CONFIGS[0]
        res["detection_delay_two_stage"] = detection_delay(
            s8, streams, thr, hop, smoothing, gate=gate
        )


def _gate(args: argparse.Namespace, windows: np.ndarray, tmp: Path) -> Any:
    """The two-stage detector's gate: `--gate-weights` exported to int8 (None without)."""
    if args.gate_weights is None:
        return None
    from wakefl.edge_runtime import Gate, OnnxScorer
    from wakefl.models.kws_cnn import export_onnx, load_model

    path = export_onnx(
        load_model(args.gate_weights),
        tmp / "gate_int8.onnx",
        int8=True,
        calibration_windows=_calibration(windows),
    )
    return Gate(OnnxScorer(path, threads=1), args.gate_threshold)


def _agreement(s32: Any, s8: Any, windows: np.ndarray, trained: bool) -> dict[str, Any]:
    """How often int8 and fp32 decide alike on the benchmark's windows."""
    p32 = np.concatenate([s32.score(windows[i : i + 64]) for i in range(0, len(windows), 64)])
    p8 = np.concatenate([s8.score(windows[i : i + 64]) for i in range(0, len(windows), 64)])
    # An untrained model has no operating point; its median posterior splits the
    # windows in half, the hardest threshold for agreement.
    thr = 0.5 if trained else float(np.median(p32))
    return {
        "windows": len(p32),
        "threshold": thr,
        "decision_differs_share": float(np.mean((p32 >= thr) != (p8 >= thr))),
        "max_abs_prob_diff": float(np.abs(p32 - p8).max()),
    }


def compare_layouts(archs: list[str], width: float, hop: float, rounds: int = 40) -> list[dict]:
    """int8 milliseconds a window for each layout, the fastest of `rounds` turns of 10
    windows, and the share of one core that scoring a window every `hop` takes."""
    import onnxruntime as ort
    import torch

    from wakefl.models.kws_cnn import KwsCnn, export_onnx
    from wakefl.tools.training.settings import model_config

    sessions = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, arch in enumerate(archs):
            torch.manual_seed(0)
            model = KwsCnn(model_config(arch, width)).eval()
            path = export_onnx(model, Path(tmp) / f"layout{i}.onnx", int8=True)
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
            with torch.no_grad():
                x = model.frontend(0.1 * torch.randn(1, model.cfg.window_samples)).numpy()
            sessions.append((sess, {sess.get_inputs()[0].name: x}))
    best = [float("inf")] * len(archs)
    for _ in tqdm(range(rounds), desc="layouts", leave=False, file=sys.stderr):
        for i, (sess, feed) in enumerate(sessions):
            t0 = time.perf_counter()
            for _ in range(10):
                sess.run(None, feed)
            best[i] = min(best[i], (time.perf_counter() - t0) / 10 * 1e3)
    return [
        {"arch": a, "int8_ms_per_window": ms, "ratio": ms / best[0], "core_share": ms / 1e3 / hop}
        for a, ms in zip(archs, best, strict=True)
    ]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--width", type=float, default=1.0)
    src.add_argument("--weights", type=Path, default=None)
    ap.add_argument("--iterations", type=int, default=200, help="timed windows per runtime")
    ap.add_argument("--stream-s", type=float, default=60.0, help="seconds of streamed audio")
    ap.add_argument("--hop", type=float, default=0.1, help="detector hop (default 0.1 s)")
    ap.add_argument(
        "--stream-wav",
        type=Path,
        default=None,
        help="stream this recording (its first --stream-s seconds) instead of the espeak-ng "
        "sentences, e.g. a corpus's negative stream",
    )
    ap.add_argument(
        "--gate-weights",
        type=Path,
        default=None,
        help="also the two-stage detector with this model as its gate (int8 both): its "
        "streaming cost, the share of windows the main model scores, its detection delay",
    )
    ap.add_argument(
        "--gate-threshold",
        type=float,
        default=DEFAULT_GATE_THRESHOLD,
        help=f"the gate's threshold (default {DEFAULT_GATE_THRESHOLD})",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--layouts", nargs="+", metavar="ARCH", help="compare these layouts' int8 cost")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.layouts and args.weights is not None:
        ap.error("--layouts times untrained layouts at --width; it takes no --weights")
    if args.layouts:
        rows = compare_layouts(args.layouts, args.width, args.hop)
        for r in rows:
            print(
                f"{r['arch']:28s} int8 {r['int8_ms_per_window']:5.2f} ms a window "
                f"({r['ratio']:.2f}x the first), {100 * r['core_share']:.2f} % of a core "
                f"at hop {args.hop} s (the model alone)"
            )
        if args.json:
            print(json.dumps(rows, indent=2))
        return 0

    import torch

    from wakefl.models.kws_cnn import KwsCnn, ModelConfig, load_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = (
        load_model(args.weights)
        if args.weights is not None
        else KwsCnn(ModelConfig(width=args.width)).eval()
    )
    cfg = model.cfg
    res: dict = {
        "width": cfg.width,
        "trainable_params": model.num_trainable_params(),
        "trained_weights": args.weights is not None,
        "hop_s": args.hop,
        "cpu": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        _measure(model, args, Path(tmp), res)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        _print_summary(res, cfg.width, args.hop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
