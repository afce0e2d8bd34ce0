"""The detector's firing rule (edge_runtime/detection_rule.py) as table tests, and every user
of it counting the same events as the streaming detector at hops of 0.1, 0.2 and 0.3 s: the
offline scorer of `wakefl eval`, the training validation and the detection benchmark."""

from __future__ import annotations

import numpy as np
import pytest

from wakefl.edge_runtime import detect_audio
from wakefl.edge_runtime.detection_rule import (
    DEFAULT_REFRACTORY_S,
    FiringState,
    count_events,
    event_indices,
    refractory_hops,
    smoothed,
    stream_windows,
)

SR, WINDOW = 16000, 8000


@pytest.mark.parametrize(
    ("refractory_s", "hop_s", "hops"),
    [(1.0, 0.1, 10), (1.0, 0.2, 5), (1.0, 0.3, 4), (1.0, 0.15, 7), (0.0, 0.1, 0), (0.25, 0.1, 3)],
)
def test_the_refractory_period_is_the_whole_hops_that_cover_it(refractory_s, hop_s, hops):
    assert refractory_hops(refractory_s, hop_s, SR) == hops


@pytest.mark.parametrize(
    ("scores", "threshold", "refractory", "events"),
    [
        ([0.1, 0.6, 0.7, 0.2, 0.9], 0.5, 2, [1, 4]),
        ([0.1, 0.6, 0.7, 0.2, 0.9], 0.5, 3, [1, 4]),
        ([0.1, 0.6, 0.7, 0.2, 0.9], 0.5, 4, [1]),
        ([0.1, 0.6, 0.7, 0.2, 0.9], 0.5, 0, [1, 2, 4]),
        ([0.5, 0.5], 0.5, 1, [0, 1]),  # at the threshold fires
        ([0.4, 0.49], 0.5, 1, []),
    ],
)
def test_events_fire_at_the_threshold_outside_the_refractory_period(
    scores, threshold, refractory, events
):
    assert event_indices(np.array(scores), threshold, refractory) == events
    assert count_events(np.array(scores), threshold, refractory) == len(events)


def test_the_moving_average_takes_fewer_terms_at_the_start():
    assert np.allclose(smoothed(np.array([0.3, 0.6, 0.9, 0.0]), 3), [0.3, 0.45, 0.6, 0.5])
    assert np.array_equal(smoothed(np.array([0.3, 0.6]), 1), [0.3, 0.6])


def test_the_stream_state_fires_like_the_array_rule():
    raw = np.random.default_rng(1).random(200)
    state = FiringState(threshold=0.7, smoothing=3, refractory=4)
    steps = [state.step(r) for r in raw]
    assert np.array_equal([s for s, _ in steps], smoothed(raw, 3))  # bit for bit
    assert [i for i, (_, f) in enumerate(steps) if f] == event_indices(smoothed(raw, 3), 0.7, 4)


class PeakScorer:
    """A posterior from the window's loudest sample, standing in for a model: what is
    checked is where windows fall and how their posteriors become events."""

    sample_rate, window_samples = SR, WINDOW

    def score(self, windows: np.ndarray) -> np.ndarray:
        return np.clip(np.abs(windows).max(axis=1), 0, 1).astype(np.float64)


def _clicks(seconds: float = 30.0) -> np.ndarray:
    """Clicks about a second apart, some closer, some further: refractory periods of 3 and
    4 hops of 0.3 s count them differently."""
    rng = np.random.default_rng(7)
    x = np.zeros(int(seconds * SR), dtype=np.float32)
    t = 1.0
    while t < seconds - 1:
        x[int(t * SR)] = rng.uniform(0.4, 1.0)
        t += rng.uniform(0.55, 1.4)
    return x


@pytest.mark.parametrize("hop_s", [0.1, 0.2, 0.3])
def test_every_user_counts_the_streaming_detectors_events(hop_s):
    from wakefl.tools.bench.detection_scoring import SplitScores, lowest_threshold
    from wakefl.tools.evaluation.model_scoring import detection_times, stream_posteriors
    from wakefl.tools.training.validation import threshold_for_fa

    wave, scorer = _clicks(), PeakScorer()
    hops = refractory_hops(DEFAULT_REFRACTORY_S, hop_s, SR)
    raw = scorer.score(stream_windows(wave, WINDOW, int(round(hop_s * SR))))
    post = stream_posteriors(scorer, wave, hop_s=hop_s, smoothing=3)
    for thr in (0.25, 0.4, 0.6):
        streaming = detect_audio(scorer, wave, hop_s=hop_s, threshold=thr, smoothing=3).events
        assert len(streaming) > (10 if thr == 0.25 else 0)
        assert count_events(smoothed(raw, 3), thr, hops) == len(streaming)  # training, bench
        assert detection_times(post, thr) == pytest.approx([e.time_s for e in streaming])
    # The thresholds training validation and the benchmark choose for one false accept in
    # the stream: the streaming detector raises at most that one there.
    hours = wave.size / SR / 3600
    bench = SplitScores(np.array([0.9]), np.array([0.1]), [raw], hours, hop_s, 3)
    for thr in (
        lowest_threshold([bench], 1 / hours),
        threshold_for_fa([smoothed(raw, 3)], hours, 1 / hours, hops),
    ):
        assert (
            len(
                detect_audio(scorer, wave, hop_s=hop_s, threshold=min(thr, 1.0), smoothing=3).events
            )
            <= 1
        )


def test_a_refractory_period_rounded_down_would_count_more_events():
    """The disagreement this rule removes: 3 hops of 0.3 s is shorter than the 1 s the
    detector waits."""
    wave, scorer = _clicks(), PeakScorer()
    sc = smoothed(scorer.score(stream_windows(wave, WINDOW, int(0.3 * SR))), 3)
    assert count_events(sc, 0.5, 3) > count_events(sc, 0.5, refractory_hops(1.0, 0.3, SR))
