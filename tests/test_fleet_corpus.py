"""The fleet profile of hard users: each device type's own users, from voices the
pretraining corpus keeps out, deterministic per seed, with users kept out of training."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from wakefl.errors import ConfigError
from wakefl.sdk.manifest import read_manifest
from wakefl.tools.corpus.build import NEW_USERS_DIR, build_corpus
from wakefl.tools.corpus.plan import (
    PRETRAIN_VOICE_SETS,
    PROFILES,
    SPLITS,
    clip_counts,
    clip_recipes,
    stream_counts,
)
from wakefl.tools.corpus.rendering import ACOUSTICS, acoustics_named
from wakefl.tools.corpus.speakers import fleet_device_of, is_new_user, make_speakers
from wakefl.tools.corpus.voices import (
    ENGINES_UNSEEN_MBROLA,
    ENGINES_UNSEEN_RHVOICE,
    FLEET_VOICES,
    FLEET_VOICES_PER_DEVICE,
)


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_fleet_voices_are_kept_out_of_every_pretraining_profile(seed):
    fleet = set(FLEET_VOICES)
    pretraining = [name for name, p in PROFILES.items() if p.voice_set in PRETRAIN_VOICE_SETS]
    assert {"pretrain", "pretrain-micro", "pretrain-voices", "pretrain-engines"} <= set(pretraining)
    assert "pretrain-gnuspeech" in pretraining
    for name in pretraining:
        voices = {
            (s.voice.engine, s.voice.voice) for s in make_speakers(seed, PROFILES[name], "hey nova")
        }
        assert voices and not voices & fleet, name
    for name in ("fleet", "fleet-micro"):
        users = make_speakers(seed, PROFILES[name], "hey nova")
        assert {(s.voice.engine, s.voice.voice) for s in users} <= fleet
    # The held-out engines of the engines add-on are among the fleet's voices, and no
    # training speaker of that add-on uses them.
    unseen = {("rhvoice", v) for v in ENGINES_UNSEEN_RHVOICE}
    unseen |= {("mbrola", v) for v in ENGINES_UNSEEN_MBROLA}
    assert unseen <= fleet


def test_fleet_users_span_the_voices_and_engines():
    users = make_speakers(0, PROFILES["fleet"], "hey nova")
    assert {(s.voice.engine, s.voice.voice) for s in users} == set(FLEET_VOICES)
    for device in "ABCDE":
        mine = {
            (s.voice.engine, s.voice.voice)
            for s in users
            if fleet_device_of(s.speaker_id) == device and not is_new_user(s.speaker_id)
        }
        assert len(mine) == FLEET_VOICES_PER_DEVICE
        assert {"rhvoice", "mbrola"} & {engine for engine, _ in mine}


def test_fleet_plan_gives_each_device_type_its_own_users_and_other_takes():
    prof = PROFILES["fleet"]
    users = make_speakers(0, prof, "hey nova")
    assert users == make_speakers(0, prof, "hey nova")
    assert users != make_speakers(1, prof, "hey nova")
    for device in "ABCDE":
        mine = [s for s in users if fleet_device_of(s.speaker_id) == device]
        kept = {s.speaker_id for s in mine if not is_new_user(s.speaker_id)}
        new = {s.speaker_id for s in mine if is_new_user(s.speaker_id)}
        assert len(kept) == prof.users_per_device and len(new) == prof.new_users_per_device
        for sid in kept:  # every kept user speaks in every split, each a take of its own
            takes = {s.split: s.voice for s in mine if s.speaker_id == sid}
            assert set(takes) == set(SPLITS)
            assert len({(v.engine, v.voice, v.variant) for v in takes.values()}) == 1
        assert {s.split for s in mine if s.speaker_id in new} == {"test"}
        # several engines per device type
        assert len({s.voice.engine for s in mine}) >= 3
    assert acoustics_named(PROFILES["fleet"].acoustics) is not None
    # the speaker bootstrap needs units: at least 10 users per device type
    assert prof.users_per_device >= 10


@pytest.mark.parametrize("seed", [0, 3])
def test_the_enrolled_fleet_has_the_same_users_and_tests_and_four_times_the_training(seed):
    # Clips and streams are drawn from generators keyed by (seed, device, kind, split,
    # index) over the planned speakers, so the same recipes make the same validation and
    # test audio (a build of each with seed 0: all 1,225 validation and test files equal).
    base, more = PROFILES["fleet"], PROFILES["fleet-enrolled"]
    assert make_speakers(seed, base, "hey nova") == make_speakers(seed, more, "hey nova")
    mine, theirs = clip_recipes(seed, base), clip_recipes(seed, more)
    for split in ("val", "test"):
        assert [r for r in mine if r.split == split] == [r for r in theirs if r.split == split]
    for device, counts in clip_counts(base).items():
        assert clip_counts(more)[device]["train"] == 4 * counts["train"]
    train = [r for r in theirs if r.split == "train"]
    assert sum(r.content == "pos" for r in train) > 3 * sum(
        r.content == "pos" for r in mine if r.split == "train"
    )
    assert stream_counts(more) == stream_counts(base)


def test_the_validation_streams_addon_has_the_fleets_users_and_streams_only():
    # gate_hindsight --extra-streams adds it to a fleet run's validation: the same users
    # (so the same voices and rooms), no clips, 8 validation streams per device type.
    base, addon = PROFILES["fleet"], PROFILES["fleet-valstreams"]
    assert make_speakers(2, addon, "hey nova") == make_speakers(2, base, "hey nova")
    assert clip_recipes(2, addon) == []
    assert stream_counts(addon) == {"train": 0, "val": 8, "test": 0}
    assert addon.draw_offset != base.draw_offset  # draws of its own, not the fleet's streams


@pytest.mark.slow  # three builds, the first with the speech engines
def test_micro_fleet_build_is_deterministic_per_seed(tmp_path: Path):
    # One speech cache for all: Pico's output can depend on what the engine said before in
    # the same process (tools/CORPUS.md), so a build is deterministic given its speech.
    def build(name: str, seed: int, cache: str) -> Path:
        return build_corpus(
            tmp_path / name, seed=seed, profile="fleet-micro", progress=False,
            tts_cache_dir=tmp_path / cache,
        )  # fmt: skip

    m1, m2 = build("a", 3, "tts"), build("b", 3, "tts")
    d1 = _digest(m1.parent)
    assert d1 == _digest(m2.parent) and f"{NEW_USERS_DIR}/manifest.csv" in d1
    d3 = _digest(build("c", 4, "tts").parent)
    wavs = [k for k in d1 if k.endswith(".wav") and k in d3]
    assert wavs and sum(d1[k] != d3[k] for k in wavs) > 0.9 * len(wavs)

    rows = read_manifest(m1)
    clips = [r for r in rows if r.kind == "clip" and r.speaker.startswith(tuple("ABCDE"))]
    assert all(fleet_device_of(r.speaker) == r.device_type for r in clips)
    assert not any(is_new_user(r.speaker) for r in rows)
    trained = {r.speaker for r in clips if r.split == "train"}
    assert {r.speaker for r in clips if r.split == "test"} <= trained  # the same users
    assert any(r.kind == "stream" and r.split == "test" for r in rows)
    new = read_manifest(m1.parent / NEW_USERS_DIR / "manifest.csv")
    new_speech = [r for r in new if not r.speaker.startswith("nospeech")]
    assert new_speech and all(is_new_user(r.speaker) for r in new_speech)
    assert not {r.speaker for r in new_speech} & trained


def test_acoustics_by_name_puts_the_field_simulation_on_the_named_device_types():
    mixed = acoustics_named("field:BD")
    own, field = ACOUSTICS["device"], ACOUSTICS["field"]
    np.testing.assert_array_equal(mixed.room(0, "A", 1), own.room(0, "A", 1))
    np.testing.assert_array_equal(mixed.room(0, "B", 1), field.room(0, "B", 1))
    wave = np.random.default_rng(0).standard_normal(24000) * 0.01
    for device, ref in (("C", own), ("D", field)):
        got = mixed.capture(np.random.default_rng(5), device, wave)
        np.testing.assert_array_equal(got, ref.capture(np.random.default_rng(5), device, wave))
    assert acoustics_named("field") is field and acoustics_named("device") is own
    for bad in ("field:", "field:BX", "room", "device:AB"):
        with pytest.raises(ConfigError, match="unknown acoustics"):
            acoustics_named(bad, "p")
