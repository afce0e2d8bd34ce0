"""What a synthetic corpus holds, decided before any audio is made: profiles (sizes), the
texts, what a speaker and a clip are, and each clip's recipe. Pure functions of the seed,
so the plan (and with it the audio) never depends on generation order. The voices are
drawn in `voices`, the speakers (and the fleet's users) in `speakers`."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.tools.acoustics.device_acoustics import DEVICE_PROFILES
from wakefl.tools.corpus.speech_synthesis import Voice

STATES = ("normal", "playback", "alarm")
SPLITS = ("train", "val", "test")
SPEAKER_SHARE = {"train": 0.7, "val": 0.15, "test": 0.15}
# Clip content mix: wake phrase, confusable phrase, other speech, background only; and the
# wake phrase or a confusable inside running speech (speech right before it, a command
# right after it), which a profile takes only when its `contents` name them.
CONTENT_SHARE = {
    "pos": 0.45, "conf": 0.25, "other": 0.15, "bg": 0.15, "pos_run": 0.3, "conf_run": 0.2,
}  # fmt: skip
# The contents whose clips are labelled wake phrase.
POSITIVE_CONTENTS = ("pos", "pos_run")
# The contents whose clips hold a near-rhyme of the phrase: said alone, or in running speech.
NEAR_RHYME_CONTENTS = ("conf", "conf_run")
# Short lead-ins a user may say right before the phrase, besides whole sentences.
LEAD_IN_FILLERS = ("okay", "um", "so", "and", "oh", "right", "well", "uh")

HEY_NOVA_CONFUSABLES = (
    "hey noah", "nova scotia", "hey over", "hey nora", "hey now", "bossa nova",
    "hey, no way", "a supernova", "hey mona", "nova", "hey", "hey you, over there",
)  # fmt: skip
OTHER_SPEECH = (
    "turn on the lights", "what time is it", "set a timer for ten minutes",
    "the weather tomorrow will be sunny", "play some music", "stop", "call my mother",
    "how far is the station", "remind me to buy milk", "good morning everyone",
    "i think it is going to rain", "open the window please", "where are my keys",
    "dinner is ready", "can you hear me", "volume down", "next song", "thank you very much",
    "see you later", "it was a long day at work", "the cat is sleeping on the sofa",
    "let's go for a walk", "seven eight nine ten", "what is the capital of france",
    "please close the door", "i would like a cup of tea", "the train leaves at noon",
    "my favourite colour is blue", "call it a day", "never mind",
)  # fmt: skip


# Extra hard negatives and everyday speech for the pretraining corpus: the more ways a
# detector hears "almost the phrase" and ordinary talk in training, the fewer false accepts
# per hour it makes on long recordings. None contains the phrase itself: cut to the window,
# such a negative could hold a whole positive.
PRETRAIN_CONFUSABLES = (
    "okay nova", "supernova", "hey mova", "hey noelle", "hey lover", "hey noble",
    "hey no", "a nova", "the nova", "hey nobody", "hey nonna", "hey rover", "hay over",
    "hey, nope", "renova", "bossa nova music", "hey, know what", "anova", "hey mover",
    "play nova", "hey noel", "nova is a star", "casanova", "hey you",
)  # fmt: skip
PRETRAIN_OTHER_SPEECH = (
    "hey google", "alexa, what's the weather", "okay computer", "hey there, how are you",
    "turn off the oven", "is it going to snow today", "add eggs to the shopping list",
    "what is on television tonight", "i'll be home in ten minutes", "pause the movie",
    "the kids are asleep upstairs", "did you feed the dog", "tell me a joke",
    "skip this advert", "how long until the bus comes", "set an alarm for seven",
    "we need more coffee", "that was a great goal", "read me the news",
    "breaking news tonight from the capital", "and now, the weather forecast",
    "in other news, the market fell", "welcome back to the show", "shuffle my playlist",
    "where did i park the car", "it's your turn to do the dishes", "happy birthday to you",
    "one two three four five six", "i love this song", "could you turn that down",
)  # fmt: skip


@dataclass(frozen=True)
class CorpusProfile:
    name: str
    n_speakers: int
    train_unit: int  # training clips of the smallest device type; others scale by weight
    val_clips: int  # per device type
    test_clips: int  # per device type
    streams_per_device: int
    stream_seconds: float
    confusables_per_speaker: int = 6
    others_per_speaker: int = 4
    rooms_per_device: int = 16
    # "basic": espeak-ng and flite; "pretrain": every engine, wide prosody, hard negatives,
    # training and validation streams, and an unseen-voices test corpus; "pico-other": the
    # pretraining texts spoken by Pico's non-English voices (an add-on training corpus);
    # "engines": the pretraining texts spoken by RHVoice, MBROLA and festival's other voices
    # (an add-on training corpus whose unseen split holds that add-on's held-out voices);
    # "gnuspeech": the same texts spoken by GnuSpeech's articulatory speakers (an add-on
    # whose unseen split holds its small_child speakers); "flite": flite's voices alone,
    # drawn away from the main corpus's held-out speakers (an add-on training corpus).
    voice_set: str = "basic"
    train_streams_per_device: int = 0
    val_streams_per_device: int = 0
    unseen_speakers: int = 0
    unseen_test_clips: int = 0  # per device type
    unseen_streams_per_device: int = 0
    # What the clips hold, from CONTENT_SHARE's kinds (shares renormalized over these). The
    # streams hold confusables and other speech, or near-rhymes only where "other" is absent.
    contents: tuple[str, ...] = ("pos", "conf", "other", "bg")
    # When set, every wake-phrase clip is spoken without a pause between the phrase's words
    # and with the first word lasting a factor drawn from this range times as long
    # (tools/corpus/word_timing.py run_together).
    first_word_pace: tuple[float, float] | None = None
    # Added to the draws' kinds: an add-on built with the main corpus's seed (so with its
    # speakers and splits) never repeats the main corpus's rooms, noise and placements.
    draw_offset: int = 0
    # When set, each speaker says this many confusables in place of its own draw: phrases
    # the base draw did not give it, drawn apart from the base's draws, so an add-on keeps
    # the main corpus's speakers and splits while pairing them with near-rhymes anew.
    new_confusables: int = 0
    # voice_set "fleet": each device type has its own users (`make_fleet_speakers`), this
    # many in its training, validation and test data (other takes in each), and
    # `new_users_per_device` more kept out of its training data, heard only in the
    # new-users test corpus (`new_user_test_clips` clips per device type).
    users_per_device: int = 0
    new_users_per_device: int = 0
    new_user_test_clips: int = 0
    # How a device hears a sound field (room and capture chain): a name in
    # corpus_build.ACOUSTICS ("device": tools/acoustics/device_acoustics.py; "field": the
    # held-out simulation, tools/acoustics/field_capture.py).
    acoustics: str = "device"

    def __post_init__(self) -> None:
        if not self.contents or not set(self.contents) <= set(CONTENT_SHARE):
            raise ConfigError(
                f"profile {self.name}: contents {self.contents} must be some of "
                f"{', '.join(CONTENT_SHARE)}"
            )
        pace = self.first_word_pace
        if pace is not None and not 0.2 <= pace[0] <= pace[1] <= 3.0:
            raise ConfigError(f"profile {self.name}: first_word_pace {pace} outside [0.2, 3]")


PROFILES: dict[str, CorpusProfile] = {
    "tiny": CorpusProfile("tiny", 48, 40, 16, 24, 1, 40.0),
    # Held-out sets far larger than the training unit: the paper study's relative FA is a
    # ratio of false-accept counts, and its intervals are only as narrow as those counts.
    # From the pretrained baseline, 960 test clips left it with 1 to 23 false accepts per
    # device type; 1,920 double those counts (training and validation clips do not change).
    "small": CorpusProfile("small", 200, 240, 480, 1920, 3, 70.0),
    # `wakefl demo`: tiny's training data per device, with held-out sets large enough to
    # resolve differences (240 test clips and 2 minutes of streams per device type) and 64
    # validation clips for each device's served-model gate.
    "demo": CorpusProfile("demo", 64, 40, 64, 240, 2, 60.0),
    "full": CorpusProfile("full", 240, 800, 480, 960, 6, 250.0, 10, 10, 32),
    # Pretraining: ~520 training-engine speakers and 22k training clips, an hour of test
    # streams per device type for FA per hour, and 96 speakers of voices training never hears.
    "pretrain": CorpusProfile(
        "pretrain", 520, 2000, 400, 1000, 6, 600.0, 8, 6, 32, "pretrain", 4, 2, 96, 600, 2
    ),
    # The same recipe at a size a test builds in seconds.
    "pretrain-micro": CorpusProfile(
        "pretrain-micro", 24, 4, 6, 6, 1, 12.0, 3, 3, 4, "pretrain", 1, 1, 6, 6, 1
    ),
    # The pretraining recipe at about a third of its size: a model for another phrase
    # trained from a shipped one (`--init-from`) in well under an hour on 2 cores, and
    # held-out sets for tools/bench/peers.py: 300 speakers, 7,700 training clips, and 6 x 5
    # min of held-out streams per device type for the held-out speakers and as many for
    # unseen voices (2.5 h each: one false accept is 0.5 FA/h over a condition's streams).
    "pretrain-compact": CorpusProfile(
        "pretrain-compact", 300, 700, 120, 400, 6, 300.0, 8, 6, 32, "pretrain", 2, 2, 48, 300, 6
    ),
    # An add-on for `wakefl model pretrain --extra-corpus`: 96 speakers of Pico's German,
    # Spanish, French and Italian voices reading the pretraining texts, 5,500 training clips
    # and 25 minutes of training streams. Pico's English voices stay unseen.
    "pretrain-voices": CorpusProfile(
        "pretrain-voices", 96, 500, 40, 40, 0, 300.0, 8, 6, 32, "pico-other", 1, 0
    ),
    "pretrain-voices-micro": CorpusProfile(
        "pretrain-voices-micro", 12, 4, 6, 6, 0, 12.0, 3, 3, 4, "pico-other", 1, 0
    ),
}


# An add-on profile starts from nothing (no clips, streams or unseen voices) and keeps only
# what it sets; everything else (speakers, texts, rooms) is its base's.
_EMPTY = dict.fromkeys(
    ("train_unit", "val_clips", "test_clips", "streams_per_device", "train_streams_per_device",
     "val_streams_per_device", "unseen_speakers", "unseen_test_clips", "unseen_streams_per_device"),
    0,
)  # fmt: skip


def _addon(base: str, name: str, **fields: Any) -> CorpusProfile:
    return replace(PROFILES[base], name=name, **{**_EMPTY, **fields})


def _timing_addon(base: str, name: str, train_unit: int, held_out: int) -> CorpusProfile:
    """An add-on of wake-phrase clips only, spoken by `base`'s own speakers (build it with
    the same seed, so its training speakers are the main corpus's) with the words run
    together and the first word 0.5-1.0 times as long: the training engines otherwise teach
    one timing of the phrase. `held_out` validation and test clips per device type, no
    streams."""
    return _addon(
        base, name, train_unit=train_unit, val_clips=held_out, test_clips=held_out,
        contents=("pos",), first_word_pace=(0.5, 1.0), draw_offset=20,
    )  # fmt: skip


# 3,300 training clips (as many as a third of the main corpus's wake-phrase clips).
PROFILES["pretrain-timing"] = _timing_addon("pretrain", "pretrain-timing", 300, 40)
PROFILES["pretrain-timing-micro"] = _timing_addon("pretrain-micro", "pretrain-timing-micro", 4, 6)


def _streams_addon(base: str, name: str, streams: int, split: str = "test") -> CorpusProfile:
    """An add-on of held-out negative streams only, spoken by `base`'s speakers of `split`
    (test or val; build it with the same seed) with draws of their own: `bench_detection
    --extra-streams` adds them to the main corpus's streams of that split, so that FRR at
    0.5 FA/h, which needs at least 2 hours of stream per device type, can be resolved, on the
    test split for reporting and on the validation split for choosing."""
    counts = {"test": ("streams_per_device", 30), "val": ("val_streams_per_device", 40)}
    if split not in counts:
        raise ConfigError(f"a streams add-on holds test or val streams, not {split}")
    field, offset = counts[split]
    return _addon(base, name, **{field: streams}, contents=("conf", "other"), draw_offset=offset)


# Two more hours per device type: three with the main corpus's hour.
PROFILES["pretrain-streams"] = _streams_addon("pretrain", "pretrain-streams", 12)
PROFILES["pretrain-streams-micro"] = _streams_addon("pretrain-micro", "pretrain-streams-micro", 2)
# 3 h of test stream per device type, drawn anew: a reading none other scored (tools/CORPUS.md).
PROFILES["pretrain-streams-second"] = replace(
    _streams_addon("pretrain", "pretrain-streams-second", 18), draw_offset=140)  # fmt: skip
# Two more hours of validation stream per device type (the main corpus has 20 minutes): a
# choice between models or thresholds at 0.5 FA/h that the test streams never see.
PROFILES["pretrain-valstreams"] = _streams_addon("pretrain", "pretrain-valstreams", 12, split="val")
PROFILES["pretrain-valstreams-micro"] = _streams_addon(
    "pretrain-micro", "pretrain-valstreams-micro", 2, split="val"
)
# Validation streams of near-rhymes only, from about 200 speakers of their own (build it with
# a seed other than the main corpus's), each with every near-rhyme of the pool: a threshold
# from many speaker-near-rhyme pairs (tools/probes/near_rhyme_rate.py).
PROFILES["pretrain-nearrhymes"] = replace(
    _streams_addon("pretrain", "pretrain-nearrhymes", 8, split="val"),
    n_speakers=2080, confusables_per_speaker=36, contents=("conf",), draw_offset=80,
)  # fmt: skip
PROFILES["pretrain-nearrhymes-micro"] = replace(
    PROFILES["pretrain-nearrhymes"], name="pretrain-nearrhymes-micro", n_speakers=24,
    val_streams_per_device=1, stream_seconds=12.0, rooms_per_device=4,
)  # fmt: skip


def _confusables_addon(base: str, name: str, train_unit: int, per_speaker: int) -> CorpusProfile:
    """An add-on of confusable training clips only: `base`'s training speakers (build it
    with the same seed) each saying `per_speaker` near-rhymes that the main corpus did not
    give them. The false accepts that remain are held-out speakers' renditions of phrases
    training heard from other speakers; more speaker-phrase pairs teach the phrase, not
    the speaker. No held-out clips: the main corpus's validation set stays the yardstick."""
    return _addon(
        base,
        name,
        train_unit=train_unit,
        contents=("conf",),
        new_confusables=per_speaker,
        draw_offset=50,
    )


# The main corpus's speakers saying the phrase or a confusable inside running speech:
# 3,300 training clips, and held-out clips that the benchmark scores apart from isolated
# phrases. Build it with the main corpus's seed.
PROFILES["pretrain-carrier"] = _addon(
    "pretrain", "pretrain-carrier", train_unit=300, val_clips=100, test_clips=200,
    contents=("pos_run", "conf_run"), draw_offset=70,
)  # fmt: skip
# The same for the compact corpus (build it with that corpus's seed and phrase): what the
# ablations of the model for speech around the phrase train and choose on.
PROFILES["pretrain-compact-carrier"] = _addon(
    "pretrain-compact", "pretrain-compact-carrier", train_unit=150, val_clips=60, test_clips=120,
    contents=("pos_run", "conf_run"), draw_offset=70,
)  # fmt: skip
PROFILES["pretrain-carrier-micro"] = _addon(
    "pretrain-micro", "pretrain-carrier-micro", train_unit=4, val_clips=6, test_clips=6,
    contents=("pos_run", "conf_run"), draw_offset=70,
)  # fmt: skip
_ALL_CONTENTS = ("pos", "conf", "other", "bg", "pos_run", "conf_run")
# An add-on for `wakefl model pretrain --extra-corpus`: 240 speakers of RHVoice, MBROLA and
# festival's other voices (5,500 training clips, a fifth of them phrases or confusables in
# running speech, and 25 minutes of training streams), with held-out clips of their own and
# an unseen-engines split of voices its training never hears (`DIR/unseen/`).
PROFILES["pretrain-engines"] = CorpusProfile(
    "pretrain-engines", 240, 500, 100, 200, 0, 300.0, 8, 6, 32, "engines", 1, 0, 60, 300, 1,
    contents=_ALL_CONTENTS,
)  # fmt: skip
PROFILES["pretrain-engines-micro"] = CorpusProfile(
    "pretrain-engines-micro", 16, 4, 6, 6, 0, 12.0, 3, 3, 4, "engines", 1, 0, 6, 6, 1,
    contents=_ALL_CONTENTS,
)  # fmt: skip
# An add-on of articulatory speech (tools/corpus/gnuspeech.py): 120 GnuSpeech speakers drawn
# between its male, female and large_child voices (vocal-tract length, pitch, tempo), the
# engines add-on's recipe with fewer speakers and clips, and an unseen split of 40 speakers
# drawn around its small_child voice, whose tract is shorter than any training speaker's. 15 minutes to
# build on 2 cores (365 MB).
PROFILES["pretrain-gnuspeech"] = replace(
    PROFILES["pretrain-engines"], name="pretrain-gnuspeech", voice_set="gnuspeech",
    n_speakers=120, train_unit=300, unseen_speakers=40, unseen_test_clips=200,
)  # fmt: skip
PROFILES["pretrain-gnuspeech-micro"] = CorpusProfile(
    "pretrain-gnuspeech-micro", 6, 2, 3, 3, 0, 6.0, 2, 2, 2, "gnuspeech", 1, 0, 2, 3, 1,
    contents=("pos", "conf", "other", "bg", "pos_run"),
)  # fmt: skip
# The voice sets of the pretraining corpus and its add-ons (texts and splits of their own).
PRETRAIN_VOICE_SETS = ("pretrain", "pico-other", "engines", "gnuspeech", "flite")


# flite's speakers drawn anew, half of them `awb`, away from the main corpus's held-out ones
# (tools/corpus/voices.py `flite_voices`), each with all 36 near-rhymes, saying the phrase or
# one of them: 6,600 training clips. Build it with the main corpus's seed (tools/CORPUS.md).
PROFILES["pretrain-flite"] = CorpusProfile(
    "pretrain-flite", 240, 600, 40, 40, 0, 300.0, 36, 0, 32, "flite", contents=("pos", "conf"),
    draw_offset=150,
)  # fmt: skip
PROFILES["pretrain-flite-micro"] = replace(PROFILES["pretrain-flite"], name="pretrain-flite-micro",
    n_speakers=16, train_unit=4, val_clips=4, test_clips=4, rooms_per_device=4)  # fmt: skip
# The same speakers' near-rhymes alone, rendered anew: 3,300 training clips, so that beside
# `pretrain-flite` these voices say near-rhymes more often than the phrase (MODEL_CARD.md).
PROFILES["pretrain-flite-nearrhymes"] = replace(PROFILES["pretrain-flite"],
    name="pretrain-flite-nearrhymes", train_unit=300, contents=("conf",), draw_offset=160)  # fmt: skip


# 3,300 training clips, as many as three fifths of the main corpus's confusable clips.
PROFILES["pretrain-confusables"] = _confusables_addon("pretrain", "pretrain-confusables", 300, 8)
PROFILES["pretrain-confusables-micro"] = _confusables_addon(
    "pretrain-micro", "pretrain-confusables-micro", 4, 3
)
# Every training speaker with every near-rhyme the main corpus did not give it (28 of 36), in
# 9,900 clips and 1.7 h of training streams of near-rhymes only (two in one window two times
# in three, as in the near-rhyme streams); build it with the main corpus's seed.
PROFILES["pretrain-nearrhymes-train"] = replace(
    _confusables_addon("pretrain", "pretrain-nearrhymes-train", 900, 36),
    train_streams_per_device=2, draw_offset=90,
)  # fmt: skip
PROFILES["pretrain-nearrhymes-train-micro"] = replace(
    _confusables_addon("pretrain-micro", "pretrain-nearrhymes-train-micro", 4, 36),
    train_streams_per_device=1, draw_offset=90,
)  # fmt: skip
# The same for the compact corpus (build it with that corpus's seed and phrase): about
# 1,650 training clips. For a phrase other than "hey nova" its pool adds the near-rhymes
# written from the phrase's spelling (`addon_confusables`).
PROFILES["pretrain-compact-confusables"] = _confusables_addon(
    "pretrain-compact", "pretrain-compact-confusables", 150, 8
)


def _acoustics_addon(
    base: str, name: str, clips: tuple[int, int, int], streams: tuple[int, int, int], rooms: int
) -> CorpusProfile:
    """Held-out sets only, through the second acoustic simulation (tools/corpus/field_corpus.py)
    instead of the training devices, so that checkpoints and thresholds are chosen on
    acoustics training never used: `base`'s validation, test and unseen speakers (same seed).
    Per device type: `clips` (validation, test, unseen test), `streams` the same counts of
    negative streams, `rooms` image-source rooms (about a second each to simulate)."""
    return _addon(
        base, name, val_clips=clips[0], test_clips=clips[1],
        unseen_speakers=PROFILES[base].unseen_speakers, unseen_test_clips=clips[2],
        val_streams_per_device=streams[0], streams_per_device=streams[1],
        unseen_streams_per_device=streams[2], rooms_per_device=rooms, draw_offset=60,
    )  # fmt: skip


# Per device type: 1 h of validation stream, 2 h of test stream (one false accept resolves
# 0.5 FA/h), 1 h of unseen-voice stream.
PROFILES["pretrain-acoustics"] = _acoustics_addon(
    "pretrain", "pretrain-acoustics", (400, 1000, 600), (6, 12, 6), 12
)
PROFILES["pretrain-acoustics-micro"] = _acoustics_addon(
    "pretrain-micro", "pretrain-acoustics-micro", (6, 6, 6), (1, 1, 1), 2
)
# Its test half, which the model card's rules score: no validation set, one test and one
# unseen-voice stream per type (keyed by index: the full add-on's clips and streams).
PROFILES["pretrain-acoustics-subset"] = _acoustics_addon(
    "pretrain", "pretrain-acoustics-subset", (0, 1000, 600), (0, 1, 1), 12
)
# The same add-on for the compact corpus (`--profile pretrain-compact`, e.g. a second wake
# phrase's): per device type 200 test and 100 unseen-voice clips, 6 x 5 min of test and of
# unseen-voice streams (2.5 h over the five types: one false accept is 0.4 FA/h), no
# validation set (the compact corpus's models are compared, not selected, on it).
PROFILES["pretrain-compact-acoustics"] = _acoustics_addon(
    "pretrain-compact", "pretrain-compact-acoustics", (0, 200, 100), (0, 6, 6), 6
)
# Profiles that corpus_build hands to tools/corpus/field_corpus.py: the acoustics add-ons.
FIELD_ACOUSTICS_PROFILES = tuple(name for name in PROFILES if "acoustics" in name)


# A fleet of users the shipped model serves badly (`wakefl demo`'s default): each device type
# A-E has its own users, all speaking with voices no shipped model trained on (FLEET_VOICES),
# B and D recorded in the held-out simulation's rooms and through its device front ends
# ("field:BD"; A, C and E through their own), with their own background and near-miss
# speech. 12 users per device type train, validate and are tested (other takes): the
# speaker bootstrap's units; 3 more are kept out of its training data (the new-users test
# corpus). 60 training clips for E, the smallest type, so that each round's two local epochs
# are a few steps more than a nudge; 96 validation clips per type, so that the served-model
# gate sees enough negatives to set a false-accept level, and 4 minutes of validation stream
# whose windows join them (tools/cli/device.py --val-stream-hop); 144 test clips (about 5
# wake words per user) and 6 minutes of test stream per type: one false accept is 10 FA/h.
PROFILES["fleet"] = CorpusProfile(
    "fleet", 0, 60, 96, 144, 3, 120.0, 4, 3, 8, "fleet",
    val_streams_per_device=2, users_per_device=12, new_users_per_device=3,
    new_user_test_clips=60, acoustics="field:BD",
)  # fmt: skip
# The same users, validation and test sets (clip for clip, with the same seed), each user
# with four times as many training clips (240 for E, 960 for A: about 9 takes of the phrase
# per user on E): what more enrolment gives a device (`wakefl demo --profile fleet-enrolled`;
# tools/CORPUS.md). Only `train_unit` differs: the name seeds nothing.
PROFILES["fleet-enrolled"] = replace(PROFILES["fleet"], name="fleet-enrolled", train_unit=240)
# Sixteen more minutes of validation stream per device type (the fleet has four), by the
# same users in the same rooms with draws of their own (build it with the fleet's seed; it
# serves `fleet-enrolled` too): how much more a device's served-model gate sees with more of
# its own negative audio (`wakefl demo --val-streams`, tools/studies/gate_hindsight.py).
PROFILES["fleet-valstreams"] = _streams_addon("fleet", "fleet-valstreams", 8, split="val")
# The same recipe at a size a test builds in seconds.
PROFILES["fleet-micro"] = CorpusProfile(
    "fleet-micro", 0, 2, 3, 3, 1, 6.0, 1, 1, 2, "fleet",
    val_streams_per_device=1, users_per_device=1, new_users_per_device=1,
    new_user_test_clips=2, acoustics="field:BD",
)  # fmt: skip


@dataclass(frozen=True)
class Speaker:
    speaker_id: str
    voice: Voice
    split: str
    confusables: tuple[str, ...]
    others: tuple[str, ...]


@dataclass(frozen=True)
class ClipRecipe:
    device_type: str
    split: str
    index: int  # position within (device type, split)
    content: str  # pos / conf / other / bg
    state: str

    @property
    def path(self) -> str:
        """The clip's file, relative to its manifest: its file name records its content."""
        d, sp = self.device_type, self.split
        return f"clips/{d}/{sp}/{d}_{sp}_{self.index:05d}_{self.content}.wav"


_CLIP_NAME = re.compile(r"clips/(\w+)/(\w+)/\1_\2_\d{5}_(?P<content>[a-z_]+)\.wav")


def clip_content(path: str) -> str:
    """The content (`_ALL_CONTENTS`) that a built clip's manifest path records, or "" for a
    clip this recipe did not name (an imported recording)."""
    m = _CLIP_NAME.fullmatch(path.replace("\\", "/"))
    return m["content"] if m and m["content"] in _ALL_CONTENTS else ""


def phrase_variants(phrase: str) -> tuple[str, ...]:
    """The wake phrase as a few spellings that change the synthesisers' prosody."""
    words = phrase.split()
    out = [phrase, phrase + "!"]
    if len(words) > 1:
        out.append(words[0] + ", " + " ".join(words[1:]))
    return tuple(dict.fromkeys(out))


def confusables_for(phrase: str) -> tuple[str, ...]:
    """Phrases that sound like the wake phrase or share a word with it."""
    if phrase.strip().lower() == "hey nova":
        return HEY_NOVA_CONFUSABLES
    words = phrase.split()
    out = list(words)
    if len(words) > 1:
        recombined = [" ".join(reversed(words)), words[0] + " there", "the " + words[-1]]
        out += [*recombined, words[0] + " no"]
    out += ["say " + words[-1] + " again"]
    return tuple(w for w in dict.fromkeys(out) if w.strip().lower() != phrase.strip().lower())


def allocate(total: int, shares: dict[str, float], minimum: int = 0) -> dict[str, int]:
    """Integer counts proportional to `shares` (largest remainder), each at least `minimum`
    when the total allows it."""
    keys = list(shares)
    minimum = minimum if total >= minimum * len(keys) else 0
    s = sum(shares.values())
    rest = total - minimum * len(keys)
    raw = {k: rest * shares[k] / s for k in keys}
    counts = {k: int(np.floor(raw[k])) for k in keys}
    left = rest - sum(counts.values())
    for k in sorted(keys, key=lambda k: (-(raw[k] - counts[k]), keys.index(k)))[:left]:
        counts[k] += 1
    return {k: counts[k] + minimum for k in keys}


def texts_for(profile: CorpusProfile, phrase: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(confusable phrases, other speech) a profile's speakers draw from."""
    confusables: tuple[str, ...] = confusables_for(phrase)
    others: tuple[str, ...] = OTHER_SPEECH
    if profile.voice_set in PRETRAIN_VOICE_SETS:
        if phrase.strip().lower() == "hey nova":
            confusables = tuple(dict.fromkeys(confusables + PRETRAIN_CONFUSABLES))
        others = tuple(dict.fromkeys(others + PRETRAIN_OTHER_SPEECH))
    return confusables, others


# Near-rhymes of any wake phrase, written from its spelling. "hey nova" has near-rhymes
# written by hand (above); another phrase gets only confusables made of its own words
# (`confusables_for`), and a model trained on those learns "the first word, then
# anything": a "hey jarvis" model trained that way fired on "hey java", "hey harvest" and
# "hey travis" (MODEL_CARD.md). The synthesisers read a spelling by their letter-to-sound
# rules, so changing letters of the last word changes its sounds.
# Onsets put before the last word's rhyme: single consonants and a few clusters.
NEAR_RHYME_ONSETS = ("b", "c", "d", "g", "h", "l", "m", "n", "p", "r", "s", "t", "tr", "st", "bl")
# Words said where the phrase's first word is.
NEAR_RHYME_LEADS = ("okay", "play", "hay", "a", "the", "say")
_VOWELS = "aeiou"


def _first_vowel(word: str) -> int:
    """Index of the first vowel letter of `word` (a leading 'y' is a consonant, a later one
    a vowel); len(word) when it has none."""
    m = re.search(r"[aeiou]|(?<=.)y", word)
    return m.start() if m else len(word)


def near_rhymes(phrase: str) -> tuple[str, ...]:
    """Phrases that sound close to `phrase` without being it, in a fixed order: the last
    word with another onset, with another vowel in its first syllable, the phrase with
    another first word, and the last word cut after its first syllable. None equals the
    phrase or holds it (cut to a window, such a negative could hold a whole positive)."""
    words = phrase.lower().split()
    if not words:
        return ()
    *head, last = words
    v = _first_vowel(last)
    out: list[str] = []
    if v < len(last):
        out += [" ".join([*head, onset + last[v:]]) for onset in NEAR_RHYME_ONSETS]
        out += [" ".join([*head, last[:v] + x + last[v + 1 :]]) for x in _VOWELS if x != last[v]]
        if v + 2 < len(last):  # its first vowel and one consonant: "jarvis" -> "jar"
            out.append(" ".join([*head, last[: v + 2]]))
    if head:
        # not a spelling of the same word ("ok" and "okay"): that would be the phrase itself
        first = words[0]
        out += [
            " ".join([lead, *words[1:]])
            for lead in NEAR_RHYME_LEADS
            if not (lead.startswith(first) or first.startswith(lead))
        ]
    whole = " ".join(words)
    return tuple(p for p in dict.fromkeys(out) if p != whole and whole not in p)


def addon_confusables(profile: CorpusProfile, phrase: str) -> tuple[str, ...]:
    """The pool a confusables add-on's speakers draw their new confusables from: the
    profile's confusables, and for a phrase without near-rhymes written by hand ("hey
    nova" has them) the near-rhymes written from its spelling (`near_rhymes`)."""
    confusables, _ = texts_for(profile, phrase)
    if phrase.strip().lower() == "hey nova":
        return confusables
    return tuple(dict.fromkeys(confusables + near_rhymes(phrase)))


def clip_counts(profile: CorpusProfile) -> dict[str, dict[str, int]]:
    """Clips per device type and split: training volume follows the device's weight."""
    smallest = min(p.train_weight for p in DEVICE_PROFILES.values())
    return {
        name: {
            "train": int(round(profile.train_unit * p.train_weight / smallest)),
            "val": profile.val_clips,
            "test": profile.test_clips,
        }
        for name, p in DEVICE_PROFILES.items()
    }


def stream_counts(p: CorpusProfile) -> dict[str, int]:
    """Negative streams per device type and split of the main corpus (not the unseen one)."""
    return {"train": p.train_streams_per_device, "val": p.val_streams_per_device,
            "test": p.streams_per_device}  # fmt: skip


def clip_recipes(seed: int, profile: CorpusProfile) -> list[ClipRecipe]:
    """Each clip's content and device state. Validation and test sets hold every state for
    every content kind when large enough, so both labels meet all three states."""
    recipes: list[ClipRecipe] = []
    for d_idx, (name, dev) in enumerate(DEVICE_PROFILES.items()):
        for s_idx, split in enumerate(SPLITS):
            n = clip_counts(profile)[name][split]
            slots: list[tuple[str, str]] = []
            shares = {c: CONTENT_SHARE[c] for c in CONTENT_SHARE if c in profile.contents}
            for content, k in allocate(n, shares).items():
                minimum = 1 if split != "train" else 0
                states = allocate(k, dict(zip(STATES, dev.state_probs, strict=True)), minimum)
                slots += [(content, st) for st, m in states.items() for _ in range(m)]
            order = np.random.default_rng([seed, d_idx, 7, s_idx]).permutation(len(slots))
            recipes += [ClipRecipe(name, split, i, *slots[j]) for i, j in enumerate(order)]
    return recipes
