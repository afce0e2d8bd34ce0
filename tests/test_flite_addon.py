"""The `pretrain-flite` add-on: flite speakers drawn anew, half of them `awb`, saying the
phrase or its near-rhymes, never onto a held-out speaker of the main corpus."""

from __future__ import annotations

import numpy as np
import pytest

from wakefl.errors import ConfigError
from wakefl.tools.corpus.plan import PROFILES, clip_recipes, texts_for
from wakefl.tools.corpus.speakers import make_speakers
from wakefl.tools.corpus.speech_synthesis import Voice
from wakefl.tools.corpus.voices import FLITE_AVOID_RADIUS, flite_voices


def _near(a: Voice, b: Voice) -> bool:
    return (
        a.voice == b.voice
        and abs(a.rate - b.rate) <= FLITE_AVOID_RADIUS[0]
        and abs(a.pitch - b.pitch) <= FLITE_AVOID_RADIUS[1]
    )


@pytest.mark.parametrize("name", ["pretrain-flite", "pretrain-flite-micro"])
def test_its_speakers_are_flite_half_awb_and_away_from_the_held_out_ones(name: str) -> None:
    addon = PROFILES[name]
    speakers = make_speakers(0, addon, "hey nova")
    assert len(speakers) == addon.n_speakers
    assert {s.voice.engine for s in speakers} == {"flite"}
    awb = sum(s.voice.voice == "awb" for s in speakers)
    assert awb == (addon.n_speakers + 1) // 2
    main = make_speakers(0, PROFILES["pretrain"], "hey nova")
    held_out = [s.voice for s in main if s.split != "train" and s.voice.engine == "flite"]
    assert held_out
    assert not [s for s in speakers for h in held_out if _near(s.voice, h)]
    # Each speaker has the whole pool of near-rhymes, "play nova" among them.
    pool = set(texts_for(addon, "hey nova")[0])
    assert "play nova" in pool
    assert all(set(s.confusables) == pool for s in speakers)
    recipes = clip_recipes(0 + addon.draw_offset, addon)
    assert {r.content for r in recipes} == {"pos", "conf"}
    assert {r.split for r in recipes} == {"train", "val", "test"}


def test_the_main_corpus_flite_speakers_keep_their_prosody_ranges() -> None:
    """The add-on's voice draw shares its helper with the main corpus's: the main corpus's
    flite speakers keep the prosody range they were drawn from."""
    main = [s.voice for s in make_speakers(0, PROFILES["pretrain"], "hey nova")]
    flite = [v for v in main if v.engine == "flite"]
    assert flite and all(70 <= v.rate <= 140 for v in flite)
    assert all(150 <= v.pitch <= 260 for v in flite if v.voice == "slt")
    assert all(75 <= v.pitch <= 170 for v in flite if v.voice != "slt")


def test_a_voice_space_filled_by_held_out_speakers_is_refused() -> None:
    crowd = [Voice("flite", "awb", "", r, p) for r in range(70, 141, 4) for p in range(75, 171, 4)]
    with pytest.raises(ConfigError, match="away from the held-out"):
        flite_voices(np.random.default_rng(0), 2, crowd)


@pytest.mark.slow
def test_the_micro_add_on_builds_flite_phrases_and_near_rhymes(tmp_path) -> None:
    import csv

    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.corpus.build import build_corpus

    manifest = build_corpus(tmp_path / "flite", 0, "pretrain-flite-micro", progress=False)
    rows = read_manifest(manifest)
    assert {r.label for r in rows if r.split == "train"} == {0, 1}
    with (manifest.parent / "speakers.csv").open(encoding="utf-8") as f:
        voices = {r["speaker"]: r for r in csv.DictReader(f)}
    assert {r.speaker for r in rows} <= set(voices)
    assert all("flite" in str(v) for v in voices.values())


def test_the_near_rhyme_twin_has_the_same_speakers_saying_near_rhymes_only() -> None:
    phrases, twin = PROFILES["pretrain-flite"], PROFILES["pretrain-flite-nearrhymes"]
    assert make_speakers(0, twin, "hey nova") == make_speakers(0, phrases, "hey nova")
    recipes = clip_recipes(0 + twin.draw_offset, twin)
    assert {r.content for r in recipes} == {"conf"}
    # Beside the add-on these voices say near-rhymes more often than the phrase.
    both = recipes + clip_recipes(0 + phrases.draw_offset, phrases)
    train = [r.content for r in both if r.split == "train"]
    assert train.count("conf") > train.count("pos")
    # Rendered anew: none of the other add-ons' rooms, noise and placements.
    assert twin.draw_offset not in {p.draw_offset for p in PROFILES.values() if p is not twin}
