"""Rendered training windows, cached: the augmented batches of a run's first steps as
log-mel spectrograms (float16), written once and trained over by every run that shares
their augmentation, whatever its model.

On this project's 2-core machines the field and context stages cost several milliseconds
a window, about as much as a training step of the small model: an ablation of five model
variants would render the same windows five times. A cache renders them once (in chunks,
each written atomically, so a killed render resumes where it stopped), and a run over it
draws each batch from the cache by its step alone, so it stays a pure function of
(seed, step). The spectrogram masks and warps still apply on the fly. Hard-negative mining
over a cache (tools/training/hard_negatives.py) scores its rendered negatives and draws a
share of each batch's negatives from the highest-scoring ones.

Layout: DIR/cache.json (what was rendered: the corpus, the augmentation settings, the
frontend) and DIR/windows-NNNN.npz (log_mel [n, n_mels, frames] float16, labels [n])."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.tools.training.settings import PretrainSettings

INFO = "cache.json"
CHUNK_STEPS = 64  # batches per chunk file
# The settings that change what a window is; the rest (model, learning rate) do not.
RENDER_KEYS = (
    "seed",
    "batch_size",
    "positive_share",
    "stream_crop_share",
    "balance_by",
    "field_augment",
    "field_preset",
    "speech_backgrounds",
    "context_speech",
    "samples",
)
# Settings added after caches were rendered without them, with the value those caches had:
# named only when a run sets another, so those caches stay reusable by runs that do not.
LATER_RENDER_KEYS = {
    "noise_snr_floor": None,
    "speech_source": "negatives",
    "speech_over_near_rhymes": True,
    "speech_over_stream_near_rhymes": True,
}


def render_settings(
    s: PretrainSettings, manifest: Path, extra: list[Path], frontend: dict[str, Any]
) -> dict[str, Any]:
    """What the windows of a cache depend on: compared before a cache is reused."""
    d = {**dataclasses.asdict(s), "samples": s.cache_windows}
    out = {
        "frontend": frontend,
        "corpus": str(manifest.resolve()),
        "extra": [str(p.resolve()) for p in extra],
        **{k: d[k] for k in RENDER_KEYS},
    }
    out.update({k: d[k] for k, was in LATER_RENDER_KEYS.items() if d[k] != was})
    return out


def _chunk(folder: Path, k: int) -> Path:
    return folder / f"windows-{k:04d}.npz"


def render_window_cache(
    folder: Path,
    data: Any,
    s: PretrainSettings,
    frontend: Any,
    meta: dict[str, Any],
    windows: int,
    progress: bool = True,
) -> None:
    """Renders `windows` windows (whole chunks) of `s`'s batches into `folder`, skipping
    chunks already there; refuses a folder rendered with other settings. The batches are
    those of a run of `windows` samples, so any schedule over a run's length (the context
    stage's curriculum) spans the cache."""
    import torch
    from tqdm import tqdm

    from wakefl.progress_bars import bar_disabled
    from wakefl.sdk.atomic_files import write_atomic
    from wakefl.tools.training.data import batch_stream

    folder.mkdir(parents=True, exist_ok=True)
    info_path = folder / INFO
    if info_path.exists():
        saved = json.loads(info_path.read_text())
        if saved.get("render") != meta:
            raise ConfigError(f"{folder}: a window cache rendered with other settings")
    write_atomic(info_path, (json.dumps({"render": meta}, indent=1) + "\n").encode())
    s = dataclasses.replace(s, samples=windows)
    chunks = -(-windows // (CHUNK_STEPS * s.batch_size))
    todo = [k for k in range(chunks) if not _chunk(folder, k).exists()]
    bar = tqdm(total=len(todo), desc="render windows", unit="chunk", disable=bar_disabled(progress))
    for k in todo:
        first = k * CHUNK_STEPS
        mels, labels = [], []
        for x, y in batch_stream(data, first, s, workers=s.workers, end_step=first + CHUNK_STEPS):
            with torch.no_grad():
                mels.append(frontend(x).numpy().astype(np.float16))
            labels.append(y.numpy().astype(np.int8))
        tmp = folder / f".tmp-{k:04d}.npz"
        np.savez(tmp, log_mel=np.concatenate(mels), labels=np.concatenate(labels))
        tmp.replace(_chunk(folder, k))
        bar.update(1)
    bar.close()


@dataclass(frozen=True)
class WindowCache:
    log_mel: np.ndarray  # [N, n_mels, frames] float16
    labels: np.ndarray  # [N]

    @classmethod
    def load(cls, folder: Path) -> WindowCache:
        files = sorted(folder.glob("windows-*.npz"))
        if not files:
            raise ConfigError(f"{folder}: no rendered windows")
        parts = [np.load(f) for f in files]
        return cls(
            np.concatenate([p["log_mel"] for p in parts]),
            np.concatenate([p["labels"] for p in parts]).astype(np.int64),
        )

    def reached(self, step: int, s: PretrainSettings) -> int:
        """How many windows, from the first rendered, a batch of `step` may draw from: the
        windows rendered first early in the run (the context stage's ratio floor comes down
        over the rendering, so this keeps its curriculum), all of them after the first
        half."""
        reach = min(1.0, 0.25 + 1.5 * step / max(1, s.total_steps))
        return max(s.batch_size, int(reach * len(self.labels)))

    def negatives(self, step: int, s: PretrainSettings) -> np.ndarray:
        """The indices of the negative windows a batch of `step` may draw from (mining's
        candidates)."""
        return np.flatnonzero(self.labels[: self.reached(step, s)] == 0)

    def batch(
        self, step: int, s: PretrainSettings, pool: np.ndarray | None = None
    ) -> tuple[Any, Any]:
        """The cached batch of `step`, drawn by step alone: the run's share of phrases, the
        rest negatives, `s.hard_negative_share` of them from `pool` (cache indices of mined
        hard negatives) when one is given. The pool's draws come from a generator of their
        own, so a run without one draws the batches it drew before mining existed."""
        import torch

        rng = np.random.default_rng([s.seed, 83, step])
        seen = self.labels[: self.reached(step, s)]
        pos, neg = np.flatnonzero(seen == 1), np.flatnonzero(seen == 0)
        n_pos = max(1, int(round(s.batch_size * s.positive_share)))
        idx = np.concatenate([rng.choice(pos, n_pos), rng.choice(neg, s.batch_size - n_pos)])
        if pool is not None and len(pool) and s.hard_negative_share > 0:
            n_hard = int(round((s.batch_size - n_pos) * s.hard_negative_share))
            hard = np.random.default_rng([s.seed, 89, step]).choice(pool, n_hard)
            idx[n_pos : n_pos + n_hard] = hard
        x = torch.from_numpy(self.log_mel[idx].astype(np.float32))
        return x, torch.from_numpy(self.labels[idx])
