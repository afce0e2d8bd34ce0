"""Pretraining's data: the default corpus (built once and cached), the corpus decoded once
into arrays (training clips and streams, validation clips and streams, the add-on corpora),
and the batches drawn from them, each a function of (seed, step) alone, optionally prepared
by worker processes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.progress_bars import bar_disabled
from wakefl.tools.training.settings import PretrainSettings


def default_corpus(phrase: str, seed: int, progress: bool) -> Path:
    """The manifest of the cached 'pretrain' corpus of `phrase` and `seed`, built first
    when the cache lacks it (a new seed builds a new corpus)."""
    from wakefl.cache_location import cache_root

    # Imported only here: training on a given corpus needs no speech synthesis stack
    # (a training host may lack libsndfile and the engines).
    from wakefl.tools.corpus.build import build_corpus

    folder = cache_root() / "corpus" / f"pretrain-{'-'.join(phrase.lower().split())}-seed{seed}"
    manifest = folder / "manifest.csv"
    if not manifest.exists() or not (folder / "corpus.json").exists():
        build_corpus(folder, seed=seed, profile="pretrain", phrase=phrase, progress=progress)
    return manifest


@dataclass
class PretrainData:
    """Decoded audio of a corpus, in memory: training clips by label, training streams for
    negative cuts, validation clips and streams."""

    pos: np.ndarray  # [P, T]
    neg: np.ndarray  # [N, T]
    train_streams: list[np.ndarray]
    val_clips: np.ndarray
    val_labels: np.ndarray
    val_streams: list[np.ndarray] = field(default_factory=list)
    bank: Any = None  # wave_augment.AugmentBank
    hard: np.ndarray | None = None  # [H, T] the mined hard negatives, when mining is on
    # For each BALANCE_KEYS key, the indices of `pos` and of `neg` in each of its groups:
    # what `balance_by` draws by.
    pos_groups: dict[str, list[np.ndarray]] = field(default_factory=dict)
    neg_groups: dict[str, list[np.ndarray]] = field(default_factory=dict)
    # Room responses of the field augmentation (tools/acoustics/field_acoustics.py training_rooms),
    # made once when the run asks for it.
    field_rirs: tuple[np.ndarray, ...] = ()
    # Talkers and babble cut from the training negatives (speech_backgrounds.py), made
    # once when the run asks for them.
    speech: Any = None
    # The speaker of each training clip (in `pos`, `neg` order; "" when unknown), and each
    # speaker's negatives: the same voice going on, for the context-speech stage.
    pos_speakers: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=object))
    neg_speakers: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=object))
    neg_by_speaker: dict[str, np.ndarray] = field(default_factory=dict)
    # What each negative holds, from its file name (plan.clip_content: "conf", "other",
    # "bg", "conf_run"; "" when the name does not say).
    neg_content: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=object))
    # For each of `train_streams`, the [start, end) samples of the near-rhymes its transcript
    # (transcripts.py) records; empty for a stream without one.
    train_stream_near_rhymes: list[np.ndarray] = field(default_factory=list)

    @property
    def window(self) -> int:
        return int(self.pos.shape[1])


def _decode(path: Path) -> np.ndarray:
    from wakefl.edge_runtime import load_audio

    return load_audio(path, 16000)


# The content `_source` gives a training-stream crop that holds a near-rhyme by its stream's
# transcript (a clip's content is plan.clip_content's).
STREAM_NEAR_RHYME = "stream_conf"


def near_rhyme_spans(stream: Path) -> np.ndarray:
    """The [start, end) samples (16 kHz) of the near-rhymes that the transcript beside
    `stream` records, as an int64 [n, 2] array; empty when it has no transcript."""
    from wakefl.tools.corpus.plan import NEAR_RHYME_CONTENTS
    from wakefl.tools.corpus.transcripts import read_transcript

    spans = [
        (round(u.start_s * 16000), round(u.end_s * 16000))
        for u in read_transcript(stream)
        if u.content in NEAR_RHYME_CONTENTS
    ]
    return np.array(spans, dtype=np.int64).reshape(-1, 2)


def holds_near_rhyme(spans: np.ndarray, start: int, window: int) -> bool:
    """Whether a crop of `window` samples from `start` holds at least half of one of the
    near-rhymes `spans` (near_rhyme_spans): enough of "hey noah" to sound like it."""
    if spans.size == 0:
        return False
    inside = np.minimum(spans[:, 1], start + window) - np.maximum(spans[:, 0], start)
    return bool(np.any(inside * 2 >= spans[:, 1] - spans[:, 0]))


def _decode_streams(paths: list[Path], window: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The streams at `paths` at least a window long, and their near-rhyme spans."""
    waves = [(_decode(p), p) for p in paths]
    kept = [(w, p) for w, p in waves if w.size >= window]
    return [w for w, _ in kept], [near_rhyme_spans(p) for _, p in kept]


def _stream_paths(rows: list[Any], manifest: Path, split: str) -> list[Path]:
    return [r.resolve(manifest) for r in rows if r.kind == "stream" and r.split == split]


def _corpus_phrase(manifest: Path) -> str | None:
    """The wake phrase a built corpus was made for (its corpus.json), if it says."""
    from wakefl.tools.corpus.build import read_corpus_info

    info = read_corpus_info(manifest.parent)
    phrase = info.get("phrase") if isinstance(info, dict) else None
    return phrase if isinstance(phrase, str) else None


def _decode_clips(rows: list[Any], manifest: Path, window: int, progress: bool) -> np.ndarray:
    """The clip rows of `manifest` as a float32 [N, window] array, with a progress bar."""
    from tqdm import tqdm

    from wakefl.sdk.dataset import load_clip

    waves = [
        load_clip(r.resolve(manifest), window)
        for r in tqdm(
            rows, desc="decode clips", unit="clip", disable=bar_disabled(progress), leave=False
        )
    ]
    return np.stack(waves).astype(np.float32)


def _extra_rows(main: Path, extra: Path) -> list[Any]:
    """An add-on corpus's training rows, checked before any audio is decoded: built for the
    main corpus's phrase, with training clips. Its validation and test audio is not used."""
    from wakefl.sdk.manifest import read_manifest

    phrases = (_corpus_phrase(main), _corpus_phrase(extra))
    if None not in phrases and phrases[0] != phrases[1]:
        raise ConfigError(
            f"--extra-corpus {extra} was built for {phrases[1]!r}, the corpus for {phrases[0]!r}"
        )
    rows = [r for r in read_manifest(extra) if r.split == "train"]
    if not any(r.kind == "clip" for r in rows):
        raise ConfigError(f"--extra-corpus {extra}: no training clips")
    return rows


def _extra_training_audio(
    extra: Path, rows: list[Any], window: int, progress: bool
) -> tuple[np.ndarray, list[Any], tuple[list[np.ndarray], list[np.ndarray]]]:
    """An add-on corpus's training clips (waves and their rows) and training streams (with
    their near-rhyme spans)."""
    clips = [r for r in rows if r.kind == "clip"]
    waves = _decode_clips(clips, extra, window, progress)
    streams = _decode_streams([r.resolve(extra) for r in rows if r.kind == "stream"], window)
    return waves, clips, streams


def _groups(keys: Sequence[str]) -> list[np.ndarray]:
    """The positions of each distinct key in `keys` (keys in sorted order)."""
    arr = np.array(keys, dtype=object)
    return [np.flatnonzero(arr == name) for name in sorted(set(keys))]


def _set_groups(data: PretrainData, rows: Sequence[tuple[Any, Path]]) -> None:
    """Group the training clips (rows with their manifest, in `pos` then `neg` order) by
    device type and by speech engine (from the speakers.csv beside each manifest; "" for a
    speaker it does not name, such as imported recordings)."""
    from wakefl.tools.corpus.plan import clip_content
    from wakefl.tools.corpus.rendering import voice_families

    families = {m: voice_families(m) for m in {m for _, m in rows}}
    for label, out in ((1, data.pos_groups), (0, data.neg_groups)):
        mine = [(r, m) for r, m in rows if r.label == label]
        out["device_type"] = _groups([r.device_type for r, _ in mine])
        out["engine"] = _groups([families[m].get(r.speaker, "").split(":")[0] for r, m in mine])
    # Speakers are named per corpus: an add-on's "spk3" is not the main corpus's.
    who = [f"{m.parent.name}/{r.speaker}" if r.speaker else "" for r, m in rows]
    labels = np.array([r.label for r, _ in rows])
    data.pos_speakers = np.array([w for w, y in zip(who, labels, strict=True) if y == 1], object)
    data.neg_speakers = np.array([w for w, y in zip(who, labels, strict=True) if y == 0], object)
    data.neg_content = np.array([clip_content(r.path) for r, _ in rows if r.label == 0], object)
    mine_by: dict[str, list[int]] = {}
    for i, name in enumerate(data.neg_speakers):
        if name:
            mine_by.setdefault(name, []).append(i)
    data.neg_by_speaker = {name: np.array(idx) for name, idx in mine_by.items()}


def narrow_to_speech_source(data: PretrainData, source: str) -> np.ndarray:
    """Narrows `data.neg_by_speaker` (a speaker's next words) to `source` and returns the
    negatives other people's speech is cut from: all of them ("negatives"), or only the
    everyday speech ("everyday": clips named `*_other.wav`). Half of a corpus's spoken
    negatives are near-rhymes of the phrase; as babble they put "nova" and "hey" behind
    every phrase, and after a foreground "hey" the same voice going on with "nova is a
    star" is the phrase itself, labelled a negative."""
    if source == "negatives":
        return data.neg
    keep = data.neg_content == "other"
    if not keep.any():
        raise ConfigError(
            "--speech-source everyday: no everyday-speech negatives (clips named *_other.wav "
            "by `wakefl corpus build`) among the training clips"
        )
    narrowed = {name: idx[keep[idx]] for name, idx in data.neg_by_speaker.items()}
    data.neg_by_speaker = {name: idx for name, idx in narrowed.items() if idx.size}
    return data.neg[keep]


def _validation_audio(
    main: Path, manifest: Path, window: int, cap: int, progress: bool
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """A corpus's validation clips, their labels and its validation streams (each cut to
    `cap` samples), for `--val-corpus`; checked before decoding: both labels, and built for
    the training corpus's phrase."""
    from wakefl.sdk.manifest import read_manifest

    phrases = (_corpus_phrase(main), _corpus_phrase(manifest))
    if None not in phrases and phrases[0] != phrases[1]:
        raise ConfigError(
            f"--val-corpus {manifest} was built for {phrases[1]!r}, the corpus for {phrases[0]!r}"
        )
    rows = [r for r in read_manifest(manifest) if r.split == "val"]
    clips = [r for r in rows if r.kind == "clip"]
    if not {r.label for r in clips} >= {0, 1}:
        raise ConfigError(f"--val-corpus {manifest}: its val split needs clips of both labels")
    waves = _decode_clips(clips, manifest, window, progress)
    streams = [_decode(r.resolve(manifest))[:cap] for r in rows if r.kind == "stream"]
    return waves, np.array([r.label for r in clips]), [s for s in streams if s.size >= window]


def load_pretrain_data(
    manifest: Path,
    window: int,
    val_stream_seconds: float,
    progress: bool = True,
    seed: int = 0,
    extra: Sequence[Path] = (),
    val_manifest: Path | None = None,
    field_rooms: int = 0,
) -> PretrainData:
    """The corpus's training and validation audio, plus the training audio of each `extra`
    corpus (appended after the main corpus's, so mined-pool indices stay stable). With
    `val_manifest`, validation comes from that corpus's val split instead. `field_rooms`
    room responses are made for the field augmentation."""
    from wakefl.sdk.manifest import read_manifest

    rows = read_manifest(manifest)
    val_split = ("val",) if val_manifest is None else ()
    clips = [r for r in rows if r.kind == "clip" and r.split in ("train", *val_split)]
    if not any(r.split == "train" and r.label == 1 for r in clips):
        raise ConfigError(f"{manifest}: no wake-phrase clips in the train split")
    if val_manifest is None and not any(r.split == "val" and r.label == 1 for r in clips):
        raise ConfigError(f"{manifest}: no wake-phrase clips in the val split")
    extra_rows = [_extra_rows(manifest, path) for path in extra]
    arr = _decode_clips(clips, manifest, window, progress)
    labels = np.array([r.label for r in clips])
    train = np.array([r.split == "train" for r in clips])
    train_streams, train_spans = _decode_streams(_stream_paths(rows, manifest, "train"), window)
    cap = int(val_stream_seconds * 16000)
    val_clips, val_labels = arr[~train], labels[~train]
    val_paths = _stream_paths(rows, manifest, "val") if val_split else []
    val_streams = [s[:cap] for s in map(_decode, val_paths) if s.size >= window]
    if val_manifest is not None:
        val_clips, val_labels, val_streams = _validation_audio(
            manifest, val_manifest, window, cap, progress
        )
    from wakefl.tools.augmentation.wave_augment import AugmentBank

    data = PretrainData(
        pos=arr[train & (labels == 1)],
        neg=arr[train & (labels == 0)],
        train_streams=train_streams,
        train_stream_near_rhymes=train_spans,
        val_clips=val_clips,
        val_labels=val_labels,
        val_streams=val_streams,
        bank=AugmentBank.make(seed),
    )
    if field_rooms:
        from wakefl.tools.acoustics.field_acoustics import training_rooms

        data.field_rirs = training_rooms(seed, field_rooms)
    train_rows = [(r, manifest) for r in clips if r.split == "train"]
    for path, more_rows in zip(extra, extra_rows, strict=True):
        train_rows += _append_extra(data, path, more_rows, progress)
    _set_groups(data, train_rows)
    return data


def _append_extra(
    data: PretrainData, path: Path, rows: list[Any], progress: bool
) -> list[tuple[Any, Path]]:
    """Add an add-on corpus's training clips and streams to `data`; returns its clip rows
    with their manifest."""
    x, more_clips, (more, spans) = _extra_training_audio(path, rows, data.window, progress)
    y = np.array([r.label for r in more_clips])
    data.pos = np.concatenate([data.pos, x[y == 1]])
    data.neg = np.concatenate([data.neg, x[y == 0]])
    data.train_streams += more
    data.train_stream_near_rhymes += spans
    return [(r, path) for r in more_clips]


def _draw(rng: np.random.Generator, n: int, groups: list[np.ndarray] | None) -> int:
    """A clip index in [0, n): uniform, or of a group drawn uniformly first."""
    if not groups:
        return int(rng.integers(n))
    group = groups[int(rng.integers(len(groups)))]
    return int(group[int(rng.integers(group.size))])


@dataclass(frozen=True)
class _BatchPlan:
    """How many of a batch's windows are phrases, mined negatives and stream cuts."""

    n_pos: int
    n_hard: int
    n_cut: int


def _plan(data: PretrainData, s: PretrainSettings) -> _BatchPlan:
    n_pos = max(1, int(round(s.batch_size * s.positive_share)))
    n_neg = s.batch_size - n_pos
    pool = data.hard is not None and len(data.hard) > 0
    n_hard = int(round(n_neg * s.hard_negative_share)) if pool else 0
    n_cut = int(round((n_neg - n_hard) * s.stream_crop_share)) if data.train_streams else 0
    return _BatchPlan(n_pos, n_hard, n_cut)


def _source(
    data: PretrainData, i: int, plan: _BatchPlan, rng: np.random.Generator, balance_by: str
) -> tuple[np.ndarray, str, str]:
    """The `i`-th window's clip before augmentation, its speaker and its content
    (plan.clip_content; STREAM_NEAR_RHYME for a stream crop holding a near-rhyme; "" when
    unknown)."""
    if i < plan.n_pos:
        k = _draw(rng, len(data.pos), data.pos_groups.get(balance_by))
        return data.pos[k], _speaker(data.pos_speakers, k), "pos"
    if data.hard is not None and i < plan.n_pos + plan.n_hard:
        return data.hard[int(rng.integers(len(data.hard)))], "", ""
    if i < plan.n_pos + plan.n_hard + plan.n_cut:
        j = int(rng.integers(len(data.train_streams)))
        stream = data.train_streams[j]
        start = int(rng.integers(0, stream.size - data.window + 1))
        near = holds_near_rhyme(data.train_stream_near_rhymes[j], start, data.window)
        return stream[start : start + data.window], "", STREAM_NEAR_RHYME if near else ""
    k = _draw(rng, len(data.neg), data.neg_groups.get(balance_by))
    content = str(data.neg_content[k]) if k < len(data.neg_content) else ""
    return data.neg[k], _speaker(data.neg_speakers, k), content


def _speaker(names: np.ndarray, k: int) -> str:
    return str(names[k]) if k < len(names) else ""


def context_speech(data: PretrainData, speaker: str) -> Any:
    """The context-speech stage for a window of `speaker` (context_speech.py): that
    speaker's other negatives, and the run's talkers and babble."""
    from wakefl.tools.augmentation.context_speech import ContextSpeech

    mine = data.neg_by_speaker.get(speaker, np.zeros(0, dtype=np.int64))

    def same_speaker(rng: np.random.Generator) -> np.ndarray | None:
        return data.neg[int(mine[int(rng.integers(mine.size))])] if mine.size else None

    return ContextSpeech(same_speaker, data.speech.draw)


def _kept_clear(s: PretrainSettings) -> frozenset[str]:
    """The window contents (_source's) that the context-speech stage puts no speech over."""
    from wakefl.tools.corpus.plan import NEAR_RHYME_CONTENTS

    clips = () if s.speech_over_near_rhymes else NEAR_RHYME_CONTENTS
    streams = () if s.speech_over_stream_near_rhymes else (STREAM_NEAR_RHYME,)
    return frozenset((*clips, *streams))


def make_batch(data: PretrainData, step: int, s: PretrainSettings) -> tuple[np.ndarray, np.ndarray]:
    """The augmented batch of training step `step`: a pure function of (seed, step)."""
    from wakefl.tools.augmentation.context_speech import snr_floor
    from wakefl.tools.augmentation.wave_augment import augment_window

    rng = np.random.default_rng([s.seed, 77, step])
    plan = _plan(data, s)
    kept_clear = _kept_clear(s)
    out = np.empty((s.batch_size, data.window), np.float32)
    labels = np.zeros(s.batch_size, np.int64)
    labels[: plan.n_pos] = 1
    augment = s.augment_settings()
    for i in range(s.batch_size):
        src, speaker, content = _source(data, i, plan, rng, s.balance_by)
        out[i] = augment_window(src, int(labels[i]), rng, data.bank, augment)
        # Each drawn only when asked for, so runs without them keep their batches.
        if s.context_speech > 0 and rng.random() < s.context_speech:
            floor = snr_floor(step / s.total_steps)
            stage = context_speech(data, speaker)
            out[i] = np.clip(stage.apply(out[i], rng, floor, content not in kept_clear), -1, 1)
        if s.speech_backgrounds > 0 and rng.random() < s.speech_backgrounds:
            out[i] = np.clip(data.speech.mix(out[i], rng), -1.0, 1.0)
        if s.field_augment > 0 and rng.random() < s.field_augment:
            from wakefl.tools.acoustics.field_acoustics import field_augment

            out[i] = field_augment(out[i], rng, data.field_rirs, s.field_settings())
    return out, labels


def batch_stream(
    data: PretrainData,
    start_step: int,
    s: PretrainSettings,
    workers: int = 1,
    end_step: int | None = None,
) -> Iterator[tuple[Any, Any]]:
    """Batches of steps `start_step` to `end_step` (default: the run's end), prepared in a
    worker process while the model trains."""
    end = s.total_steps if end_step is None else min(end_step, s.total_steps)
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    class _Batches(IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            k, n = (info.id, info.num_workers) if info is not None else (0, 1)
            step = start_step + k
            while step < end:
                x, y = make_batch(data, step, s)
                yield torch.from_numpy(x), torch.from_numpy(y)
                step += n

    if workers == 0:
        return iter(_Batches())
    # Workers take steps round-robin and the loader returns them in worker order, so the
    # batches arrive in step order.
    return iter(
        DataLoader(
            _Batches(),
            batch_size=None,
            num_workers=workers,
            prefetch_factor=4,
            persistent_workers=False,
        )
    )
