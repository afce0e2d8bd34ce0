"""The synthetic speakers of a corpus profile and their splits: each a voice (from
`voices`) with its own draw of the profile's texts. Also the fleet's users, whose speaker ids
say their device type and whether they are kept out of its training data."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from wakefl.tools.acoustics.device_acoustics import DEVICE_PROFILES
from wakefl.tools.corpus.gnuspeech import GNUSPEECH_TRAIN, GNUSPEECH_UNSEEN
from wakefl.tools.corpus.plan import (
    OTHER_SPEECH,
    PRETRAIN_VOICE_SETS,
    PROFILES,
    SPEAKER_SHARE,
    SPLITS,
    CorpusProfile,
    Speaker,
    addon_confusables,
    allocate,
    confusables_for,
    texts_for,
)
from wakefl.tools.corpus.speech_synthesis import (
    ESPEAK_VARIANTS,
    ESPEAK_VOICES,
    FLITE_VOICES,
    PICO_OTHER_VOICES,
    Voice,
)
from wakefl.tools.corpus.voices import (
    ENGINES_TRAIN_FESTIVAL,
    ENGINES_TRAIN_MBROLA,
    ENGINES_TRAIN_RHVOICE,
    ENGINES_UNSEEN_MBROLA,
    ENGINES_UNSEEN_RHVOICE,
    draw_gnuspeech_voice,
    engine_voices,
    fleet_voice,
    fleet_voice_of,
    flite_voices,
    other_take,
    pico_voices,
    pretrain_voices,
    unseen_voices,
)


def make_speakers(seed: int, profile: CorpusProfile, phrase: str) -> list[Speaker]:
    """Synthetic speakers, each a distinct voice and prosody, assigned to disjoint splits
    (stratified by engine, so every split hears both synthesisers)."""
    if profile.voice_set in PRETRAIN_VOICE_SETS:
        return make_pretrain_speakers(seed, profile, phrase)
    if profile.voice_set == "fleet":
        return make_fleet_speakers(seed, profile, phrase)
    rng = np.random.default_rng([seed, 9001])
    n_flite = max(3, profile.n_speakers // 4)
    n_espeak = profile.n_speakers - n_flite
    pairs = [(v, var) for v in ESPEAK_VOICES for var in ESPEAK_VARIANTS]
    chosen = rng.choice(len(pairs), size=min(n_espeak, len(pairs)), replace=False)
    espeak = [
        Voice(
            "espeak-ng",
            pairs[i][0],
            pairs[i][1],
            int(rng.integers(125, 196)),
            int(rng.integers(25, 76)),
        )
        for i in chosen
    ]
    flite = []
    for k in range(n_flite):
        name = FLITE_VOICES[k % len(FLITE_VOICES)]
        f0 = int(rng.integers(165, 236)) if name == "slt" else int(rng.integers(85, 146))
        flite.append(Voice("flite", name, "", int(rng.integers(85, 126)), f0))
    confusables = confusables_for(phrase)
    speakers: list[Speaker] = []
    for group in (espeak, flite):
        counts = allocate(len(group), SPEAKER_SHARE, minimum=1)
        order = rng.permutation(len(group))
        pos = 0
        for split in SPLITS:
            for i in order[pos : pos + counts[split]]:
                conf = rng.choice(
                    len(confusables),
                    size=min(profile.confusables_per_speaker, len(confusables)),
                    replace=False,
                )
                oth = rng.choice(
                    len(OTHER_SPEECH),
                    size=min(profile.others_per_speaker, len(OTHER_SPEECH)),
                    replace=False,
                )
                speakers.append(
                    Speaker(
                        "",
                        group[i],
                        split,
                        tuple(confusables[j] for j in sorted(conf)),
                        tuple(OTHER_SPEECH[j] for j in sorted(oth)),
                    )  # fmt: skip
                )
            pos += counts[split]
    speakers.sort(key=lambda s: (SPLITS.index(s.split), s.voice.describe()))
    return [
        Speaker(f"spk{i:03d}", s.voice, s.split, s.confusables, s.others)
        for i, s in enumerate(speakers)
    ]


def speakers_with_texts(
    rng: np.random.Generator,
    profile: CorpusProfile,
    phrase: str,
    voices: list[Voice],
    split: str,
    prefix: str,
) -> list[Speaker]:
    """One speaker per voice, each with its own draw of confusables and other speech."""
    confusables, others = texts_for(profile, phrase)
    out = []
    for i, v in enumerate(voices):
        conf = rng.choice(
            len(confusables),
            size=min(profile.confusables_per_speaker, len(confusables)),
            replace=False,
        )
        oth = rng.choice(
            len(others), size=min(profile.others_per_speaker, len(others)), replace=False
        )
        out.append(
            Speaker(
                f"{prefix}{i:03d}",
                v,
                split,
                tuple(confusables[j] for j in sorted(conf)),
                tuple(others[j] for j in sorted(oth)),
            )
        )
    return out


def make_pretrain_speakers(seed: int, profile: CorpusProfile, phrase: str) -> list[Speaker]:
    """Training-engine speakers split 80/10/10 by speaker (stratified by engine)."""
    rng = np.random.default_rng([seed, 9003])
    if profile.voice_set == "pico-other":
        voices = pico_voices(rng, PICO_OTHER_VOICES, profile.n_speakers)
    elif profile.voice_set == "engines":
        voices = engine_voices(
            rng, profile.n_speakers, ENGINES_TRAIN_RHVOICE, ENGINES_TRAIN_MBROLA,
            ENGINES_TRAIN_FESTIVAL,
        )  # fmt: skip
    elif profile.voice_set == "gnuspeech":
        voices = [draw_gnuspeech_voice(rng, GNUSPEECH_TRAIN) for _ in range(profile.n_speakers)]
    elif profile.voice_set == "flite":
        held_out = make_pretrain_speakers(seed, PROFILES["pretrain"], phrase)
        avoid = [s.voice for s in held_out if s.split != "train" and s.voice.engine == "flite"]
        voices = flite_voices(rng, profile.n_speakers, avoid)
    else:
        voices = pretrain_voices(rng, profile.n_speakers)
    shares = {"train": 0.8, "val": 0.1, "test": 0.1}
    speakers: list[Speaker] = []
    for engine in dict.fromkeys(v.engine for v in voices):
        group = [v for v in voices if v.engine == engine]
        counts = allocate(len(group), shares, minimum=1)
        order = rng.permutation(len(group))
        pos = 0
        for split in SPLITS:
            chosen = [group[i] for i in order[pos : pos + counts[split]]]
            speakers += speakers_with_texts(rng, profile, phrase, chosen, split, "tmp")
            pos += counts[split]
    speakers.sort(key=lambda s: (SPLITS.index(s.split), s.voice.describe()))
    speakers = [
        Speaker(f"spk{i:03d}", s.voice, s.split, s.confusables, s.others)
        for i, s in enumerate(speakers)
    ]
    if profile.new_confusables:
        speakers = _with_new_confusables(seed, profile, phrase, speakers)
    return speakers


def _with_new_confusables(
    seed: int, profile: CorpusProfile, phrase: str, speakers: list[Speaker]
) -> list[Speaker]:
    """Each speaker with `profile.new_confusables` confusables it was not given, drawn from
    a generator of their own, so the speakers' voices and splits are the base draw's."""
    confusables = addon_confusables(profile, phrase)
    rng = np.random.default_rng([seed, 9005])
    out = []
    for s in speakers:
        fresh = [c for c in confusables if c not in s.confusables]
        pick = rng.choice(len(fresh), size=min(profile.new_confusables, len(fresh)), replace=False)
        out.append(replace(s, confusables=tuple(fresh[j] for j in sorted(pick))))
    return out


def make_unseen_speakers(seed: int, profile: CorpusProfile, phrase: str) -> list[Speaker]:
    """The unseen-voices test speakers (ids `unseen000`, ...), all in split test: for the
    `engines` add-on its held-out voices, else `unseen_voices`."""
    rng = np.random.default_rng([seed, 9004])
    if profile.voice_set == "engines":
        voices = engine_voices(
            np.random.default_rng([seed, 9006]), profile.unseen_speakers,
            ENGINES_UNSEEN_RHVOICE, ENGINES_UNSEEN_MBROLA, (),
        )  # fmt: skip
    elif profile.voice_set == "gnuspeech":
        draw = np.random.default_rng([seed, 9007])
        voices = [
            draw_gnuspeech_voice(draw, GNUSPEECH_UNSEEN) for _ in range(profile.unseen_speakers)
        ]
    else:
        voices = unseen_voices(seed, profile.unseen_speakers)
    return speakers_with_texts(rng, profile, phrase, voices, "test", "unseen")


# Speaker ids of the users kept out of their device type's training data: "<type>-new<k>".
NEW_USER_TAG = "-new"


def fleet_device_of(speaker_id: str) -> str:
    """The device type a fleet user belongs to (its id is "<type>-user<k>" or "<type>-new<k>")."""
    return speaker_id.split("-", 1)[0]


def is_new_user(speaker_id: str) -> bool:
    """Whether a fleet user is kept out of its device type's training data."""
    return NEW_USER_TAG in speaker_id


def make_fleet_speakers(seed: int, profile: CorpusProfile, phrase: str) -> list[Speaker]:
    """The fleet's users per device type, one `Speaker` per (user, split) it speaks in:
    "<type>-user<k>" in train, val and test (its training voice, then another take of it
    for each held-out split), "<type>-new<k>" in test only (kept out of training)."""
    rng = np.random.default_rng([seed, 9006])
    confusables, others = texts_for(profile, phrase)
    out: list[Speaker] = []
    for d_idx, device in enumerate(DEVICE_PROFILES):
        for u in range(profile.users_per_device + profile.new_users_per_device):
            engine, name = fleet_voice_of(d_idx, u)
            voice = fleet_voice(rng, engine, name)
            n_conf = min(profile.confusables_per_speaker, len(confusables))
            conf = tuple(
                confusables[j] for j in sorted(rng.choice(len(confusables), n_conf, replace=False))
            )
            n_oth = min(profile.others_per_speaker, len(others))
            oth = tuple(others[j] for j in sorted(rng.choice(len(others), n_oth, replace=False)))
            new = u >= profile.users_per_device
            sid = f"{device}{NEW_USER_TAG if new else '-user'}{u:02d}"
            for split in ("test",) if new else SPLITS:
                take = voice if split == "train" else other_take(rng, voice)
                out.append(Speaker(sid, take, split, conf, oth))
    return out
