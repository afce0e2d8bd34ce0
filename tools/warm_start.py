"""The warm-start baseline: one wake-word model trained on the pooled training data of all
device types, before any federated round. Relative FA/FR are measured against it, and the
federation starts from it. Training it is the slowest step of a demo or study, so it is
cached by a content hash of everything that determines it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from wakefl.cache_location import cache_root

# Bump when the training recipe changes, so stale cached baselines are not reused.
RECIPE_VERSION = 1


def _corpus_fingerprint(manifest: Path) -> str:
    """Hash of the manifest plus each referenced file's size: cheap, and it changes when a
    corpus is rebuilt or re-imported differently."""
    from wakefl.sdk.manifest import read_manifest

    h = hashlib.sha256(manifest.read_bytes())
    for row in read_manifest(manifest):
        f = manifest.parent / row.path
        h.update(f"{row.path}:{f.stat().st_size if f.exists() else -1}".encode())
    return h.hexdigest()


def baseline_key(manifest: Path, width: float, seed: int, epochs: int, lr: float,
                 batch_size: int) -> str:
    recipe = {"v": RECIPE_VERSION, "width": width, "seed": seed, "epochs": epochs, "lr": lr,
              "batch_size": batch_size, "corpus": _corpus_fingerprint(manifest)}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:20]


def train_or_load_baseline(
    manifest: Path | str,
    width: float,
    seed: int = 0,
    cache_dir: Path | str | None = None,
    epochs: int | None = None,
    lr: float = 1e-3,
    batch_size: int = 32,
    progress: bool = True,
) -> Path:
    """Path of the warm-start checkpoint (safetensors + JSON config beside it), trained on
    the pooled train split of every device type in `manifest` unless a checkpoint with the
    same recipe is already cached."""
    import torch
    from torch.utils.data import ConcatDataset

    from wakefl.models.kws_cnn import KwsCnn, ModelConfig, save_model
    from wakefl.sdk.dataset import WakeWordDataset
    from wakefl.sdk.local_training import train_supervised
    from wakefl.sdk.manifest import read_manifest

    manifest = Path(manifest).resolve()
    epochs = 8 if epochs is None else epochs
    cache = Path(cache_dir) if cache_dir is not None else cache_root() / "baselines"
    key = baseline_key(manifest, width, seed, epochs, lr, batch_size)
    out = cache / f"baseline-{key}.safetensors"
    if out.exists() and out.with_suffix(".json").exists():
        if progress:
            print(f"[warm-start] reusing cached baseline {out}")
        return out

    cfg = ModelConfig(width=width)
    device_types = sorted({r.device_type for r in read_manifest(manifest)
                           if r.kind == "clip" and r.split == "train"})
    pooled = ConcatDataset([
        WakeWordDataset(manifest, dt, "train", window_samples=cfg.window_samples,
                        augment=True, seed=seed)
        for dt in device_types
    ])
    torch.manual_seed(seed)
    model = KwsCnn(cfg)
    if progress:
        print(f"[warm-start] training the baseline on {len(pooled)} pooled clips of "
              f"{len(device_types)} device types, width {width}, {epochs} epochs")
    train_supervised(model, pooled, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed,
                     progress=progress)
    cache.mkdir(parents=True, exist_ok=True)
    # Write under a temporary name, then rename both files: a crash never leaves a
    # half-written checkpoint that a later run would take for a cached one.
    tmp = cache / f".tmp-{key}-{os.getpid()}.safetensors"
    save_model(model, tmp)
    os.replace(tmp.with_suffix(".json"), out.with_suffix(".json"))
    os.replace(tmp, out)
    return out
