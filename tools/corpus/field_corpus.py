"""The held-out-acoustics add-on (`wakefl corpus build --profile pretrain-acoustics`): the
pretraining corpus's validation and test speakers, and its unseen voices, recorded by the
field devices of tools/acoustics/field_acoustics.py instead of the training devices A-E.

Same format as every corpus (manifest.csv, clips/, streams/ with transcripts, unseen/,
speakers.csv, corpus.json) and the same determinism: each clip, stream and room draws from a
generator seeded by (seed, device type, kind, ...), with kinds of its own, so nothing here
repeats a draw of the main corpus. Built with the main corpus's seed, its speakers and
splits are the main corpus's; what changes is the rooms, the noise and the devices."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from wakefl.progress_bars import bar_disabled
from wakefl.sdk.manifest import CLIP_SAMPLES, SAMPLE_RATE, ManifestRow, write_manifest
from wakefl.tools.acoustics.field_acoustics import (
    FIELD_DEVICES,
    HELD_OUT_ROOMS,
    STATE_NOISES,
    ImageSourceRoom,
    background,
    field_capture,
    image_source_room,
)
from wakefl.tools.corpus.plan import (
    SPLITS,
    STATES,
    ClipRecipe,
    CorpusProfile,
    Speaker,
    clip_recipes,
    phrase_variants,
    stream_counts,
)
from wakefl.tools.corpus.rendering import (
    CORPUS_INFO,
    UNSEEN_DIR,
    CorpusContext,
    corpus_info,
    on_off_gate,
    place_in_window,
    said,
    texts_said,
    write_speakers,
    write_stream,
    write_wav,
)
from wakefl.tools.corpus.speakers import make_speakers, make_unseen_speakers
from wakefl.tools.corpus.speech_synthesis import synthesize_many
from wakefl.tools.corpus.transcripts import StreamUtterance

# Generator kinds of this add-on: apart from corpus_build's (0-2, +10 for unseen voices).
_KIND_CLIP, _KIND_STREAM = 31, 32
_UNSEEN_OFFSET = 10
_DEVICE_INDEX = {name: i for i, name in enumerate(FIELD_DEVICES)}
_QUIET_SHARE = 0.3  # of normal-state recordings: only the room's own hiss, no background
_BABBLE_POOL = 12  # utterances a clip's background talkers draw from


class _Field:
    """What rendering needs beyond corpus_build's context: the field rooms (made on first
    use: about a second each) and each split's pool of background speech."""

    def __init__(self, ctx: CorpusContext, kind_offset: int) -> None:
        self.ctx = ctx
        self.kind_offset = kind_offset
        self.rooms: dict[tuple[str, int], ImageSourceRoom] = {}
        # Only what was synthesized: a split with no clips or streams says nothing.
        self.chatter = {
            split: [
                ctx.speech[k] for s in pool for t in s.others if (k := (s.voice, t)) in ctx.speech
            ]
            for split, pool in ctx.speakers.items()
        }

    def room(self, device: str, index: int) -> ImageSourceRoom:
        key = (device, index)
        if key not in self.rooms:
            dev = FIELD_DEVICES[device]
            rng = np.random.default_rng(
                [self.ctx.seed, _DEVICE_INDEX[device], HELD_OUT_ROOMS, index]
            )
            self.rooms[key] = image_source_room(rng, dev.rt60_s, dev.distance_m)
        return self.rooms[key]

    def noise(
        self, rng: np.random.Generator, state: str, n: int, split: str, need: bool
    ) -> np.ndarray | None:
        """A unit-RMS background of the state's kinds (None: a quiet room, only where the
        recording has speech, `need` False)."""
        if state == "normal" and not need and rng.random() < _QUIET_SHARE:
            return None
        kinds = STATE_NOISES[state]
        kind = kinds[int(rng.integers(len(kinds)))]
        pool = self.chatter[split]
        picks = rng.choice(len(pool), size=min(_BABBLE_POOL, len(pool)), replace=False)
        return background(rng, kind, n, [pool[i] for i in sorted(picks)])


def render_field_clip(field: _Field, recipe: ClipRecipe) -> tuple[np.ndarray, str]:
    """One 1.5 s clip as the recipe's field device records it; (wave, speaker id)."""
    ctx = field.ctx
    d_idx = _DEVICE_INDEX[recipe.device_type]
    rng = np.random.default_rng(
        [ctx.seed, d_idx, _KIND_CLIP + field.kind_offset, SPLITS.index(recipe.split),
         recipe.index]
    )  # fmt: skip
    room = field.room(recipe.device_type, int(rng.integers(ctx.profile.rooms_per_device)))
    speech = None
    speaker_id = f"nospeech-{recipe.split}"
    if recipe.content != "bg":
        pool = ctx.speakers[recipe.split]
        speaker = pool[int(rng.integers(len(pool)))]
        speaker_id = speaker.speaker_id
        speech = place_in_window(rng, said(ctx, rng, speaker, recipe.content)[1], recipe.content)
    noise = field.noise(rng, recipe.state, CLIP_SAMPLES, recipe.split, need=speech is None)
    dev = FIELD_DEVICES[recipe.device_type]
    return field_capture(rng, dev, room, speech, noise), speaker_id


def _stream_speech(
    ctx: CorpusContext, rng: np.random.Generator, n: int, split: str
) -> tuple[np.ndarray, list[StreamUtterance]]:
    """The split's speakers saying confusables and other speech with conversational pauses
    and now and then a long quiet stretch, dry, with its transcript."""
    dry = np.zeros(n)
    pool = ctx.speakers[split]
    t = int(rng.uniform(0.2, 2.0) * SAMPLE_RATE)
    transcript: list[StreamUtterance] = []
    while t < n:
        speaker = pool[int(rng.integers(len(pool)))]
        content = "conf" if rng.random() < 0.4 else "other"
        text, speech = said(ctx, rng, speaker, content)
        seg = speech[: n - t] * 10.0 ** (rng.uniform(-6.0, 6.0) / 20.0)
        dry[t : t + seg.size] += seg / (np.sqrt(np.mean(speech**2)) + 1e-12)
        transcript.append(
            StreamUtterance(
                t / SAMPLE_RATE, (t + seg.size) / SAMPLE_RATE, speaker.speaker_id, content, text
            )
        )
        pause = rng.uniform(0.3, 2.5) if rng.random() < 0.8 else rng.uniform(4.0, 12.0)
        t += seg.size + int(pause * SAMPLE_RATE)
    return dry, transcript


def render_field_stream(
    field: _Field, device: str, index: int, split: str
) -> tuple[np.ndarray, str, list[StreamUtterance]]:
    """A long negative recording of the split's speakers by the field device, over the
    state's background (alarms beep in bursts); (wave, state, transcript)."""
    ctx = field.ctx
    d_idx = _DEVICE_INDEX[device]
    rng = np.random.default_rng(
        [ctx.seed, d_idx, _KIND_STREAM + field.kind_offset, index, SPLITS.index(split)]
    )
    state = STATES[(index + d_idx) % len(STATES)]
    n = int(ctx.profile.stream_seconds * SAMPLE_RATE)
    room = field.room(device, int(rng.integers(ctx.profile.rooms_per_device)))
    dry, transcript = _stream_speech(ctx, rng, n, split)
    noise = field.noise(rng, state, n, split, need=False)
    if noise is not None and state == "alarm":
        noise = noise * on_off_gate(rng, n, (3.0, 8.0), (5.0, 15.0))
    return field_capture(rng, FIELD_DEVICES[device], room, dry, noise), state, transcript


def _render(field: _Field, recipes: list[ClipRecipe], streams: dict[str, int], out: Path,
            progress: bool) -> list[ManifestRow]:  # fmt: skip
    from tqdm import tqdm

    rows: list[ManifestRow] = []
    for r in tqdm(
        recipes, desc="clips (field acoustics)", unit="clip", disable=bar_disabled(progress)
    ):
        wave, speaker_id = render_field_clip(field, r)
        rel = r.path
        write_wav(out / rel, wave)
        rows.append(
            ManifestRow(rel, int(r.content == "pos"), r.device_type, r.state, speaker_id, r.split,
                        CLIP_SAMPLES / SAMPLE_RATE, "clip")
        )  # fmt: skip
    jobs = [(sp, d, i) for sp in SPLITS for d in FIELD_DEVICES for i in range(streams.get(sp, 0))]
    for sp, d, i in tqdm(
        jobs, desc="streams (field acoustics)", unit="stream", disable=bar_disabled(progress)
    ):
        wave, state, transcript = render_field_stream(field, d, i, sp)
        rel = f"streams/{d}/{d}_{sp}_stream_{i:03d}.wav"
        rows.append(write_stream(out, rel, wave, transcript, d, state, sp))
    return rows


def _info(seed: int, prof: CorpusProfile, phrase: str, **extra: object) -> str:
    devices = {k: f"{d.name}: {d.description}" for k, d in FIELD_DEVICES.items()}
    return corpus_info(seed, prof, phrase, acoustics="field", field_devices=devices, **extra)


def _build_part(
    out: Path,
    seed: int,
    prof: CorpusProfile,
    phrase: str,
    speakers: list[Speaker],
    progress: bool,
    cache: Path | None,
    unseen: bool,
) -> list[ManifestRow]:
    """Clips and streams of `speakers` in `out`, with their speakers.csv."""
    phrases = phrase_variants(phrase)
    jobs = [(s.voice, t) for s in speakers for t in texts_said(prof, s, phrases)]
    speech = synthesize_many(jobs, cache, progress=progress)
    by_split = {sp: [s for s in speakers if s.split == sp] for sp in SPLITS}
    offset = prof.draw_offset + (_UNSEEN_OFFSET if unseen else 0)
    field = _Field(CorpusContext(seed, prof, by_split, speech, phrases, kind_offset=offset), offset)
    recipes = [r for r in clip_recipes(seed + offset, prof) if r.split != "train"]
    rows = _render(field, recipes, stream_counts(prof), out, progress)
    write_speakers(out / "speakers.csv", speakers)
    return rows


def build_field_corpus(
    out: Path, seed: int, prof: CorpusProfile, phrase: str, progress: bool, cache: Path | None
) -> Path:
    """Render the add-on into `out` (already prepared by corpus_build) and return the path
    of its manifest; the unseen voices go to `out/unseen/`."""
    speakers = [s for s in make_speakers(seed, prof, phrase) if s.split != "train"]
    rows = _build_part(out, seed, prof, phrase, speakers, progress, cache, unseen=False)
    if prof.unseen_speakers > 0:
        unseen = make_unseen_speakers(seed, prof, phrase)
        sub = replace(
            prof,
            val_clips=0,
            test_clips=prof.unseen_test_clips,
            val_streams_per_device=0,
            streams_per_device=prof.unseen_streams_per_device,
        )
        udir = out / UNSEEN_DIR
        udir.mkdir(parents=True, exist_ok=True)
        urows = _build_part(udir, seed, sub, phrase, unseen, progress, cache, unseen=True)
        (udir / CORPUS_INFO).write_text(
            _info(seed, prof, phrase, subset="unseen-voices"), encoding="utf-8"
        )
        write_manifest(urows, udir / "manifest.csv")
    # Written last: its presence marks a finished build.
    (out / CORPUS_INFO).write_text(_info(seed, prof, phrase), encoding="utf-8")
    return write_manifest(rows, out / "manifest.csv")
