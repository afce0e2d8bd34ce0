"""Build the synthetic federated wake-word corpus: five device types A-E, clips of exactly
one model window (1.5 s at 16 kHz) and long negative streams, with `manifest.csv` at the root.
The pieces it renders with are in `rendering.py`; a profile of the held-out acoustic
simulation is built by `field_corpus.py`.

Every clip draws its randomness from a generator seeded by (seed, device type, kind, split,
index), so the same seed and profile give byte-identical files whatever the order of work."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from wakefl.errors import ConfigError
from wakefl.progress_bars import bar_disabled
from wakefl.sdk.manifest import CLIP_SAMPLES, SAMPLE_RATE, ManifestRow, write_manifest
from wakefl.tools.acoustics.device_acoustics import DEVICE_PROFILES
from wakefl.tools.corpus.field_corpus import build_field_corpus
from wakefl.tools.corpus.plan import (
    FIELD_ACOUSTICS_PROFILES,
    LEAD_IN_FILLERS,
    POSITIVE_CONTENTS,
    PROFILES,
    SPLITS,
    ClipRecipe,
    CorpusProfile,
    clip_recipes,
    phrase_variants,
    stream_counts,
)
from wakefl.tools.corpus.rendering import (
    CORPUS_INFO,
    UNSEEN_DIR,
    CorpusContext,
    acoustics_named,
    corpus_info,
    render_clip,
    render_stream,
    texts_said,
    write_speakers,
    write_stream,
    write_wav,
)
from wakefl.tools.corpus.speakers import (
    is_new_user,
    make_speakers,
    make_unseen_speakers,
)
from wakefl.tools.corpus.speech_synthesis import synthesize_many

# Added to the rendering's kinds of draw for the unseen-voices corpus, so its draws never repeat the main one's.
_UNSEEN_KIND_OFFSET = 10
# The fleet profile's test corpus of the users kept out of their device type's training data.
NEW_USERS_DIR = "new-users"
_NEW_USERS_KIND_OFFSET = 30


def resolve_profile(profile: str | CorpusProfile) -> CorpusProfile:
    if isinstance(profile, CorpusProfile):
        return profile
    if profile not in PROFILES:
        raise ConfigError(
            f"unknown corpus profile {profile!r}; choose one of {', '.join(PROFILES)}"
        )
    return PROFILES[profile]


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
        rel = r.path
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
