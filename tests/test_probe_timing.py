"""The timing probe: where it splits an utterance, how it re-times it, and its table."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from wakefl.tools.corpus.word_timing import first_word_end, retime
from wakefl.tools.evaluation.probe_timing import TIMINGS, main, parse_voice


def _two_words(sr: int = 16000) -> np.ndarray:
    t = np.arange(int(0.25 * sr)) / sr
    word = np.sin(2 * np.pi * 220 * t) * np.hanning(t.size)
    gap = np.zeros(int(0.08 * sr))
    return np.concatenate([word, gap, 0.7 * word, word])


def test_the_split_falls_in_the_pause_and_retiming_scales_each_side() -> None:
    wave = _two_words()
    split = first_word_end(wave)
    assert 4000 <= split <= 4000 + 1280  # inside the 80 ms gap after the 250 ms word
    assert np.array_equal(retime(wave, split, 1.0, 1.0), wave)
    for first, rest in ((0.6, 1.0), (1.0, 1.4)):
        out = retime(wave, split, first, rest)
        expect = split * first + (wave.size - split) * rest
        assert abs(out.size - expect) <= 2 * 512  # the phase vocoder's hop rounding


def test_a_voice_is_engine_and_name_with_optional_rate_and_pitch() -> None:
    from wakefl.errors import ConfigError

    v = parse_voice("pico:en-US:120:90")
    assert (v.engine, v.voice, v.rate, v.pitch) == ("pico", "en-US", 120, 90)
    assert parse_voice("espeak-ng:en-us").rate == 100
    with pytest.raises(ConfigError, match="engine:voice"):
        parse_voice("espeak-ng")


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng")
def test_the_probe_scores_every_timing_of_both_spellings(capsys) -> None:
    from wakefl.models.kws_cnn.pretrained import pretrained_path

    assert (
        main(["--weights", str(pretrained_path("small")), "--voices", "espeak-ng:en-us:160:50"])
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.split() for line in lines[1:]]
    assert [r[1:3] for r in rows] == [["hey", "nova"], ["hey,", "nova"]]
    scores = np.array([[float(x) for x in r[3:]] for r in rows])
    assert scores.shape == (2, len(TIMINGS) + 1) and ((scores >= 0) & (scores <= 1)).all()
    assert scores[:, 0].min() > 0.5  # the shipped model accepts the phrase as synthesized
    # espeak-ng runs "hey nova" together: there is no pause to cut, so the last column
    # scores the same audio (over other faint noise) as the first.
    assert abs(scores[0, -1] - scores[0, 0]) < 0.02
