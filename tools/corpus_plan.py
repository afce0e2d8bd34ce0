"""What a synthetic corpus holds, decided before any audio is made: profiles (sizes),
synthetic speakers and their splits, the texts, and each clip's recipe. Pure functions of
the seed, so the plan (and with it the audio) never depends on generation order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wakefl.tools.device_acoustics import DEVICE_PROFILES
from wakefl.tools.speech_synthesis import ESPEAK_VARIANTS, ESPEAK_VOICES, FLITE_VOICES, Voice

STATES = ("normal", "playback", "alarm")
SPLITS = ("train", "val", "test")
SPEAKER_SHARE = {"train": 0.7, "val": 0.15, "test": 0.15}
# Clip content mix: wake phrase, confusable phrase, other speech, background only.
CONTENT_SHARE = {"pos": 0.45, "conf": 0.25, "other": 0.15, "bg": 0.15}

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


PROFILES: dict[str, CorpusProfile] = {
    "tiny": CorpusProfile("tiny", 48, 40, 16, 24, 1, 40.0),
    # Held-out sets far larger than the training unit: the paper study's relative FA is a
    # ratio of false-accept counts, and its intervals are only as narrow as those counts.
    "small": CorpusProfile("small", 200, 240, 480, 960, 3, 70.0),
    "full": CorpusProfile("full", 240, 800, 480, 960, 6, 250.0, 10, 10, 32),
}


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
        out += [" ".join(reversed(words)), words[0] + " there", "the " + words[-1], words[0] + " no"]
    out += ["say " + words[-1] + " again"]
    return tuple(w for w in dict.fromkeys(out) if w.strip().lower() != phrase.strip().lower())


def _allocate(total: int, shares: dict[str, float], minimum: int = 0) -> dict[str, int]:
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


def make_speakers(seed: int, profile: CorpusProfile, phrase: str) -> list[Speaker]:
    """Synthetic speakers, each a distinct voice and prosody, assigned to disjoint splits
    (stratified by engine, so every split hears both synthesisers)."""
    rng = np.random.default_rng([seed, 9001])
    n_flite = max(3, profile.n_speakers // 4)
    n_espeak = profile.n_speakers - n_flite
    pairs = [(v, var) for v in ESPEAK_VOICES for var in ESPEAK_VARIANTS]
    chosen = rng.choice(len(pairs), size=min(n_espeak, len(pairs)), replace=False)
    espeak = [
        Voice("espeak-ng", pairs[i][0], pairs[i][1], int(rng.integers(125, 196)), int(rng.integers(25, 76)))
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
        counts = _allocate(len(group), SPEAKER_SHARE, minimum=1)
        order = rng.permutation(len(group))
        pos = 0
        for split in SPLITS:
            for i in order[pos : pos + counts[split]]:
                conf = rng.choice(len(confusables), size=min(profile.confusables_per_speaker, len(confusables)), replace=False)
                oth = rng.choice(len(OTHER_SPEECH), size=min(profile.others_per_speaker, len(OTHER_SPEECH)), replace=False)
                speakers.append(
                    Speaker(
                        "", group[i], split,
                        tuple(confusables[j] for j in sorted(conf)),
                        tuple(OTHER_SPEECH[j] for j in sorted(oth)),
                    )  # fmt: skip
                )
            pos += counts[split]
    speakers.sort(key=lambda s: (SPLITS.index(s.split), s.voice.describe()))
    return [
        Speaker(f"spk{i:03d}", s.voice, s.split, s.confusables, s.others) for i, s in enumerate(speakers)
    ]


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


def clip_recipes(seed: int, profile: CorpusProfile) -> list[ClipRecipe]:
    """Each clip's content and device state. Validation and test sets hold every state for
    every content kind when large enough, so both labels meet all three states."""
    recipes: list[ClipRecipe] = []
    for d_idx, (name, dev) in enumerate(DEVICE_PROFILES.items()):
        for s_idx, split in enumerate(SPLITS):
            n = clip_counts(profile)[name][split]
            slots: list[tuple[str, str]] = []
            for content, k in _allocate(n, CONTENT_SHARE).items():
                minimum = 1 if split != "train" else 0
                states = _allocate(k, dict(zip(STATES, dev.state_probs, strict=True)), minimum)
                slots += [(content, st) for st, m in states.items() for _ in range(m)]
            order = np.random.default_rng([seed, d_idx, 7, s_idx]).permutation(len(slots))
            recipes += [ClipRecipe(name, split, i, *slots[j]) for i, j in enumerate(order)]
    return recipes
