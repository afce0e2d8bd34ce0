"""Build the synthetic federated wake-word corpus: five device types A-E, clips of exactly
one model window (1.5 s at 16 kHz) and long negative streams, with `manifest.csv` at the root.

Every clip draws its randomness from a generator seeded by (seed, device type, kind, split,
index), so the same seed and profile give byte-identical files whatever the order of work."""

from __future__ import annotations

import csv
import json
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import soundfile as sf

from wakefl.errors import ConfigError
from wakefl.progress_bars import bar_disabled
from wakefl.sdk.manifest import CLIP_SAMPLES, SAMPLE_RATE, ManifestRow, write_manifest
from wakefl.tools.acoustics.background_sounds import ambient_noise, background_for_state
from wakefl.tools.acoustics.device_acoustics import DEVICE_PROFILES, capture, reverberate, scale_to
from wakefl.tools.acoustics.field_capture import FieldAcoustics, FieldForSome
from wakefl.tools.acoustics.room_impulse import exponential_rir
from wakefl.tools.corpus.plan import (
    FIELD_ACOUSTICS_PROFILES,
    LEAD_IN_FILLERS,
    POSITIVE_CONTENTS,
    PROFILES,
    SPLITS,
    STATES,
    ClipRecipe,
    CorpusProfile,
    Speaker,
    clip_counts,
    clip_recipes,
    phrase_variants,
    stream_counts,
)
from wakefl.tools.corpus.speakers import (
    fleet_device_of,
    is_new_user,
    make_speakers,
    make_unseen_speakers,
)
from wakefl.tools.corpus.speech_synthesis import Voice, synthesize_many
from wakefl.tools.corpus.transcripts import StreamUtterance, transcript_path, write_transcript
from wakefl.tools.corpus.word_timing import run_together

_KIND_CLIP, _KIND_STREAM, _KIND_ROOM = 0, 1, 2
# Added to the kinds above for the unseen-voices corpus, so its draws never repeat the main one's.
_UNSEEN_KIND_OFFSET = 10
UNSEEN_DIR = "unseen"
# The fleet profile's test corpus of the users kept out of their device type's training data.
NEW_USERS_DIR = "new-users"
_NEW_USERS_KIND_OFFSET = 30
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


def resolve_profile(profile: str | CorpusProfile) -> CorpusProfile:
    if isinstance(profile, CorpusProfile):
        return profile
    if profile not in PROFILES:
        raise ConfigError(
            f"unknown corpus profile {profile!r}; choose one of {', '.join(PROFILES)}"
        )
    return PROFILES[profile]


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
    speech with pauses, over the state's background. Returns (wave, state, transcript)."""
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
        content = "conf" if rng.random() < 0.4 else "other"
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


def _prepare_out_dir(out: Path) -> None:
    """Rebuild a previous corpus in place, but never write into a folder that holds other files."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not (out / CORPUS_INFO).is_file():
            raise ConfigError(
                f"--out {out} is not empty and holds no wakefl corpus; choose an empty or new folder"
            )
        for sub in ("clips", "streams", UNSEEN_DIR, NEW_USERS_DIR):
            shutil.rmtree(out / sub, ignore_errors=True)
        for f in ("manifest.csv", "speakers.csv", CORPUS_INFO):
            (out / f).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def _render_clips(
    ctx: CorpusContext, recipes: list[ClipRecipe], out: Path, progress: bool, desc: str
) -> list[ManifestRow]:
    from tqdm import tqdm

    rows: list[ManifestRow] = []
    for r in tqdm(recipes, desc=desc, unit="clip", disable=bar_disabled(progress)):
        wave, speaker_id = render_clip(ctx, r)
        rel = f"clips/{r.device_type}/{r.split}/{r.device_type}_{r.split}_{r.index:05d}_{r.content}.wav"
        write_wav(out / rel, wave)
        rows.append(
            ManifestRow(rel, int(r.content in POSITIVE_CONTENTS), r.device_type, r.state, speaker_id, r.split,
                        CLIP_SAMPLES / SAMPLE_RATE, "clip")
        )  # fmt: skip
    return rows


def _render_streams(
    ctx: CorpusContext, counts: dict[str, int], out: Path, progress: bool
) -> list[ManifestRow]:
    """`counts[split]` streams per device type, from that split's speakers. Test streams keep
    their historical file names; training and validation streams carry their split."""
    from tqdm import tqdm

    jobs = [(sp, d, i) for sp in SPLITS for d in DEVICE_PROFILES for i in range(counts.get(sp, 0))]
    rows: list[ManifestRow] = []
    for sp, d, i in tqdm(jobs, desc="streams", unit="stream", disable=bar_disabled(progress)):
        wave, state, transcript = render_stream(ctx, d, i, sp)
        name = f"{d}_stream_{i:03d}.wav" if sp == "test" else f"{d}_{sp}_stream_{i:03d}.wav"
        rows.append(write_stream(out, f"streams/{d}/{name}", wave, transcript, d, state, sp))
    return rows


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


def _build_unseen(
    out: Path,
    seed: int,
    prof: CorpusProfile,
    phrase: str,
    phrases: tuple[str, ...],
    progress: bool,
    tts_cache_dir: Path | None,
) -> Path:
    """The unseen-voices test corpus in `out/unseen/`: test clips and streams spoken only by
    voices that no training, validation or test clip of the main corpus uses."""
    speakers = make_unseen_speakers(seed, prof, phrase)
    fillers = LEAD_IN_FILLERS if {"pos_run", "conf_run"} & set(prof.contents) else ()
    texts = [(*phrases, *s.confusables, *s.others, *fillers) for s in speakers]
    jobs = [(s.voice, t) for s, said in zip(speakers, texts, strict=True) for t in said]
    speech = synthesize_many(jobs, tts_cache_dir, progress=progress)
    sub = replace(prof, test_clips=prof.unseen_test_clips)
    ctx = CorpusContext(
        seed, sub, {"test": speakers}, speech, phrases, kind_offset=_UNSEEN_KIND_OFFSET
    )
    recipes = [r for r in clip_recipes(seed + _UNSEEN_KIND_OFFSET, sub) if r.split == "test"]
    udir = out / UNSEEN_DIR
    udir.mkdir(parents=True, exist_ok=True)
    rows = _render_clips(ctx, recipes, udir, progress, "clips (unseen voices)")
    rows += _render_streams(ctx, {"test": prof.unseen_streams_per_device}, udir, progress)
    write_speakers(udir / "speakers.csv", speakers)
    (udir / CORPUS_INFO).write_text(
        corpus_info(seed, prof, phrase, subset="unseen-voices"), encoding="utf-8"
    )
    return write_manifest(rows, udir / "manifest.csv")


def _build_new_users(
    out: Path, ctx: CorpusContext, progress: bool, tts_cache_dir: Path | None
) -> Path:
    """The fleet's new-users test corpus in `out/new-users/`: test clips of each device
    type's users that its training, validation and test data never hear."""
    prof, speakers = ctx.profile, ctx.speakers["test"]
    jobs = [(s.voice, t) for s in speakers for t in (*ctx.phrases, *s.confusables, *s.others)]
    speech = synthesize_many(jobs, tts_cache_dir, progress=progress)
    sub = replace(prof, train_unit=0, val_clips=0, test_clips=prof.new_user_test_clips)
    nctx = replace(ctx, profile=sub, speech=speech, kind_offset=_NEW_USERS_KIND_OFFSET, rooms={})
    recipes = [r for r in clip_recipes(ctx.seed + _NEW_USERS_KIND_OFFSET, sub) if r.split == "test"]
    ndir = out / NEW_USERS_DIR
    ndir.mkdir(parents=True, exist_ok=True)
    rows = _render_clips(nctx, recipes, ndir, progress, "clips (new users)")
    write_speakers(ndir / "speakers.csv", speakers)
    (ndir / CORPUS_INFO).write_text(
        corpus_info(ctx.seed, prof, " ".join(ctx.phrases[0].split()), subset="new-users"),
        encoding="utf-8",
    )
    return write_manifest(rows, ndir / "manifest.csv")


def texts_said(prof: CorpusProfile, speaker: Speaker, phrases: tuple[str, ...]) -> list[str]:
    """What `speaker` may say in a corpus of `prof`: only what its split's clips and
    streams use (streams hold confusables and other speech)."""
    clips = sum(c[speaker.split] for c in clip_counts(prof).values())
    streams = stream_counts(prof)[speaker.split]
    kinds = (set(prof.contents) if clips else set()) | ({"conf", "other"} if streams else set())
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


def read_corpus_info(folder: Path) -> object | None:
    """The parsed corpus.json of a finished build in `folder`, or None when it is missing
    or unreadable (a folder that is not a finished synthetic build)."""
    try:
        return json.loads((Path(folder) / CORPUS_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def build_corpus(
    out_dir: str | Path,
    seed: int = 0,
    profile: str | CorpusProfile = "tiny",
    phrase: str = "hey nova",
    progress: bool = True,
    tts_cache_dir: str | Path | None = None,
) -> Path:
    """Synthesize the corpus into `out_dir` and return the path of its `manifest.csv`. A
    profile with unseen speakers also writes the unseen-voices corpus to `out_dir/unseen/`."""
    prof = resolve_profile(profile)
    phrase = " ".join(phrase.lower().split())
    if not phrase or not all(c.isalpha() or c in " '-" for c in phrase):
        raise ConfigError(f"the wake phrase must be words of letters, got {phrase!r}")
    out = Path(out_dir)
    _prepare_out_dir(out)
    cache = Path(tts_cache_dir) if tts_cache_dir else None
    if prof.name in FIELD_ACOUSTICS_PROFILES:
        from wakefl.tools.corpus.field_corpus import build_field_corpus  # it builds on this module

        return build_field_corpus(out, seed, prof, phrase, progress, cache)
    acoustics = acoustics_named(prof.acoustics, prof.name)
    everyone = make_speakers(seed, prof, phrase)
    speakers = [s for s in everyone if not is_new_user(s.speaker_id)]
    phrases = phrase_variants(phrase)
    jobs = [(s.voice, t) for s in speakers for t in texts_said(prof, s, phrases)]
    speech = synthesize_many(jobs, cache, progress=progress)
    by_split = {sp: [s for s in speakers if s.split == sp] for sp in SPLITS}
    ctx = CorpusContext(
        seed, prof, by_split, speech, phrases, kind_offset=prof.draw_offset,
        acoustics=acoustics,
    )  # fmt: skip

    recipes = clip_recipes(seed + prof.draw_offset, prof)
    rows = _render_clips(ctx, recipes, out, progress, f"clips ({prof.name})")
    rows += _render_streams(ctx, stream_counts(prof), out, progress)
    write_speakers(out / "speakers.csv", speakers)
    if prof.unseen_speakers > 0:
        _build_unseen(out, seed, prof, phrase, phrases, progress, cache)
    new_users = [s for s in everyone if is_new_user(s.speaker_id)]
    if new_users and prof.new_user_test_clips > 0:
        _build_new_users(out, replace(ctx, speakers={"test": new_users}), progress, cache)
    # Written last: its presence marks a finished build.
    (out / CORPUS_INFO).write_text(corpus_info(seed, prof, phrase), encoding="utf-8")
    return write_manifest(rows, out / "manifest.csv")
