"""The `pretrain-confusables` add-on: the main corpus's training speakers saying near-rhymes
that the main corpus did not give them, as training clips only."""

from __future__ import annotations

from dataclasses import replace

import pytest

from wakefl.errors import ConfigError
from wakefl.tools.corpus.plan import (
    PROFILES,
    addon_confusables,
    clip_recipes,
    near_rhymes,
    texts_for,
)
from wakefl.tools.corpus.speakers import make_speakers


@pytest.mark.parametrize("base", ["pretrain", "pretrain-micro"])
def test_the_add_on_keeps_the_speakers_and_pairs_them_with_new_near_rhymes(base: str) -> None:
    addon = PROFILES["pretrain-confusables" + base.removeprefix("pretrain")]
    main = make_speakers(0, PROFILES[base], "hey nova")
    new = make_speakers(0, addon, "hey nova")
    # Same voices, ids and splits: a held-out speaker of the main corpus stays held out.
    assert [(s.speaker_id, s.voice, s.split, s.others) for s in main] == [
        (s.speaker_id, s.voice, s.split, s.others) for s in new
    ]
    pool = set(texts_for(addon, "hey nova")[0])
    for old, s in zip(main, new, strict=True):
        assert len(s.confusables) == addon.new_confusables
        assert set(s.confusables) <= pool and not set(s.confusables) & set(old.confusables)
    # Spread over the pool, not one draw repeated for everyone.
    assert len({s.confusables for s in new}) > len(new) // 2
    recipes = clip_recipes(0 + addon.draw_offset, addon)
    assert recipes and {(r.split, r.content) for r in recipes} == {("train", "conf")}
    # Another seed draws other pairs.
    assert [s.confusables for s in make_speakers(1, addon, "hey nova")] != [
        s.confusables for s in new
    ]


def test_a_speaker_with_nearly_every_near_rhyme_gets_what_is_left() -> None:
    addon = PROFILES["pretrain-confusables-micro"]
    pool = texts_for(addon, "hey nova")[0]
    greedy = replace(addon, confusables_per_speaker=len(pool) - 1, new_confusables=5)
    assert all(len(s.confusables) == 1 for s in make_speakers(0, greedy, "hey nova"))


@pytest.mark.slow
def test_the_add_on_builds_training_clips_of_the_training_speakers(tmp_path) -> None:
    import csv

    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.corpus.build import build_corpus

    main = build_corpus(tmp_path / "main", 0, "pretrain-micro", progress=False)
    extra = build_corpus(tmp_path / "conf", 0, "pretrain-confusables-micro", progress=False)
    rows = read_manifest(extra)
    assert rows and {(r.kind, r.split, r.label) for r in rows} == {("clip", "train", 0)}
    with (main.parent / "speakers.csv").open(encoding="utf-8") as f:
        train = {r["speaker"] for r in csv.DictReader(f) if r["split"] == "train"}
    assert {r.speaker for r in rows} <= train


@pytest.mark.parametrize("phrase", ["hey jarvis", "ok google", "alexa", "Hey  Nova"])
def test_near_rhymes_are_close_to_the_phrase_and_never_hold_it(phrase: str) -> None:
    rhymes = near_rhymes(phrase)
    whole = " ".join(phrase.lower().split())
    assert rhymes and rhymes == near_rhymes(phrase)
    assert len(set(rhymes)) == len(rhymes)
    assert not [r for r in rhymes if whole in r]


def test_near_rhymes_change_the_onset_the_vowel_and_the_first_word() -> None:
    rhymes = near_rhymes("hey jarvis")
    assert {"hey marvis", "hey tarvis", "hey jorvis", "hey jar", "play jarvis"} <= set(rhymes)
    # "okay" is another spelling of "ok": a negative "okay google" would be the phrase itself
    assert "okay google" not in near_rhymes("ok google") and "play google" in near_rhymes(
        "ok google"
    )
    assert near_rhymes("") == ()


def test_the_compact_add_on_of_another_phrase_draws_near_rhymes_and_hey_nova_keeps_its_list() -> (
    None
):
    addon = PROFILES["pretrain-compact-confusables"]
    assert addon_confusables(addon, "hey nova") == texts_for(addon, "hey nova")[0]
    pool = addon_confusables(addon, "hey jarvis")
    assert set(texts_for(addon, "hey jarvis")[0]) < set(pool)
    drawn = {c for s in make_speakers(0, addon, "hey jarvis") for c in s.confusables}
    assert drawn <= set(pool) and drawn & set(near_rhymes("hey jarvis"))
    main = make_speakers(0, PROFILES["pretrain-compact"], "hey jarvis")
    assert [(s.speaker_id, s.split) for s in main] == [
        (s.speaker_id, s.split) for s in make_speakers(0, addon, "hey jarvis")
    ]


def test_a_streams_add_on_holds_test_or_val_streams_only() -> None:
    from wakefl.tools.corpus.plan import _streams_addon

    with pytest.raises(ConfigError, match="test or val"):
        _streams_addon("pretrain-micro", "x", 2, split="train")


@pytest.mark.parametrize("base", ["pretrain", "pretrain-micro"])
def test_the_every_near_rhyme_add_on_gives_each_training_speaker_the_whole_pool(base: str) -> None:
    addon = PROFILES["pretrain-nearrhymes-train" + base.removeprefix("pretrain")]
    pool = set(texts_for(addon, "hey nova")[0])
    main = make_speakers(0, PROFILES[base], "hey nova")
    new = make_speakers(0, addon, "hey nova")
    assert [(s.speaker_id, s.voice, s.split) for s in main] == [
        (s.speaker_id, s.voice, s.split) for s in new
    ]
    for old, s in zip(main, new, strict=True):
        assert not set(s.confusables) & set(old.confusables)
        assert set(s.confusables) | set(old.confusables) == pool
    recipes = clip_recipes(0 + addon.draw_offset, addon)
    assert recipes and {(r.split, r.content) for r in recipes} == {("train", "conf")}
    # Its draws are not the confusables add-on's: no room, noise or placement repeats.
    assert addon.draw_offset not in {
        p.draw_offset
        for name, p in PROFILES.items()
        if not name.startswith("pretrain-nearrhymes-train")
    }


@pytest.mark.slow
def test_the_every_near_rhyme_add_on_streams_are_training_speakers_near_rhymes(tmp_path) -> None:
    import csv

    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.corpus.build import build_corpus
    from wakefl.tools.corpus.transcripts import read_transcript

    manifest = build_corpus(tmp_path / "nr", 0, "pretrain-nearrhymes-train-micro", progress=False)
    rows = read_manifest(manifest)
    assert {(r.kind, r.split, r.label) for r in rows} == {
        ("clip", "train", 0),
        ("stream", "train", 0),
    }
    with (manifest.parent / "speakers.csv").open(encoding="utf-8") as f:
        split = {r["speaker"]: r["split"] for r in csv.DictReader(f)}
    said = [
        u for r in rows if r.kind == "stream" for u in read_transcript(manifest.parent / r.path)
    ]
    mine = {
        s.speaker_id: s
        for s in make_speakers(0, PROFILES["pretrain-nearrhymes-train-micro"], "hey nova")
    }
    assert said and {u.content for u in said} == {"conf"}
    assert {split[u.speaker] for u in said} == {"train"}
    assert all(u.text in mine[u.speaker].confusables for u in said)
