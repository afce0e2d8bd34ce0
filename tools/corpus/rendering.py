"""The pieces a synthetic corpus is rendered from: the acoustics a device hears through, the
speech a speaker says (alone, in a window or in running speech), clips and negative streams
as a device records them, and the files they are written to (WAVs, transcripts, speakers.csv,
corpus.json). `build.py` assembles the corpora from them, `field_corpus.py` the corpus of the
held-out acoustic simulation.

Every clip draws its randomness from a generator seeded by (seed, device type, kind, split,
index), so the same seed and profile give byte-identical files whatever the order of work."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import soundfile as sf

from wakefl.errors import ConfigError
from wakefl.sdk.manifest import CLIP_SAMPLES, SAMPLE_RATE, ManifestRow
from wakefl.tools.acoustics.background_sounds import ambient_noise, background_for_state
from wakefl.tools.acoustics.device_acoustics import DEVICE_PROFILES, capture, reverberate, scale_to
from wakefl.tools.acoustics.field_capture import FieldAcoustics, FieldForSome
from wakefl.tools.acoustics.room_impulse import exponential_rir
from wakefl.tools.corpus.plan import (
    LEAD_IN_FILLERS,
    SPLITS,
    STATES,
    ClipRecipe,
    CorpusProfile,
    Speaker,
    clip_counts,
    stream_counts,
)
from wakefl.tools.corpus.speakers import (
    fleet_device_of,
)
from wakefl.tools.corpus.speech_synthesis import Voice
from wakefl.tools.corpus.transcripts import StreamUtterance, transcript_path, write_transcript
from wakefl.tools.corpus.word_timing import run_together

_KIND_CLIP, _KIND_STREAM, _KIND_ROOM = 0, 1, 2
UNSEEN_DIR = "unseen"
_DEVICE_INDEX = {name: i for i, name in enumerate(DEVICE_PROFILES)}
_MAX_PHRASE_S = 1.4  # the phrase must fit in the 1.5 s window with a margin
_EDGE_S = 0.04
_SPEECH_LEVEL_DB = (-32.0, -20.0)  # acoustic speech level at the device, dBFS RMS
_STATE_SNR_FALLBACK = (5.0, 15.0)
CORPUS_INFO = "corpus.json"


class Acoustics(Protocol):
    """How a device hears a sound field: the rooms it stands in and its capture chain (a
    corpus profile names one in `ACOUSTICS`; another simulator plugs in there)."""

    def room(self, seed: int, device: str, index: int) -> np.ndarray:
        """Room impulse response `index` of `device`'s rooms, a function of the seed."""
        ...

    def capture(self, rng: np.random.Generator, device: str, field_: np.ndarray) -> np.ndarray:
        """The recording `device` makes of the acoustic field at its microphone."""
        ...


class DeviceAcoustics:
    """The device types' own acoustics (tools/acoustics/device_acoustics.py): exponential-decay
    rooms with the type's RT60 and direct-to-reverberant ratio, its microphone, gain,
    clipping and sensor noise."""

    def room(self, seed: int, device: str, index: int) -> np.ndarray:
        prof = DEVICE_PROFILES[device]
        rng = np.random.default_rng([seed, _DEVICE_INDEX[device], _KIND_ROOM, index])
        return exponential_rir(rng, rng.uniform(*prof.rt60_s), rng.uniform(*prof.drr_db))

    def capture(self, rng: np.random.Generator, device: str, field_: np.ndarray) -> np.ndarray:
        return capture(rng, DEVICE_PROFILES[device], field_)


# Acoustic simulators by the name a profile gives (`CorpusProfile.acoustics`).
# "field": the second, held-out simulation's rooms and front ends (tools/acoustics/field_capture.py).
ACOUSTICS: dict[str, Acoustics] = {"device": DeviceAcoustics(), "field": FieldAcoustics()}


def acoustics_named(name: str, profile: str = "") -> Acoustics:
    """The acoustics a profile names: a key of ACOUSTICS, or "field:<types>" (e.g.
    "field:BD") for the field simulation on those device types and the device types' own
    on the rest."""
    if name in ACOUSTICS:
        return ACOUSTICS[name]
    kind, _, types = name.partition(":")
    if kind == "field" and types and set(types) <= set(DEVICE_PROFILES):
        return FieldForSome(frozenset(types), ACOUSTICS["device"])
    raise ConfigError(
        f"profile {profile}: unknown acoustics {name!r}; one of {', '.join(ACOUSTICS)}, or "
        f"field:<device types> (of {''.join(DEVICE_PROFILES)})"
    )


@dataclass
class CorpusContext:
    seed: int
    profile: CorpusProfile
    speakers: dict[str, list[Speaker]]  # by split
    speech: dict[tuple[Voice, str], np.ndarray]
    phrases: tuple[str, ...]
    rooms: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    kind_offset: int = 0
    acoustics: Acoustics = field(default_factory=DeviceAcoustics)

    def room(self, device: str, index: int) -> np.ndarray:
        key = (device, index)
        if key not in self.rooms:
            self.rooms[key] = self.acoustics.room(self.seed, device, index)
        return self.rooms[key]

    def pool(self, device: str, split: str) -> list[Speaker]:
        """Who speaks on `device` in `split`: the split's speakers, or in a fleet (each
        device type has its own users) the device type's."""
        if self.profile.voice_set != "fleet":
            return self.speakers[split]
        return [s for s in self.speakers[split] if fleet_device_of(s.speaker_id) == device]


def change_speed(x: np.ndarray, factor: float) -> np.ndarray:
    """Play `x` `factor` times faster (tempo and pitch together, like a tape)."""
    n_out = max(1, int(round(x.size / factor)))
    return np.interp(np.arange(n_out) * factor, np.arange(x.size), x)


def said(
    ctx: CorpusContext, rng: np.random.Generator, speaker: Speaker, content: str
) -> tuple[str, np.ndarray]:
    """What `speaker` says for `content`, and its speech."""
    if content == "pos":
        text = ctx.phrases[int(rng.integers(len(ctx.phrases)))]
    elif content == "conf":
        text = speaker.confusables[int(rng.integers(len(speaker.confusables)))]
    else:
        text = speaker.others[int(rng.integers(len(speaker.others)))]
    speech = ctx.speech[(speaker.voice, text)]
    pace = ctx.profile.first_word_pace
    if content == "pos" and pace is not None:
        speech = run_together(speech, text, float(rng.uniform(*pace)))
    return text, change_speed(speech, rng.uniform(0.92, 1.08))


def _utterance(
    ctx: CorpusContext, rng: np.random.Generator, speaker: Speaker, content: str
) -> np.ndarray:
    return said(ctx, rng, speaker, content)[1]


def _gap_s(rng: np.random.Generator, ranges: tuple[tuple[float, float, float], ...]) -> float:
    """A pause drawn from (probability, low, high) ranges. A negative pause overlaps the
    utterances' trimmed margins: the words run into each other as in one breath."""
    pick = rng.choice(len(ranges), p=[r[0] for r in ranges])
    return float(rng.uniform(ranges[pick][1], ranges[pick][2]))


# Pause before the phrase (after the lead-in) and after it (before the command): most often
# none at all, as users say "hey nova, turn on the lights" in one breath.
_GAP_BEFORE = ((0.5, -0.05, 0.1), (0.3, 0.1, 0.4), (0.2, 0.4, 1.0))
_GAP_AFTER = ((0.6, -0.05, 0.1), (0.4, 0.1, 0.3))


def join_utterances(parts: list[np.ndarray], gaps: list[float]) -> tuple[np.ndarray, list[int]]:
    """Utterances one after another with the given pauses (overlap-added where a pause is
    negative); returns the speech and each part's start sample."""
    starts: list[int] = []
    t = 0
    for k, part in enumerate(parts):
        if k:
            t = max(starts[-1], t + int(round(gaps[k - 1] * SAMPLE_RATE)))
        starts.append(t)
        t += part.size
    out = np.zeros(max(s + p.size for s, p in zip(starts, parts, strict=True)))
    for start, part in zip(starts, parts, strict=True):
        out[start : start + part.size] += part
    return out, starts


def _said_in_running_speech(
    ctx: CorpusContext, rng: np.random.Generator, speaker: Speaker, content: str
) -> tuple[np.ndarray, int, int]:
    """The phrase (pos_run) or a confusable (conf_run) with speech before it (a sentence or
    a filler, now and then none) and a command after it (now and then none), spliced from
    the speaker's own utterances. Returns the speech and where the phrase starts and ends."""
    core = said(ctx, rng, speaker, "pos" if content == "pos_run" else "conf")[1]
    lead_kind = rng.random()
    parts, gaps, at = [core], [], 0
    if lead_kind < 0.85:
        pool = LEAD_IN_FILLERS if lead_kind < 0.3 else speaker.others
        lead = ctx.speech[(speaker.voice, pool[int(rng.integers(len(pool)))])]
        parts, gaps, at = [lead, core], [_gap_s(rng, _GAP_BEFORE)], 1
    if rng.random() < 0.9:
        command = ctx.speech[
            (speaker.voice, speaker.others[int(rng.integers(len(speaker.others)))])
        ]
        parts.append(command)
        gaps.append(_gap_s(rng, _GAP_AFTER))
    speech, starts = join_utterances(parts, gaps)
    factor = rng.uniform(0.92, 1.08)
    speech = change_speed(speech, factor)
    return speech, int(starts[at] / factor), int((starts[at] + core.size) / factor)


def place_in_running_speech(
    rng: np.random.Generator, speech: np.ndarray, start: int, end: int
) -> np.ndarray:
    """A window of running speech holding [start, end) whole at a random position."""
    length = end - start
    if length > _MAX_PHRASE_S * SAMPLE_RATE:
        factor = length / (_MAX_PHRASE_S * SAMPLE_RATE)
        speech = change_speed(speech, factor)
        start, end = int(start / factor), int(start / factor) + int(_MAX_PHRASE_S * SAMPLE_RATE)
    edge = int(_EDGE_S * SAMPLE_RATE)
    lo, hi = end + edge - CLIP_SAMPLES, start - edge
    offset = int(rng.integers(lo, max(lo, hi) + 1))
    out = np.zeros(CLIP_SAMPLES)
    src_lo, src_hi = max(0, offset), min(speech.size, offset + CLIP_SAMPLES)
    out[src_lo - offset : src_hi - offset] = speech[src_lo:src_hi]
    return out


def _dry_speech(
    ctx: CorpusContext, rng: np.random.Generator, speaker: Speaker, content: str
) -> np.ndarray:
    """The window's dry speech for a clip of `content`."""
    if content in ("pos_run", "conf_run"):
        speech, start, end = _said_in_running_speech(ctx, rng, speaker, content)
        return place_in_running_speech(rng, speech, start, end)
    return place_in_window(rng, _utterance(ctx, rng, speaker, content), content)


def place_in_window(rng: np.random.Generator, speech: np.ndarray, content: str) -> np.ndarray:
    """Put the utterance somewhere in the window. The wake phrase always fits whole; other
    speech longer than the window is cut at a random point."""
    out = np.zeros(CLIP_SAMPLES)
    if content == "pos" and speech.size > _MAX_PHRASE_S * SAMPLE_RATE:
        speech = change_speed(speech, speech.size / (_MAX_PHRASE_S * SAMPLE_RATE))
    edge = int(_EDGE_S * SAMPLE_RATE)
    if speech.size <= CLIP_SAMPLES - 2 * edge:
        start = int(rng.integers(edge, CLIP_SAMPLES - edge - speech.size + 1))
        out[start : start + speech.size] = speech
    elif speech.size <= CLIP_SAMPLES:
        start = int(rng.integers(0, CLIP_SAMPLES - speech.size + 1))
        out[start : start + speech.size] = speech
    else:
        cut = int(rng.integers(0, speech.size - CLIP_SAMPLES + 1))
        out[:] = speech[cut : cut + CLIP_SAMPLES]
    return out


def render_clip(ctx: CorpusContext, recipe: ClipRecipe) -> tuple[np.ndarray, str]:
    """One 1.5 s clip as recorded by the recipe's device; returns (wave, speaker id)."""
    dev = DEVICE_PROFILES[recipe.device_type]
    rng = np.random.default_rng(
        [ctx.seed, _DEVICE_INDEX[recipe.device_type], _KIND_CLIP + ctx.kind_offset,
         SPLITS.index(recipe.split), recipe.index]
    )  # fmt: skip
    room = ctx.room(recipe.device_type, int(rng.integers(ctx.profile.rooms_per_device)))
    ref_db = rng.uniform(*_SPEECH_LEVEL_DB)
    field_ = scale_to(
        ambient_noise(rng, CLIP_SAMPLES, dev.ambient_exponent), ref_db + dev.noise_floor_db
    )
    background = background_for_state(rng, recipe.state, CLIP_SAMPLES)
    if recipe.content == "bg":
        speaker_id = f"nospeech-{recipe.split}"
        if background is not None:
            field_ += scale_to(reverberate(background, room), ref_db)
    else:
        pool = ctx.pool(recipe.device_type, recipe.split)
        speaker = pool[int(rng.integers(len(pool)))]
        speaker_id = speaker.speaker_id
        dry = _dry_speech(ctx, rng, speaker, recipe.content)
        field_ += scale_to(reverberate(dry, room), ref_db)
        if background is not None:
            snr = rng.uniform(*dev.snr_db.get(recipe.state, _STATE_SNR_FALLBACK))
            field_ += scale_to(reverberate(background, room), ref_db - snr)
    return ctx.acoustics.capture(rng, recipe.device_type, field_), speaker_id


def on_off_gate(
    rng: np.random.Generator, n: int, on_s: tuple[float, float], off_s: tuple[float, float]
) -> np.ndarray:
    """On/off bursts, for alarms that ring for a while and stop."""
    gate = np.zeros(n)
    t = int(rng.uniform(*off_s) * SAMPLE_RATE)
    while t < n:
        on = int(rng.uniform(*on_s) * SAMPLE_RATE)
        gate[t : t + on] = 1.0
        t += on + int(rng.uniform(*off_s) * SAMPLE_RATE)
    ramp = int(0.02 * SAMPLE_RATE)
    return np.convolve(gate, np.ones(ramp) / ramp, mode="same")


def render_stream(
    ctx: CorpusContext, device: str, index: int, split: str = "test"
) -> tuple[np.ndarray, str, list[StreamUtterance]]:
    """A long negative recording: the split's speakers saying confusable phrases and other
    speech (confusables only, where the profile's contents lack "other") with pauses, over
    the state's background. Returns (wave, state, transcript)."""
    dev = DEVICE_PROFILES[device]
    d_idx = _DEVICE_INDEX[device]
    key = [ctx.seed, d_idx, _KIND_STREAM + ctx.kind_offset, index]
    # Test streams keep the key they always had, so existing corpora do not change.
    rng = np.random.default_rng(key if split == "test" else [*key, SPLITS.index(split) + 1])
    state = STATES[(index + d_idx) % len(STATES)]
    n = int(ctx.profile.stream_seconds * SAMPLE_RATE)
    room = ctx.room(device, int(rng.integers(ctx.profile.rooms_per_device)))
    ref_db = float(np.mean(_SPEECH_LEVEL_DB))
    dry = np.zeros(n)
    pool = ctx.pool(device, split)
    t = int(rng.uniform(0.2, 2.0) * SAMPLE_RATE)
    transcript: list[StreamUtterance] = []
    while t < n:
        speaker = pool[int(rng.integers(len(pool)))]
        # The draw is made either way, so a corpus with other speech keeps its streams.
        near_rhyme = rng.random() < 0.4 or "other" not in stream_kinds(ctx.profile)
        content = "conf" if near_rhyme else "other"
        text, speech = said(ctx, rng, speaker, content)
        utt = scale_to(speech, rng.uniform(*_SPEECH_LEVEL_DB))
        seg = utt[: n - t]
        dry[t : t + seg.size] += seg
        transcript.append(
            StreamUtterance(
                t / SAMPLE_RATE, (t + seg.size) / SAMPLE_RATE, speaker.speaker_id, content, text
            )
        )
        # Conversational pauses, and now and then a long quiet stretch.
        t += seg.size + int(
            (rng.uniform(0.3, 2.5) if rng.random() < 0.8 else rng.uniform(4.0, 12.0)) * SAMPLE_RATE
        )
    field_ = reverberate(dry, room)
    field_ += scale_to(ambient_noise(rng, n, dev.ambient_exponent), ref_db + dev.noise_floor_db)
    background = background_for_state(rng, state, n)
    if background is not None:
        if state == "alarm":
            background = background * on_off_gate(rng, n, (3.0, 8.0), (5.0, 15.0))
        snr = rng.uniform(*dev.snr_db.get(state, _STATE_SNR_FALLBACK))
        field_ += scale_to(reverberate(background, room), ref_db - snr)
    return ctx.acoustics.capture(rng, device, field_), state, transcript


def write_wav(path: Path, wave: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(
        str(path), np.asarray(wave, dtype=np.float32), SAMPLE_RATE, subtype="PCM_16", format="WAV"
    )


def write_stream(
    out: Path,
    rel: str,
    wave: np.ndarray,
    transcript: list[StreamUtterance],
    device: str,
    state: str,
    split: str,
) -> ManifestRow:
    """Write a rendered negative stream and its transcript under `out`; its manifest row."""
    write_wav(out / rel, wave)
    write_transcript(transcript_path(out / rel), transcript)
    return ManifestRow(
        rel, 0, device, state, f"mixed-{split}", split, wave.size / SAMPLE_RATE, "stream"
    )


def write_speakers(path: Path, speakers: list[Speaker]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["speaker", "split", "engine", "voice", "variant", "rate", "pitch"])
        for s in speakers:
            v = s.voice
            w.writerow([s.speaker_id, s.split, v.engine, v.voice, v.variant, v.rate, v.pitch])


def voice_families(manifest: Path) -> dict[str, str]:
    """speaker -> "engine:voice" from the speakers.csv (`write_speakers`) a built corpus has
    beside its manifest; empty for a corpus without one (imported recordings)."""
    path = manifest.parent / "speakers.csv"
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if not {"speaker", "engine", "voice"} <= set(reader.fieldnames or ()):
            return {}  # some other table of speakers: no voice families to report
        return {r["speaker"]: f"{r['engine']}:{r['voice']}" for r in reader}


def corpus_info(seed: int, prof: CorpusProfile, phrase: str, **extra: object) -> str:
    info = {
        "generator": "wakefl corpus build",
        "seed": seed,
        "profile": asdict(prof),
        "phrase": phrase,
        "sample_rate": SAMPLE_RATE,
        "clip_samples": CLIP_SAMPLES,
        "device_types": {k: v.description for k, v in DEVICE_PROFILES.items()},
        **extra,
    }
    return json.dumps(info, indent=2, sort_keys=True) + "\n"


def stream_kinds(prof: CorpusProfile) -> set[str]:
    """What a profile's negative streams hold: confusables and other speech, or confusables
    alone where its contents lack "other"."""
    return {"conf", "other"} if "other" in prof.contents else {"conf"}


def texts_said(prof: CorpusProfile, speaker: Speaker, phrases: tuple[str, ...]) -> list[str]:
    """What `speaker` may say in a corpus of `prof`: only what its split's clips and
    streams use (`stream_kinds`)."""
    clips = sum(c[speaker.split] for c in clip_counts(prof).values())
    streams = stream_counts(prof)[speaker.split]
    kinds = (set(prof.contents) if clips else set()) | (stream_kinds(prof) if streams else set())
    if kinds & {"pos_run", "conf_run"}:
        # Running speech: the phrase or a confusable between the speaker's own sentences.
        kinds |= {"other", "filler", "pos" if "pos_run" in kinds else "conf"}
        kinds |= {"conf"} if "conf_run" in kinds else set()
    texts = {
        "pos": phrases,
        "conf": speaker.confusables,
        "other": speaker.others,
        "filler": LEAD_IN_FILLERS,
    }
    return [t for k in ("pos", "conf", "other", "filler") if k in kinds for t in texts[k]]
