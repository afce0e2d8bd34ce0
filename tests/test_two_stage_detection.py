"""The two-stage detector (edge_runtime/gate_rule.py): the gate's rule in closed form, the
streaming detector against the same rule applied offline to both models' onnxruntime
scores, bit for bit and whatever the chunking, its events a subset of the one-stage
detector's, and the benchmark's reading of it (tools/bench/detection_scoring.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from wakefl.edge_runtime import Gate, OnnxScorer, StreamingDetector, detect_audio, load_audio
from wakefl.edge_runtime.detection_rule import event_indices, refractory_hops, smoothed
from wakefl.edge_runtime.gate_rule import (
    SHUT,
    GateState,
    gate_open,
    gated_raw,
    main_scored,
    shut_closed,
)
from wakefl.errors import ConfigError
from wakefl.tools.bench.detection_scoring import SplitScores, gated_split, stream_events

SR = 16000


@pytest.mark.parametrize(
    ("gate", "hold", "opened"),
    [
        ([0, 0, 1, 0, 0, 0, 0], 0, [0, 0, 1, 0, 0, 0, 0]),
        ([0, 0, 1, 0, 0, 0, 0], 2, [0, 0, 1, 1, 1, 0, 0]),
        ([1, 0, 0, 0, 1, 0, 0], 1, [1, 1, 0, 0, 1, 1, 0]),
        ([0, 0, 0, 0, 0, 0, 1], 3, [0, 0, 0, 0, 0, 0, 1]),
    ],
)
def test_gate_opens_for_hold_hops_after_it_passed(gate, hold, opened):
    got = gate_open(np.array(gate, dtype=float) * 0.6, 0.5, hold)
    assert got.tolist() == [bool(x) for x in opened]


@pytest.mark.parametrize(
    ("opened", "smoothing", "scored"),
    [
        ([0, 0, 1, 0, 0], 1, [0, 0, 1, 0, 0]),
        ([0, 0, 1, 0, 0], 3, [1, 1, 1, 0, 0]),
        ([0, 1, 0, 0, 1], 2, [1, 1, 0, 1, 1]),
    ],
)
def test_main_model_scores_the_windows_an_open_hop_averages(opened, smoothing, scored):
    assert main_scored(np.array(opened, dtype=bool), smoothing).tolist() == [
        bool(x) for x in scored
    ]


def test_gate_state_scores_what_the_offline_rule_scores():
    """One window at a time, each skipped window scored once, when a later hop's gate
    needs it: the same set as `main_scored`."""
    rng = np.random.default_rng(0)
    g = rng.random(400) ** 4
    for hold, smoothing in ((0, 1), (2, 3), (1, 3), (3, 2)):
        state = GateState(0.5, hold, smoothing)
        scored: list[int] = []
        opened = []
        for t, x in enumerate(g):
            is_open, back = state.step(float(x))
            opened.append(is_open)
            scored += [t - b for b in back] + ([t] if is_open else [])
        want_open = gate_open(g, 0.5, hold)
        assert opened == want_open.tolist()
        assert scored == sorted(set(scored)), "a window scored twice or out of order"
        assert scored == np.flatnonzero(main_scored(want_open, smoothing)).tolist()
        assert state.scored == len(scored) and state.hops == g.size


def test_gate_refuses_bad_settings():
    for threshold in (float("nan"), -0.1, 1.5):
        with pytest.raises(ConfigError):
            Gate(object(), threshold)
    with pytest.raises(ConfigError):
        Gate(object(), 0.5, hold=-1)


@pytest.fixture(scope="module")
def gate_onnx(tmp_path_factory):
    """A second tiny model, other weights, the same log-mel input: the gate."""
    import torch

    from wakefl.models.kws_cnn import KwsCnn, ModelConfig, export_onnx

    torch.manual_seed(99)
    model = KwsCnn(ModelConfig(width=0.25)).eval()
    with torch.no_grad():
        model.head[-1].weight.mul_(40.0)
    return export_onnx(model, tmp_path_factory.mktemp("gate") / "gate.onnx")


@pytest.fixture(scope="module")
def speech(hey_nova_wav) -> np.ndarray:
    x = load_audio(hey_nova_wav, SR)
    rng = np.random.default_rng(5)
    gap = (0.01 * rng.standard_normal(SR)).astype(np.float32)
    return np.concatenate([gap, x, gap, 0.7 * x, gap, x]).astype(np.float32)


def _offline_events(main_raw, gate_raw, threshold, gate_threshold, hold, smoothing, refractory):
    opened = gate_open(gate_raw, gate_threshold, hold)
    scored = main_scored(opened, smoothing)
    scores = shut_closed(smoothed(gated_raw(main_raw, scored), smoothing), opened)
    return event_indices(scores, threshold, refractory), int(scored.sum())


def test_streaming_two_stage_detector_is_the_rule_on_both_models_scores(
    tiny_kws_onnx, gate_onnx, speech
):
    main, gate_scorer = OnnxScorer(tiny_kws_onnx), OnnxScorer(gate_onnx)
    # Each model's raw posterior at every hop, from the one-stage detector.
    main_raw = detect_audio(main, speech, threshold=0.0).raw_scores
    gate_raw = detect_audio(gate_scorer, speech, threshold=0.0).raw_scores
    threshold = float(np.quantile(smoothed(main_raw, 3), 0.6))
    gate_threshold = float(np.quantile(gate_raw, 0.7))
    refractory = refractory_hops(0.5, 0.1, SR)
    want, main_windows = _offline_events(
        main_raw, gate_raw, threshold, gate_threshold, 2, 3, refractory
    )
    one_stage = event_indices(smoothed(main_raw, 3), threshold, refractory)
    assert 1 <= len(want) < len(one_stage), "a reading where the gate changes something"
    assert 0 < main_windows < main_raw.size
    det = StreamingDetector(
        main, threshold=threshold, refractory_s=0.5, gate=Gate(gate_scorer, gate_threshold)
    )
    times = 1.5 + 0.1 * np.array(want)
    for chunk in (160, 1111, SR, speech.size):
        det.reset()
        got = []
        for i in range(0, speech.size, chunk):
            got += det.push(speech[i : i + chunk])
        np.testing.assert_allclose([e.time_s for e in got], times, atol=1e-9)
        assert det.main_windows == main_windows and det.windows == main_raw.size
    # Where it fires, its smoothed posterior is the one-stage detector's, bit for bit.
    one = smoothed(main_raw, 3)
    np.testing.assert_allclose([e.score for e in got], [one[i] for i in want], atol=1e-6)
    # Every event of the two-stage detector is one of the main model's own moments.
    assert set(want) <= set(np.flatnonzero(one >= threshold).tolist())


def test_an_always_open_gate_is_the_one_stage_detector(tiny_kws_onnx, gate_onnx, speech):
    main = OnnxScorer(tiny_kws_onnx)
    one = detect_audio(main, speech, threshold=0.0)
    threshold = float(np.quantile(one.scores, 0.7))
    a = detect_audio(main, speech, threshold=threshold)
    b = detect_audio(main, speech, threshold=threshold, gate=Gate(OnnxScorer(gate_onnx), 0.0))
    assert [(e.time_s, e.score) for e in a.events] == [(e.time_s, e.score) for e in b.events]
    assert b.extra["main_windows"] == len(one.scores)
    shut = detect_audio(main, speech, threshold=0.0, gate=Gate(OnnxScorer(gate_onnx), 1.0))
    if shut.extra["main_windows"] == 0:  # the gate never reached 1.0: nothing fires
        assert shut.events == [] and not shut.raw_scores.any()


def test_gate_must_take_the_main_models_input(tiny_kws_model, tiny_kws_onnx, tmp_path):
    from wakefl.models.kws_cnn import export_onnx

    wave_in = export_onnx(tiny_kws_model, tmp_path / "wave.onnx", frontend="dft")
    with pytest.raises(ConfigError, match="log-mel"):
        StreamingDetector(OnnxScorer(tiny_kws_onnx), gate=Gate(OnnxScorer(wave_in), 0.1))


def test_benchmark_reads_the_two_stage_detector_as_the_streaming_one():
    rng = np.random.default_rng(2)
    streams = [rng.random(3000) ** 6 for _ in range(3)]
    gates = [np.clip(s + 0.2 * rng.standard_normal(s.size), 0, 1) for s in streams]
    pos, gpos = rng.random(200) ** 0.2, rng.random(200)
    main = SplitScores(pos, rng.random(50), streams, 1.0)
    gate = SplitScores(gpos, rng.random(50), gates, 1.0)
    for g in (0.0, 0.3, 0.6):
        through, share = gated_split(main, gate, g, 2)
        for thr in (0.5, 0.7, 0.9):
            assert stream_events(through, thr) <= stream_events(main, thr)
            assert (through.pos >= thr).sum() == ((pos >= thr) & (gpos >= g)).sum()
        for s, o in zip(through.streams, through.stream_open, strict=True):
            assert (s[~o] == SHUT).all()
        if g == 0.0:
            assert share == 1.0 and stream_events(through, 0.7) == stream_events(main, 0.7)
        else:
            assert 0.0 < share < 1.0
    with pytest.raises(ConfigError):
        through.detector(0.2, 1)


def test_cli_edge_detect_with_a_gate(tiny_kws_onnx, gate_onnx, hey_nova_wav):
    run = subprocess.run(
        [sys.executable, "-m", "wakefl.tools.cli", "edge", "detect", str(hey_nova_wav)]
        + ["--model", str(tiny_kws_onnx), "--gate", str(gate_onnx), "--gate-threshold", "0.0"]
        + ["--threshold", "0.5", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["gate"]["threshold"] == 0.0 and out["gate"]["main_windows"] == out["windows"]


class _Constant:
    """A waveform-input scorer with the same posterior for every window."""

    sample_rate, window_samples = SR, SR

    def __init__(self, value: float) -> None:
        self.value = value

    def score(self, windows: np.ndarray) -> np.ndarray:
        return np.full(len(windows), self.value)


class _LoudEnd(_Constant):
    """1.0 where the window's newest 100 ms is loud, else 0: a gate that passes on a click."""

    def score(self, windows: np.ndarray) -> np.ndarray:
        return (np.abs(windows[:, -SR // 10 :]).max(axis=1) > 0.5).astype(float)


def test_two_stage_detector_fires_only_where_its_gate_is_open():
    """A main model at 0.9 everywhere, a gate that passes once: the hop after it has shut
    still averages 0.6, above a threshold of 0.5, and must not fire."""
    audio = np.zeros(4 * SR, dtype=np.float32)
    audio[2 * SR - 800 : 2 * SR] = 0.9  # the window ending at 2.0 s ends loud
    det = StreamingDetector(
        _Constant(0.9), threshold=0.5, refractory_s=0.0, gate=Gate(_LoudEnd(0.0), 0.5, hold=0)
    )
    posteriors, events = det.feed(audio)
    assert [round(e.time_s, 3) for e in events] == [2.0]
    after = [s for t, _, s in posteriors if 2.05 < t < 2.15]
    assert after and min(after) >= 0.5, "the shut hop after it averages above the threshold"
    # The two windows before the one that opened it were scored when it opened.
    assert det.main_windows == 3 and events[0].score == pytest.approx(0.9)


@pytest.mark.slow
def test_benchmark_reports_the_two_stage_detector_beside_the_main_one(
    pretrain_micro_corpus, tmp_path
):
    from wakefl.tools.bench.detection import main as bench

    out = tmp_path / "gated.json"
    argv = ["--pretrained", "small", "--corpus", str(pretrain_micro_corpus.parent)]
    argv += ["--gate-pretrained", "small", "--gate-thresholds", "0.0", "0.9", "--threads", "1"]
    assert bench([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    main = result["fp32"]["held-out speakers"]
    shut = result["gated"]["gate 0.9, hold 2"]["fp32"]["held-out speakers"]
    same = result["gated"]["gate 0.0, hold 2"]["fp32"]["held-out speakers"]
    for d in "ABCDE":
        # A gate that always passes is the main detector; one that passes on its own
        # model's confident windows only misses more and fires less.
        assert same[d]["at_shipped_threshold"] == main[d]["at_shipped_threshold"]
        assert same[d]["main_window_share"] == 1.0
        at, alone = shut[d]["at_shipped_threshold"], main[d]["at_shipped_threshold"]
        assert at["frr"] >= alone["frr"] and at["fa_per_hour"] <= alone["fa_per_hour"]
        assert shut[d]["main_window_share"] < 1.0
    hours = [main[d]["stream_hours"] for d in "ABCDE"]
    want = np.average([shut[d]["main_window_share"] for d in "ABCDE"], weights=hours)
    assert shut["_main_window_share"] == pytest.approx(want) and want < 1.0


def test_edge_benchmark_streams_the_two_stage_detector(tiny_kws_onnx, gate_onnx, speech):
    from wakefl.tools.bench.edge import stream_cost

    gate_scorer = OnnxScorer(gate_onnx)
    gate_raw = detect_audio(gate_scorer, speech, threshold=0.0).raw_scores
    g = float(np.quantile(gate_raw, 0.8))
    res = stream_cost(OnnxScorer(tiny_kws_onnx), speech, 0.1, gate=Gate(gate_scorer, g))
    want = main_scored(gate_open(gate_raw, g, 2), 3).mean()
    assert res["main_window_share"] == pytest.approx(want) and 0 < want < 1
    assert res["cpu_share_of_one_core"] > 0
