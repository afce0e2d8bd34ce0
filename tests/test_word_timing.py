"""Word timing: syllable boundaries, pauses, re-timing, and the corpus profile that trains
on run-together, fast-first-word phrases."""

from __future__ import annotations

import csv
import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from wakefl.tools.corpus.word_timing import (
    close_pause,
    first_word_end,
    pause_around,
    phrase_split,
    run_together,
    syllables,
)

SR = 16000


def _syllable(seconds: float, hz: float = 180.0, level: float = 1.0) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return level * np.sin(2 * np.pi * hz * t)


def _dip(seconds: float, level: float) -> np.ndarray:
    """A quieter stretch between syllables, like a nasal or a closure."""
    return _syllable(seconds, 120.0, level)


def test_syllables_count_vowel_groups() -> None:
    assert [syllables(w) for w in ("hey", "nova", "okay", "computer", "hmm")] == [1, 2, 2, 3, 1]


def test_the_first_word_ends_at_the_first_boundary_even_when_a_later_dip_is_deeper() -> None:
    # "hey" 250 ms, a shallow dip (-12 dB, like the /n/), "no" 200 ms, a deep dip (-26 dB,
    # like the /v/ closure), "va" 200 ms: the quietest frame is the /v/, the word ends at /n/.
    wave = np.concatenate(
        [_syllable(0.25), _dip(0.05, 0.25), _syllable(0.2), _dip(0.05, 0.05), _syllable(0.2)]
    )
    split = first_word_end(wave, SR, 1, 3)
    assert 0.25 * SR <= split <= 0.30 * SR
    # Counted as one syllable then one, the boundary is the more prominent dip.
    assert 0.50 * SR <= first_word_end(wave, SR, 1, 2) <= 0.55 * SR


def test_without_dips_the_boundary_falls_in_proportion_to_the_syllables() -> None:
    wave = _syllable(0.9)
    assert abs(first_word_end(wave, SR, 1, 3) - 0.3 * SR) <= 0.01 * SR
    assert first_word_end(np.zeros(SR), SR) == SR // 2  # silence: the middle, no crash


def test_a_pause_is_found_and_cut_out_with_a_crossfade() -> None:
    a, b = _syllable(0.3), _syllable(0.3, 240.0)
    wave = np.concatenate([a, np.zeros(int(0.1 * SR)), b])
    split = phrase_split(wave, "hey, you")
    start, end = pause_around(wave, split)
    assert (start, end) == (int(0.3 * SR), int(0.4 * SR))
    joined, new_split = close_pause(wave, split)
    fade = int(0.01 * SR)
    assert joined.size == wave.size - (end - start) - fade
    assert np.array_equal(joined[: start - fade], a[: start - fade])
    assert np.array_equal(joined[-(b.size - fade) :], b[fade:])
    assert abs(new_split - (start - fade // 2)) <= 1
    # No pause at the split: nothing changes.
    together = np.concatenate([a, b])
    assert pause_around(together, a.size) == (a.size, a.size)
    assert np.array_equal(close_pause(together, a.size)[0], together)


def test_run_together_drops_the_pause_and_scales_the_first_word() -> None:
    a, b = _syllable(0.3), _syllable(0.4, 240.0)
    wave = np.concatenate([a, np.zeros(int(0.15 * SR)), b])
    for first in (1.0, 0.5):
        out = run_together(wave, "hey, you", first)
        expect = (a.size - 0.005 * SR) * first + b.size + 0.005 * SR
        assert abs(out.size - expect) <= 2 * 512  # the phase vocoder's hop rounding


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _speakers(folder: Path) -> list[dict[str, str]]:
    with (folder / "speakers.csv").open(encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_the_timing_profile_has_the_main_corpus_speakers_and_only_wake_phrases(
    tmp_path: Path,
) -> None:
    from wakefl.sdk.dataset import load_clip
    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.corpus.build import build_corpus
    from wakefl.tools.corpus.plan import PROFILES

    main = build_corpus(tmp_path / "main", 0, "pretrain-micro", progress=False)
    timing = build_corpus(tmp_path / "timing", 0, "pretrain-timing-micro", progress=False)
    assert _speakers(main.parent) == _speakers(timing.parent)
    rows = read_manifest(timing)
    assert {r.label for r in rows} == {1} and {r.kind for r in rows} == {"clip"}
    assert {r.split for r in rows} == {"train", "val", "test"}
    # The same profile without the re-timing draws the same rooms, noise and placements, so
    # the re-timing is what changes its audio; and those draws are not the main corpus's.
    plain = replace(PROFILES["pretrain-timing-micro"], first_word_pace=None)
    plain_rows = read_manifest(build_corpus(tmp_path / "plain", 0, plain, progress=False))
    assert [(r.path, r.speaker, r.state) for r in plain_rows] == [
        (r.path, r.speaker, r.state) for r in rows
    ]
    differ = [
        not np.array_equal(
            load_clip(tmp_path / "plain" / r.path, 24000), load_clip(timing.parent / r.path, 24000)
        )
        for r in rows
    ]
    assert all(differ)
    main_audio = {_digest(main.parent / r.path) for r in read_manifest(main) if r.kind == "clip"}
    assert not main_audio & {_digest(tmp_path / "plain" / r.path) for r in plain_rows}


def test_a_profile_with_unknown_contents_or_an_absurd_pace_is_refused() -> None:
    from wakefl.errors import ConfigError
    from wakefl.tools.corpus.plan import PROFILES

    base = PROFILES["pretrain-timing-micro"]
    with pytest.raises(ConfigError, match="contents"):
        replace(base, contents=("pos", "music"))
    with pytest.raises(ConfigError, match="contents"):
        replace(base, contents=())
    for pace in ((0.0, 1.0), (1.0, 0.5), (0.5, float("nan"))):
        with pytest.raises(ConfigError, match="first_word_pace"):
            replace(base, first_word_pace=pace)
