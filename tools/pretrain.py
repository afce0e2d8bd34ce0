"""`wakefl model pretrain`: train the wake-word model offline on the pretraining corpus.

Every batch is drawn fresh: a third wake-phrase clips, the rest negatives (clips of confusable
phrases, other speech and background, and random 1.5 s cuts of the training streams), each
augmented on the fly (tools/wave_augment.py) and with SpecAugment-style masks on the log-mel
input. The learning rate warms up linearly, then follows a cosine to 5%. Three options target
what the benchmark still misses: `mel_warp` scales each example's spectrum like another
vocal tract (tools/mel_warp.py: voices of engines training never heard), `time_warp`
stretches one part of each example and compresses the other (tools/time_warp.py: another
speaker's timing), and `hard_negative_share` draws part of the negatives from a pool of the
training negatives the model currently scores highest (tools/hard_negatives.py: the false
accepts that set the threshold).

Validation measures what a device maker ships for: the false-reject rate of the validation
clips at the threshold where the streaming detector (its smoothing and refractory period)
makes at most `val_fa_per_hour` false accepts per hour on the validation streams. The best
model by that figure is kept.

Checkpoints: `state.safetensors` (weights and optimizer moments) + `state.json` (step, best
figure, history) every `checkpoint_minutes`, written atomically. `--resume` continues from
them; the batch of step k depends only on (seed, k), so a resumed run sees the same data a
run without the kill would have seen (with mining on: on (seed, k) and the pool, whose
descriptors the checkpoint carries).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.progress_bars import bar_disabled

STATE_WEIGHTS = "state.safetensors"
STATE_INFO = "state.json"
BEST = "best.safetensors"
BEST_CARD = "best.card.json"
HISTORY = "history.jsonl"
# Relative spread of the noise that lets the copies made by widening a narrower --init-from
# model diverge: small enough to keep its accuracy, large enough to break the symmetry.
WIDEN_NOISE = 0.02
# The shipped detector's settings: the streaming detector's defaults.
HOP_S, SMOOTHING, REFRACTORY_S = 0.1, 3, 1.0
# What `balance_by` may group training clips by.
BALANCE_KEYS = ("device_type", "engine")


@dataclass(frozen=True)
class PretrainSettings:
    width: float = 1.0
    phrase: str = "hey nova"
    seed: int = 0
    batch_size: int = 32
    samples: int = 400_000  # training samples in the whole run (sets the schedule)
    lr: float = 2e-3
    weight_decay: float = 1e-4
    warmup_steps: int = 300
    # A third of each batch is the phrase: false accepts per hour are set by the rare
    # negatives that score high, so negatives get the larger share.
    positive_share: float = 1 / 3
    stream_crop_share: float = 0.4  # of the negatives in a batch
    spec_masks: bool = True
    # Vocal-tract-length perturbation: each example's spectrum scaled by a factor drawn
    # from [1 - mel_warp, 1 + mel_warp] (tools/mel_warp.py); 0 = off.
    mel_warp: float = 0.0
    # Each example's time axis split at a random anchor that moves, so one side is stretched
    # and the other compressed; the side nearer the edge by a factor in [1 - time_warp,
    # 1 + time_warp] (tools/time_warp.py); 0 = off.
    time_warp: float = 0.0
    # Share of the negatives drawn from the mined pool of high-scoring negatives
    # (tools/hard_negatives.py); 0 = off. The pool is renewed every `mine_every_steps`.
    hard_negative_share: float = 0.0
    # Draw each wake-phrase and negative clip from a group chosen uniformly, then a clip of
    # that group: groups by "device_type" (the corpus has 4x as many clips of A as of E, and
    # E is where held-out phrases are missed most) or by speech "engine" (three quarters of
    # the phrases are espeak-ng's; flite's are missed most). "": clips drawn uniformly.
    balance_by: str = ""
    # Knowledge distillation: a teacher model (weights file; "" = off) scores the same
    # augmented batch, and this share of the loss pulls the student's class probabilities
    # at `distill_temperature` towards the teacher's. A narrow model learns more from a
    # wide one's graded scores (how near a "hey noah" is to the phrase) than from labels.
    distill_from: str = ""
    distill_weight: float = 0.0
    distill_temperature: float = 2.0
    mine_every_steps: int = 1500
    mine_candidates: int = 6000
    hard_pool: int = 600
    eval_every_steps: int = 500
    checkpoint_minutes: float = 5.0
    val_fa_per_hour: float = 2.0
    val_stream_seconds: float = 300.0  # per validation stream (caps validation cost)
    threads: int = 2
    device: str = "cpu"
    # Processes preparing batches (decoding nothing: augmentation only). Each batch depends
    # on its step alone, so any count gives the same run; a GPU needs several to be fed.
    workers: int = 1

    @property
    def total_steps(self) -> int:
        return max(1, math.ceil(self.samples / self.batch_size))


def lr_at(step: int, s: PretrainSettings) -> float:
    """Linear warm-up, then a cosine from `lr` down to 5% of it at the last step."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    frac = min(1.0, (step - s.warmup_steps) / max(1, s.total_steps - s.warmup_steps))
    return s.lr * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * frac)))


# ---------------------------------------------------------------- data


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

    @property
    def window(self) -> int:
        return int(self.pos.shape[1])


def _decode(path: Path) -> np.ndarray:
    from wakefl.edge_runtime import load_audio

    return load_audio(path, 16000)


def _corpus_phrase(manifest: Path) -> str | None:
    """The wake phrase a built corpus was made for (its corpus.json), if it says."""
    from wakefl.tools.corpus_build import read_corpus_info

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
) -> tuple[np.ndarray, list[Any], list[np.ndarray]]:
    """An add-on corpus's training clips (waves and their rows) and training streams."""
    clips = [r for r in rows if r.kind == "clip"]
    waves = _decode_clips(clips, extra, window, progress)
    streams = [_decode(r.resolve(extra)) for r in rows if r.kind == "stream"]
    return waves, clips, [s for s in streams if s.size >= window]


def _groups(keys: Sequence[str]) -> list[np.ndarray]:
    """The positions of each distinct key in `keys` (keys in sorted order)."""
    arr = np.array(keys, dtype=object)
    return [np.flatnonzero(arr == name) for name in sorted(set(keys))]


def _set_groups(data: PretrainData, rows: Sequence[tuple[Any, Path]]) -> None:
    """Group the training clips (rows with their manifest, in `pos` then `neg` order) by
    device type and by speech engine (from the speakers.csv beside each manifest; "" for a
    speaker it does not name, such as imported recordings)."""
    from wakefl.tools.bench_detection import voice_families

    families = {m: voice_families(m) for m in {m for _, m in rows}}
    for label, out in ((1, data.pos_groups), (0, data.neg_groups)):
        mine = [(r, m) for r, m in rows if r.label == label]
        out["device_type"] = _groups([r.device_type for r, _ in mine])
        out["engine"] = _groups([families[m].get(r.speaker, "").split(":")[0] for r, m in mine])


def load_pretrain_data(
    manifest: Path,
    window: int,
    val_stream_seconds: float,
    progress: bool = True,
    seed: int = 0,
    extra: Sequence[Path] = (),
) -> PretrainData:
    """The corpus's training and validation audio, plus the training audio of each `extra`
    corpus (appended after the main corpus's, so mined-pool indices stay stable)."""
    from wakefl.sdk.manifest import read_manifest

    rows = read_manifest(manifest)
    clips = [r for r in rows if r.kind == "clip" and r.split in ("train", "val")]
    if not any(r.split == "train" and r.label == 1 for r in clips):
        raise ConfigError(f"{manifest}: no wake-phrase clips in the train split")
    if not any(r.split == "val" and r.label == 1 for r in clips):
        raise ConfigError(f"{manifest}: no wake-phrase clips in the val split")
    extra_rows = [_extra_rows(manifest, path) for path in extra]
    arr = _decode_clips(clips, manifest, window, progress)
    labels = np.array([r.label for r in clips])
    train = np.array([r.split == "train" for r in clips])
    streams = {
        sp: [_decode(r.resolve(manifest)) for r in rows if r.kind == "stream" and r.split == sp]
        for sp in ("train", "val")
    }
    cap = int(val_stream_seconds * 16000)
    from wakefl.tools.wave_augment import AugmentBank

    data = PretrainData(
        pos=arr[train & (labels == 1)],
        neg=arr[train & (labels == 0)],
        train_streams=[s for s in streams["train"] if s.size >= window],
        val_clips=arr[~train],
        val_labels=labels[~train],
        val_streams=[s[:cap] for s in streams["val"] if s.size >= window],
        bank=AugmentBank.make(seed),
    )
    train_rows = [(r, manifest) for r in clips if r.split == "train"]
    for path, more_rows in zip(extra, extra_rows, strict=True):
        x, more_clips, more = _extra_training_audio(path, more_rows, window, progress)
        y = np.array([r.label for r in more_clips])
        data.pos = np.concatenate([data.pos, x[y == 1]])
        data.neg = np.concatenate([data.neg, x[y == 0]])
        data.train_streams += more
        train_rows += [(r, path) for r in more_clips]
    _set_groups(data, train_rows)
    return data


def _draw(rng: np.random.Generator, n: int, groups: list[np.ndarray] | None) -> int:
    """A clip index in [0, n): uniform, or of a group drawn uniformly first."""
    if not groups:
        return int(rng.integers(n))
    group = groups[int(rng.integers(len(groups)))]
    return int(group[int(rng.integers(group.size))])


def make_batch(data: PretrainData, step: int, s: PretrainSettings) -> tuple[np.ndarray, np.ndarray]:
    """The augmented batch of training step `step`: a pure function of (seed, step)."""
    from wakefl.tools.wave_augment import augment_window

    rng = np.random.default_rng([s.seed, 77, step])
    n_pos = max(1, int(round(s.batch_size * s.positive_share)))
    n_neg = s.batch_size - n_pos
    pool = data.hard if data.hard is not None and len(data.hard) else None
    n_hard = int(round(n_neg * s.hard_negative_share)) if pool is not None else 0
    n_cut = int(round((n_neg - n_hard) * s.stream_crop_share)) if data.train_streams else 0
    out = np.empty((s.batch_size, data.window), np.float32)
    labels = np.zeros(s.batch_size, np.int64)
    labels[:n_pos] = 1
    pos_groups, neg_groups = data.pos_groups.get(s.balance_by), data.neg_groups.get(s.balance_by)
    for i in range(s.batch_size):
        if i < n_pos:
            src = data.pos[_draw(rng, len(data.pos), pos_groups)]
        elif pool is not None and i < n_pos + n_hard:
            src = pool[int(rng.integers(len(pool)))]
        elif i < n_pos + n_hard + n_cut:
            stream = data.train_streams[int(rng.integers(len(data.train_streams)))]
            start = int(rng.integers(0, stream.size - data.window + 1))
            src = stream[start : start + data.window]
        else:
            src = data.neg[_draw(rng, len(data.neg), neg_groups)]
        out[i] = augment_window(src, int(labels[i]), rng, data.bank)
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


# ---------------------------------------------------------------- validation


def stream_windows(wave: np.ndarray, window: int, hop: int) -> np.ndarray:
    """Every window the streaming detector scores: ends at window, window + hop, ..."""
    n = 1 + (wave.size - window) // hop
    return np.lib.stride_tricks.sliding_window_view(wave, window)[::hop][:n]


def smoothed(raw: np.ndarray, smoothing: int) -> np.ndarray:
    """The streaming detector's moving average (fewer terms at the stream's start)."""
    c = np.cumsum(np.concatenate([[0.0], raw.astype(np.float64)]))
    idx = np.arange(1, raw.size + 1)
    lo = np.maximum(0, idx - smoothing)
    return (c[idx] - c[lo]) / (idx - lo)


def count_events(scores: np.ndarray, threshold: float, refractory_hops: int) -> int:
    """Detections of the streaming detector on smoothed scores at one threshold."""
    above = np.flatnonzero(scores >= threshold)
    count, last = 0, -(10**9)
    for i in above:
        if i - last >= refractory_hops:
            count += 1
            last = int(i)
    return count


def threshold_for_fa(
    streams_scores: list[np.ndarray], hours: float, fa_per_hour: float, refractory_hops: int
) -> float:
    """The lowest threshold at which the streams give at most `fa_per_hour` false accepts
    per hour (bisection: the event count falls as the threshold rises)."""
    allowed = math.floor(fa_per_hour * hours + 1e-9)
    lo, hi = 0.0, 1.0 + 1e-9

    def events(t: float) -> int:
        return sum(count_events(sc, t, refractory_hops) for sc in streams_scores)

    if events(lo) <= allowed:
        return lo
    for _ in range(30):
        mid = (lo + hi) / 2
        if events(mid) <= allowed:
            hi = mid
        else:
            lo = mid
    return hi


def score_batches(model: Any, windows: np.ndarray, batch: int = 256) -> np.ndarray:
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.from_numpy(np.ascontiguousarray(windows[i : i + batch], dtype=np.float32))
            out.append(model.predict_proba(x.to(next(model.parameters()).device)).cpu().numpy())
    return np.concatenate(out) if out else np.zeros(0)


def validate(model: Any, data: PretrainData, s: PretrainSettings) -> dict[str, float]:
    """FRR on validation clips at the threshold giving `val_fa_per_hour` on the validation
    streams, plus clip-level figures that stay informative before any stream fires."""
    was = model.training
    model.eval()
    try:
        clip_scores = score_batches(model, data.val_clips)
        hop = int(round(HOP_S * 16000))
        stream_scores = [
            smoothed(score_batches(model, stream_windows(w, data.window, hop)), SMOOTHING)
            for w in data.val_streams
        ]
    finally:
        model.train(was)
    pos = clip_scores[data.val_labels == 1]
    neg = clip_scores[data.val_labels == 0]
    hours = sum(w.size for w in data.val_streams) / 16000 / 3600
    thr = (
        threshold_for_fa(stream_scores, hours, s.val_fa_per_hour, int(round(REFRACTORY_S / HOP_S)))
        if stream_scores
        else float(np.quantile(neg, 0.99))
    )
    return {
        "threshold": float(thr),
        "frr": float(np.mean(pos < thr)),
        "clip_far": float(np.mean(neg >= thr)),
        "frr_at_half": float(np.mean(pos < 0.5)),
        "far_at_half": float(np.mean(neg >= 0.5)),
        "val_stream_hours": float(hours),
    }


def better(a: dict[str, float], b: dict[str, float] | None) -> bool:
    """Lower FRR at the fixed FA/h wins; on a tie, fewer clip false accepts at 0.5."""
    if b is None:
        return True
    return (a["frr"], a["far_at_half"] + a["frr_at_half"]) < (
        b["frr"],
        b["far_at_half"] + b["frr_at_half"],
    )


# ---------------------------------------------------------------- checkpoints


def save_state(out: Path, model: Any, opt: Any, info: dict[str, Any]) -> None:
    """Weights and AdamW moments in safetensors, the rest as JSON; both written atomically,
    the JSON last (it names the step the weights belong to)."""
    from safetensors.torch import save_file

    from wakefl.sdk.atomic_files import write_atomic

    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.named_parameters()}
    for i, p in enumerate(opt.param_groups[0]["params"]):
        st = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                tensors[f"opt.{i}.{key}"] = st[key].detach().cpu().contiguous()
        if "step" in st:
            tensors[f"opt.{i}.step"] = st["step"].detach().cpu().reshape(1).float()
    tmp = out / f".{STATE_WEIGHTS}.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(out / STATE_WEIGHTS)
    write_atomic(out / STATE_INFO, (json.dumps(info, indent=1) + "\n").encode())


def _copy_weights(model: Any, tensors: dict[str, Any], error: str) -> None:
    """Copy a checkpoint's `model.<name>` tensors into `model`; ConfigError(`error`) naming
    the first parameter that is missing or of another shape."""
    import torch

    with torch.no_grad():
        for k, p in model.named_parameters():
            t = tensors.get(f"model.{k}")
            if t is None or t.shape != p.shape:
                raise ConfigError(f"{error} ({k})")
            p.copy_(t)


def load_state(out: Path, model: Any, opt: Any) -> dict[str, Any]:
    from safetensors.torch import load_file

    try:
        info = json.loads((out / STATE_INFO).read_text())
        tensors = load_file(str(out / STATE_WEIGHTS))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot resume from {out}: {exc}") from None
    _copy_weights(model, tensors, f"cannot resume from {out}: its weights do not fit this model")
    for i, p in enumerate(opt.param_groups[0]["params"]):
        if f"opt.{i}.exp_avg" in tensors:
            # The moments live beside their parameter; AdamW keeps its step count on the
            # CPU unless it is fused or capturable.
            opt.state[p] = {
                "exp_avg": tensors[f"opt.{i}.exp_avg"].to(p.device),
                "exp_avg_sq": tensors[f"opt.{i}.exp_avg_sq"].to(p.device),
                "step": tensors[f"opt.{i}.step"].reshape(()).clone(),
            }
    return info


def save_best(out: Path, model: Any, metrics: dict[str, float], info: dict[str, Any]) -> None:
    from wakefl.models.kws_cnn import save_model
    from wakefl.sdk.atomic_files import write_atomic

    tmp = out / ".best-tmp.safetensors"
    save_model(model, tmp)
    tmp.with_suffix(".json").replace(out / "best.json")
    tmp.replace(out / BEST)
    card = {
        "threshold": metrics["threshold"],
        "hop_s": HOP_S,
        "smoothing": SMOOTHING,
        "refractory_s": REFRACTORY_S,
        "validation": metrics,
        **info,
    }
    write_atomic(out / BEST_CARD, (json.dumps(card, indent=1) + "\n").encode())


# ---------------------------------------------------------------- training loop


def _settings_match(saved: dict[str, Any], s: PretrainSettings) -> None:
    for key in ("width", "phrase", "seed", "batch_size"):
        if saved.get(key) != getattr(s, key):
            raise ConfigError(
                f"--resume: the checkpoint was made with {key}={saved.get(key)!r}, "
                f"this run asks for {getattr(s, key)!r}"
            )


def spec_mask(feats: Any, generator: Any) -> Any:
    """Two frequency bands (up to 6 mel bins) and two time spans (up to 12 frames) per
    example, set to the example's mean log-mel."""
    import torch

    b, f, t = feats.shape
    out = feats.clone()
    mean = feats.mean(dim=(1, 2), keepdim=True)
    for size, dim, limit in ((6, 1, f), (12, 2, t)):
        for _ in range(2):
            width = torch.randint(0, size + 1, (b,), generator=generator)
            start = (torch.rand(b, generator=generator) * (limit - width)).long()
            idx = torch.arange(limit)
            m = (idx[None, :] >= start[:, None]) & (idx[None, :] < (start + width)[:, None])
            # Drawn on the CPU generator wherever the model runs, so a step's masks are
            # the same on either device.
            m = (m[:, :, None] if dim == 1 else m[:, None, :]).to(feats.device)
            out = torch.where(m, mean, out)
    return out


def augmented_log_mel(
    model: Any,
    wave: Any,
    generator: Any,
    masks: bool,
    mel_warp: float = 0.0,
    time_warp: float = 0.0,
) -> Any:
    """The model's log-mel input of `wave`, warped in frequency and time and masked. Each
    draws from `generator` only when it is on, so a run without the time warp is the run
    it was before that option existed."""
    x = model.frontend(wave)
    if mel_warp > 0:
        import torch

        from wakefl.tools.mel_warp import warp_log_mel

        cfg = model.cfg
        u = torch.rand(x.shape[0], generator=generator).numpy()
        f_max = cfg.f_max if cfg.f_max is not None else cfg.sample_rate / 2.0
        x = warp_log_mel(x, 1.0 + mel_warp * (2.0 * u - 1.0), cfg.f_min, f_max)
    if time_warp > 0:
        from wakefl.tools.time_warp import draw_warp, warp_time

        x = warp_time(x, *draw_warp(x.shape[0], x.shape[2], time_warp, generator))
    if masks:
        x = spec_mask(x, generator)
    return x


def _start_info(
    out: Path,
    s: PretrainSettings,
    manifest: Path,
    model: Any,
    opt: Any,
    resume: bool,
    init_from: Path | None,
    extra: Sequence[Path] = (),
) -> dict[str, Any]:
    """The run's state info: a new run (from `init_from`'s weights when given) or the saved
    one (model and optimizer restored) when resuming, which must name the same `extra`
    corpora."""
    info: dict[str, Any] = {
        "settings": asdict(s),
        "step": 0,
        "best": None,
        "seconds": 0.0,
        "manifest": str(manifest),
    }
    if init_from is not None and not (resume and (out / STATE_INFO).exists()):
        from wakefl.models.kws_cnn import load_model

        model.load_state_dict(_start_weights(load_model(init_from), model, init_from, s))
        info["init_from"] = str(init_from)
    if resume and (out / STATE_INFO).exists():
        try:
            saved = json.loads((out / STATE_INFO).read_text(encoding="utf-8"))["settings"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot resume from {out}: {exc}") from None
        _settings_match(saved, s)
        info = load_state(out, model, opt)
        info["settings"] = asdict(s)
    _same_extras(info, out, extra)
    return info


def _start_weights(start: Any, model: Any, init_from: Path, s: PretrainSettings) -> Any:
    """The state dict a new run starts from: `start`'s own, or a narrower model widened to
    the run's width (function-preserving, with symmetry-breaking noise)."""
    import dataclasses

    import torch

    from wakefl.models.kws_cnn.widen import widen

    if dataclasses.replace(start.cfg, width=model.cfg.width) != model.cfg:
        raise ConfigError(f"--init-from {init_from}: its frontend or version differs")
    if start.cfg.width > model.cfg.width:
        raise ConfigError(
            f"--init-from {init_from}: width {start.cfg.width} is wider than the run's {s.width}"
        )
    if start.cfg.width < model.cfg.width:
        gen = torch.Generator().manual_seed(s.seed)
        start = widen(start.float(), model.cfg.width, noise=WIDEN_NOISE, generator=gen)
    return start.state_dict()


def _train_step(
    model: Any,
    opt: Any,
    x: Any,
    y: Any,
    step: int,
    gen: Any,
    s: PretrainSettings,
    teacher: Any = None,
) -> float:
    """One optimizer step at the schedule's learning rate; returns the batch loss."""
    import torch
    import torch.nn.functional as F

    for g in opt.param_groups:
        g["lr"] = lr_at(step, s)
    gen.manual_seed(s.seed * 1_000_003 + step)  # the masks of step k depend on k alone
    feats = augmented_log_mel(model, x.to(s.device), gen, s.spec_masks, s.mel_warp, s.time_warp)
    logits = model.classify(feats)
    loss = F.cross_entropy(logits, y.to(s.device))
    if teacher is not None and s.distill_weight > 0:
        # The teacher's frontend is the student's (load_teacher checks), so it is given the
        # very same augmented view rather than computing it again.
        with torch.no_grad():
            taught = teacher.classify(feats)
        loss = (1.0 - s.distill_weight) * loss + s.distill_weight * distill_loss(
            logits, taught, s.distill_temperature
        )
    if not torch.isfinite(loss):
        raise ConfigError(f"the training loss became {loss.item()} at step {step}; lower --lr")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def distillation_in_range(weight: float, temperature: float) -> bool:
    """Whether a teacher's share of the loss is in (0, 1] and its temperature in (0, 100]
    (False for NaN)."""
    return 0.0 < weight <= 1.0 and 0.0 < temperature <= 100.0


def distill_loss(student: Any, teacher: Any, temperature: float) -> Any:
    """KL divergence from the teacher's class probabilities to the student's, both at
    `temperature`, scaled by its square so that its gradients keep the size of the label
    loss's whatever the temperature (Hinton et al., 2015)."""
    import torch.nn.functional as F

    t = float(temperature)
    return (t * t) * F.kl_div(
        F.log_softmax(student / t, dim=1),
        F.log_softmax(teacher / t, dim=1),
        log_target=True,
        reduction="batchmean",
    )


def load_teacher(s: PretrainSettings, model: Any, info: dict[str, Any], out: Path) -> Any:
    """The run's teacher (frozen, on the run's device), or None without distillation. Its
    weights digest goes into the run's state; a resumed run must name the same teacher."""
    if not s.distill_from:
        return None
    import dataclasses

    from wakefl.models.kws_cnn import load_model, weights_digest

    teacher = load_model(Path(s.distill_from))
    if dataclasses.replace(teacher.cfg, width=model.cfg.width) != model.cfg:
        raise ConfigError(f"--distill-from {s.distill_from}: its frontend or version differs")
    digest = weights_digest(Path(s.distill_from))
    if info.setdefault("teacher_digest", digest) != digest:
        raise ConfigError(
            f"--resume: the run in {out} was distilled from other weights "
            f"({info['teacher_digest'][:12]}), --distill-from {s.distill_from} is {digest[:12]}"
        )
    teacher = teacher.float().to(s.device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def _validate_and_record(
    out: Path,
    model: Any,
    data: Any,
    s: PretrainSettings,
    info: dict[str, Any],
    step: int,
    running: float,
) -> dict[str, Any]:
    """Validate after `step`, append the record to the history, keep the best model."""
    metrics = validate(model, data, s)
    record = {
        "step": step + 1,
        "samples": (step + 1) * s.batch_size,
        "loss": running,
        "lr": lr_at(step, s),
        "seconds": info["seconds"],
        **metrics,
    }
    with (out / HISTORY).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    if better(metrics, info["best"]):
        info["best"] = record
        save_best(
            out,
            model,
            metrics,
            {"step": step + 1, "samples": record["samples"], "phrase": s.phrase, "width": s.width},
        )
    return metrics


def seeded_model(s: PretrainSettings) -> tuple[Any, Any]:
    """The model of `s.width` seeded by `s.seed` on `s.device`, and its AdamW optimizer."""
    import torch

    from wakefl.models.kws_cnn import KwsCnn, ModelConfig

    torch.manual_seed(s.seed)
    model = KwsCnn(ModelConfig(width=s.width)).to(s.device)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    return model, opt


def _new_run(out: Path, s: PretrainSettings, resume: bool) -> tuple[Any, Any]:
    """The seeded model and its AdamW optimizer, for a new run in `out` (refused when `out`
    holds one and `resume` is off, or the settings name an unknown balance or an impossible
    distillation) or one to resume."""
    import torch

    if s.balance_by not in ("", *BALANCE_KEYS):
        raise ConfigError(
            f"balance_by must be one of {BALANCE_KEYS} or empty, not {s.balance_by!r}"
        )
    if s.distill_from and not distillation_in_range(s.distill_weight, s.distill_temperature):
        raise ConfigError(
            "distillation needs a weight in (0, 1] and a temperature in (0, 100], got "
            f"{s.distill_weight} and {s.distill_temperature}"
        )
    torch.set_num_threads(max(1, s.threads))
    out.mkdir(parents=True, exist_ok=True)
    if not resume and (out / STATE_INFO).exists():
        raise ConfigError(
            f"{out} already holds a pretraining run; pass --resume to continue it "
            "or choose a new --out"
        )
    return seeded_model(s)


def _out_of_time(
    t0: float, max_minutes: float | None, steps_done: int, max_steps: int | None
) -> bool:
    """Whether this call has run `max_minutes` since `t0` or taken `max_steps` steps."""
    return (max_minutes is not None and time.monotonic() - t0 > max_minutes * 60) or (
        max_steps is not None and steps_done >= max_steps
    )


@dataclass
class _Run:
    """What the training loop works on, across the segments between two minings: the run's
    objects, its clock and its running loss."""

    out: Path
    model: Any
    opt: Any
    data: PretrainData
    s: PretrainSettings
    info: dict[str, Any]
    gen: Any  # torch.Generator of the spectrogram masks and the warp
    bar: Any  # tqdm progress bar
    t0: float
    last_ckpt: float
    seconds0: float
    start_step: int
    max_minutes: float | None
    max_steps: int | None
    running: float | None = None
    teacher: Any = None  # the frozen teacher model when distilling


def _mine_pool(run: _Run, step: int) -> None:
    """Renew the pool of hard negatives before `step` (tools/hard_negatives.py); the pool's
    descriptors go into the run's state."""
    from wakefl.tools.hard_negatives import mine

    model, data, s = run.model, run.data, run.s
    was = model.training
    model.eval()
    try:
        desc = mine(
            lambda w: score_batches(model, w),
            data.train_streams,
            data.neg,
            data.window,
            s.mine_candidates,
            s.hard_pool,
            s.seed,
            step,
        )
    finally:
        model.train(was)
    _use_pool(run, desc)
    run.info["hard_pool_step"] = step


def _use_pool(run: _Run, desc: np.ndarray) -> None:
    """Train on the pool these descriptors name, and keep them in the run's state."""
    from wakefl.tools.hard_negatives import windows_of

    data = run.data
    data.hard = windows_of(desc, data.train_streams, data.neg, data.window)
    run.info["hard_pool"] = desc.tolist()


def _restore_pool(run: _Run) -> None:
    """The pool a resumed run's checkpoint holds; refused when it names audio this corpus
    lacks (a checkpoint made on another corpus)."""
    from wakefl.tools.hard_negatives import fits

    desc = np.asarray(run.info["hard_pool"], np.int64).reshape(-1, 3)
    if not fits(desc, run.data.train_streams, len(run.data.neg), run.data.window):
        raise ConfigError(
            f"--resume: the hard-negative pool in {run.out} names audio this corpus lacks "
            "(was the run made on another corpus?)"
        )
    _use_pool(run, desc)


def _same_extras(info: dict[str, Any], out: Path, extra: Sequence[Path]) -> None:
    """Record the add-on corpora of a new run; a resumed run must name the same ones, or
    its batches and mined pool would change under it."""
    extras = [str(p) for p in extra]
    if info.setdefault("extra_manifests", extras) != extras:
        raise ConfigError(
            f"--resume: the run in {out} was trained with --extra-corpus "
            f"{info['extra_manifests'] or 'none'}, this run names {extras or 'none'}"
        )


def _segment_end(step: int, s: PretrainSettings) -> int:
    """The step before which the pool is next renewed (the run's end without mining)."""
    if s.hard_negative_share <= 0:
        return s.total_steps
    return min(s.total_steps, (step // s.mine_every_steps + 1) * s.mine_every_steps)


def _train_segment(run: _Run, first: int, end: int) -> tuple[int, bool]:
    """Train steps `first` to `end`; returns the next step and whether the run stops (done,
    or out of time in this call)."""
    s, info = run.s, run.info
    step = first
    for step, (x, y) in enumerate(
        batch_stream(run.data, first, s, workers=s.workers, end_step=end), start=first
    ):
        loss = _train_step(run.model, run.opt, x, y, step, run.gen, s, run.teacher)
        run.running = loss if run.running is None else 0.98 * run.running + 0.02 * loss
        info["step"] = step + 1
        info["seconds"] = run.seconds0 + time.monotonic() - run.t0
        run.bar.update(1)
        done = step + 1 >= s.total_steps
        out_of_time = _out_of_time(
            run.t0, run.max_minutes, step + 1 - run.start_step, run.max_steps
        )
        if (step + 1) % s.eval_every_steps == 0 or done or out_of_time:
            metrics = _validate_and_record(run.out, run.model, run.data, s, info, step, run.running)
            run.bar.set_postfix(
                loss=f"{run.running:.3f}",
                frr=f"{metrics['frr']:.3f}",
                best=f"{info['best']['frr']:.3f}",
            )
        if done or out_of_time or time.monotonic() - run.last_ckpt > s.checkpoint_minutes * 60:
            save_state(run.out, run.model, run.opt, info)
            run.last_ckpt = time.monotonic()
        if done or out_of_time:
            return step + 1, True
    return end, False


def _progress_bar(s: PretrainSettings, step: int, progress: bool) -> Any:
    """The run's tqdm bar over its steps, starting at `step`."""
    from tqdm import tqdm

    return tqdm(
        total=s.total_steps,
        initial=step,
        desc=f"pretrain w{s.width}",
        unit="step",
        disable=bar_disabled(progress),
    )


def pretrain(
    manifest: Path,
    out: Path,
    s: PretrainSettings,
    resume: bool = False,
    init_from: Path | None = None,
    max_minutes: float | None = None,
    progress: bool = True,
    max_steps: int | None = None,
    extra: Sequence[Path] = (),
) -> dict[str, Any]:
    """Train (or resume) into `out`; returns the final state info. Stops at `s.samples` or
    after `max_minutes` or `max_steps` in this call (checkpointing first). `init_from` starts a
    new run from saved weights (no optimizer state); `extra` corpora add training audio."""
    import torch

    from wakefl.sdk.atomic_files import write_atomic

    model, opt = _new_run(out, s, resume)
    info = _start_info(out, s, manifest, model, opt, resume, init_from, extra)
    teacher = load_teacher(s, model, info, out)  # checked before the corpus's long decode
    data = load_pretrain_data(
        manifest, model.cfg.window_samples, s.val_stream_seconds, progress, s.seed, extra
    )
    step = int(info["step"])
    bar = _progress_bar(s, step, progress)
    now = time.monotonic()
    run = _Run(
        out=out,
        model=model,
        opt=opt,
        data=data,
        s=s,
        info=info,
        gen=torch.Generator(),
        bar=bar,
        t0=now,
        last_ckpt=now,
        seconds0=float(info["seconds"]),
        start_step=step,
        max_minutes=max_minutes,
        max_steps=max_steps,
        teacher=teacher,
    )
    if s.hard_negative_share > 0 and info.get("hard_pool"):
        _restore_pool(run)
    model.train()
    stopped = False
    while step < s.total_steps and not stopped:
        if s.hard_negative_share > 0 and (step % s.mine_every_steps == 0 or data.hard is None):
            _mine_pool(run, step)
        step, stopped = _train_segment(run, step, _segment_end(step, s))
    bar.close()
    write_atomic(out / STATE_INFO, (json.dumps(info, indent=1) + "\n").encode())
    return info


def shipped_operating_point(model: Any, manifest: Path, target_frr: float) -> dict[str, float]:
    """The shipped threshold: where the validation clips' false-reject rate is `target_frr`
    (a device maker ships a detector that hears its owner), with the clip false-accept rate
    there. The stream false accepts per hour at it are what the detection benchmark reports."""
    from wakefl.sdk.dataset import load_clip
    from wakefl.sdk.manifest import read_manifest

    rows = [r for r in read_manifest(manifest) if r.kind == "clip" and r.split == "val"]
    if not any(r.label == 1 for r in rows):
        raise ConfigError(f"{manifest}: no validation wake-phrase clips to set the threshold on")
    waves = np.stack([load_clip(r.resolve(manifest), model.cfg.window_samples) for r in rows])
    scores = score_batches(model, waves)
    labels = np.array([r.label for r in rows])
    pos, neg = scores[labels == 1], scores[labels == 0]
    thr = float(np.quantile(pos, target_frr, method="lower"))
    return {
        "threshold": thr,
        "val_frr": float(np.mean(pos < thr)),
        "val_clip_far": float(np.mean(neg >= thr)),
        "target_frr": target_frr,
    }


def _last_checkpoint(run: Path, model: Any, best_card: dict[str, Any]) -> dict[str, Any]:
    """Load the run's last checkpoint into `model` (the best model's architecture) and
    return its card: the best card's settings with the validation figures of that step.
    The validation criterion is noisy on a few validation streams; a benchmark on more
    audio may prefer the last step (MODEL_CARD.md, how `full` was made)."""
    from safetensors.torch import load_file

    try:
        info = json.loads((run / STATE_INFO).read_text(encoding="utf-8"))
        tensors = load_file(str(run / STATE_WEIGHTS))
        history = [json.loads(x) for x in (run / HISTORY).read_text().splitlines() if x.strip()]
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{run}: no readable last checkpoint ({exc})") from None
    step = info.get("step")
    metrics = next((h for h in reversed(history) if h.get("step") == step), None)
    if metrics is None:
        raise ConfigError(f"{run}: the last checkpoint (step {step}) was not validated")
    _copy_weights(model, tensors, f"{run}: the last checkpoint does not fit the model")
    keys = ("threshold", "frr", "clip_far", "frr_at_half", "far_at_half", "val_stream_hours")
    validation = {k: metrics[k] for k in keys if k in metrics}
    return {
        **best_card,
        "threshold": metrics["threshold"],
        "validation": validation,
        "step": step,
        "samples": metrics.get("samples"),
        "checkpoint": "last",
    }


def stream_operating_point(bench_json: Path, digest: str) -> dict[str, Any]:
    """The one-threshold-for-all-types operating point that `bench_detection --split val`
    set on the validation streams, refused unless that benchmark scored these very weights
    (their `weights_digest`) and its streams resolve the FA rate."""
    src = f"set-threshold --from {bench_json}"
    try:
        bench = json.loads(Path(bench_json).read_text(encoding="utf-8"))
        pooled = bench["fp32"]["validation"]["_pooled"]
        thr = float(pooled["threshold"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{src}: not the JSON of a `bench_detection --split val` run ({exc!r})"
        ) from None
    if bench.get("weights_digest") != digest:
        raise ConfigError(
            f"{src}: it scored other weights ({bench.get('model')}); score these with "
            "`bench_detection --weights W --split val --json JSON` and give that JSON"
        )
    target = pooled.get("fa_per_hour_target")
    if not pooled.get("resolved"):
        raise ConfigError(
            f"{src}: {pooled.get('stream_hours')} h of validation stream cannot resolve "
            f"{target} FA/h (build and add `--profile pretrain-valstreams`)"
        )
    if not 0.0 < thr <= 1.0:
        raise ConfigError(
            f"{src}: no threshold keeps the validation streams within {target} FA/h "
            f"(it reports {thr})"
        )
    return {"set_on": "validation streams, all device types", **pooled}


def set_stream_threshold(weights: Path, bench_json: Path) -> dict[str, Any]:
    """Ship `weights` (a published model: its card and config JSON beside it) at the
    threshold that `bench_detection --split val` set on the validation streams of all
    device types (`stream_operating_point`); the clip-set threshold it replaces stays in
    the card. Returns the new card."""
    from wakefl.models.kws_cnn import read_config, weights_digest
    from wakefl.models.kws_cnn.checkpoint import config_path
    from wakefl.models.kws_cnn.pretrained import card_beside
    from wakefl.sdk.atomic_files import write_atomic

    read_config(weights)  # a model this code can load, or a clear error
    card = card_beside(weights)
    if card is None:
        raise ConfigError(f"{weights}: no card beside it; publish the model first")
    point = stream_operating_point(bench_json, weights_digest(weights))
    card.setdefault("clip_threshold", card["threshold"])
    card["stream_operating_point"] = point
    card["threshold"] = point["threshold"]
    meta = json.loads(config_path(weights).read_text(encoding="utf-8"))
    meta["shipped_threshold"] = card["threshold"]
    # The card first: a crash between the two leaves the config's old threshold, which
    # a second run mends; never a config that claims a threshold its card lacks.
    card_path = Path(weights).with_suffix(".card.json")
    write_atomic(card_path, (json.dumps(card, indent=1) + "\n").encode())
    write_atomic(config_path(weights), (json.dumps(meta, indent=2) + "\n").encode())
    return card


def _run_manifest(run: Path) -> Path | None:
    """The corpus manifest a run was trained on, when it is still there."""
    if not (run / STATE_INFO).exists():
        return None
    saved = json.loads((run / STATE_INFO).read_text(encoding="utf-8")).get("manifest")
    return Path(saved) if saved and Path(saved).exists() else None


def _round_to_fp16(model: Any) -> dict[str, Any]:
    """The model's parameters in fp16, as they ship. The model takes the rounded values
    too, so that a threshold set with it holds for the shipped file."""
    import torch

    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in model.named_parameters()}
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(tensors[k].float())
    return tensors


def publish(
    run: Path,
    name: str,
    dest: Path | None = None,
    manifest: Path | None = None,
    target_frr: float = 0.05,
    checkpoint: str = "best",
) -> Path:
    """Copy a run's best model (or, with `checkpoint="last"`, its last checkpoint) into the
    shipped-models folder as fp16 safetensors, with its JSON config and operating-point
    card. With a corpus `manifest` (default: the run's own) the shipped threshold is set on
    its validation clips at `target_frr`, scored with the fp16 weights that ship; otherwise
    the run's validation threshold is kept (`set_stream_threshold` may replace it later)."""
    from wakefl.models.kws_cnn import load_model
    from wakefl.models.kws_cnn.pretrained import NAMES, PRETRAINED_DIR

    if name not in NAMES:
        raise ConfigError(f"a shipped model is one of {', '.join(NAMES)}, got {name!r}")
    if checkpoint not in ("best", "last"):
        raise ConfigError(f"checkpoint must be best or last, got {checkpoint!r}")
    dest = PRETRAINED_DIR if dest is None else dest
    dest.mkdir(parents=True, exist_ok=True)
    model = load_model(run / BEST)
    card = json.loads((run / BEST_CARD).read_text(encoding="utf-8"))
    if checkpoint == "last":
        card = _last_checkpoint(run, model, card)
    tensors = _round_to_fp16(model)
    manifest = manifest if manifest is not None else _run_manifest(run)
    if manifest is not None:
        card["threshold_at_val_fa_per_hour"] = card["threshold"]
        card["operating_point"] = shipped_operating_point(model, manifest, target_frr)
        card["threshold"] = card["operating_point"]["threshold"]
    meta = json.loads((run / "best.json").read_text(encoding="utf-8"))
    return _write_shipped(dest / f"{name}.safetensors", tensors, model.cfg, card, meta)


DETECTOR_SETTINGS = ("hop_s", "smoothing", "refractory_s", "phrase", "width")


def publish_blend(
    first: Path,
    second: Path,
    alpha: float,
    name: str,
    manifest: Path,
    dest: Path | None = None,
    target_frr: float = 0.05,
) -> Path:
    """Ship the blend (1 - alpha) * first + alpha * second of two published models as
    fp16 model `name`, at the threshold its fp16 weights give on the validation clips of
    `manifest` at `target_frr` (as `publish` does; `set_stream_threshold` may replace it).
    Its card names both parents by weights digest, so the blend can be made again."""
    from wakefl.models.kws_cnn import load_model, weights_digest
    from wakefl.models.kws_cnn.blend import blend

    settings = _check_parents((first, second), name)
    model = blend(load_model(first), load_model(second), alpha)
    parents = {
        "alpha": float(alpha),
        "first": {"file": Path(first).name, "weights_digest": weights_digest(first)},
        "second": {"file": Path(second).name, "weights_digest": weights_digest(second)},
    }
    card = (settings, {"blend": parents})
    return _publish_mixed(model, first, card, name, manifest, dest, target_frr)


def publish_soup(
    weights: Sequence[Path],
    shares: Sequence[float],
    name: str,
    manifest: Path,
    dest: Path | None = None,
    target_frr: float = 0.05,
) -> Path:
    """Ship the weighted average of several published models (`average`) as fp16 model
    `name`, at its threshold on `manifest`'s validation clips, as `publish_blend` does.
    Its card lists each parent's weights digest and share."""
    from wakefl.models.kws_cnn import load_model, weights_digest
    from wakefl.models.kws_cnn.blend import average

    settings = _check_parents(weights, name)
    model = average([load_model(w) for w in weights], shares)
    parents = [
        {"file": Path(w).name, "weights_digest": weights_digest(w), "share": float(s)}
        for w, s in zip(weights, shares, strict=True)
    ]
    card = (settings, {"soup": parents})
    return _publish_mixed(model, weights[0], card, name, manifest, dest, target_frr)


def _check_parents(weights: Sequence[Path], name: str) -> dict[str, Any]:
    """The detector settings every parent ships; ConfigError unless `name` is a shipped
    model's name and every parent is a published model (a card beside it), all shipping
    the same detector settings."""
    from wakefl.models.kws_cnn.pretrained import NAMES, card_beside

    if name not in NAMES:
        raise ConfigError(f"a shipped model is one of {', '.join(NAMES)}, got {name!r}")
    settings = []
    for w in weights:
        card = card_beside(w)
        if card is None:
            raise ConfigError(f"{w}: no card beside it; mix published models only")
        settings.append({k: card.get(k) for k in DETECTOR_SETTINGS})
    if any(s != settings[0] for s in settings[1:]):
        raise ConfigError(f"the models ship different detector settings: {settings}")
    return settings[0]


def _publish_mixed(
    model: Any,
    config_from: Path,
    card_parts: tuple[dict[str, Any], dict[str, Any]],
    name: str,
    manifest: Path,
    dest: Path | None,
    target_frr: float,
) -> Path:
    """Round a mixed model to fp16, set its threshold on the validation clips and ship it
    with `config_from`'s config JSON and a card of its parents' detector settings, its
    operating point and its provenance (`card_parts`: settings, provenance)."""
    from wakefl.models.kws_cnn.checkpoint import config_path
    from wakefl.models.kws_cnn.pretrained import PRETRAINED_DIR

    tensors = _round_to_fp16(model)
    point = shipped_operating_point(model, manifest, target_frr)
    settings, provenance = card_parts
    card = {**settings, "threshold": point["threshold"], "operating_point": point, **provenance}
    meta = json.loads(config_path(config_from).read_text(encoding="utf-8"))
    dest = PRETRAINED_DIR if dest is None else dest
    dest.mkdir(parents=True, exist_ok=True)
    return _write_shipped(dest / f"{name}.safetensors", tensors, model.cfg, card, meta)


def _write_shipped(
    out: Path, tensors: dict[str, Any], cfg: Any, card: dict[str, Any], meta: dict[str, Any]
) -> Path:
    """Write a shipped model's fp16 weights, config JSON and card; the weights last, by an
    atomic rename, so a crash never leaves a half-written model under its name."""
    from safetensors.torch import save_file

    from wakefl.sdk.atomic_files import write_atomic

    tmp = out.with_name(f".{out.stem}.tmp.safetensors")
    save_file(
        tensors, str(tmp), metadata={"architecture": "kws_cnn", "config": json.dumps(cfg.to_dict())}
    )
    # The config JSON also carries the shipped threshold, where `wakefl eval
    # --at-shipped-threshold` looks for a model's operating point.
    meta = {**meta, "shipped_threshold": card["threshold"]}
    write_atomic(out.with_suffix(".json"), (json.dumps(meta, indent=2) + "\n").encode())
    write_atomic(out.with_suffix(".card.json"), (json.dumps(card, indent=1) + "\n").encode())
    tmp.chmod(0o644)  # shipped with the package: readable by every user
    tmp.replace(out)
    return out
