"""The warm-start baseline: one wake-word model trained on the pooled training data of all
device types, before any federated round. Relative FA/FR are measured against it, and the
federation starts from it. Training it is the slowest step of a demo or study, so it is
cached by a content hash of everything that determines it."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from wakefl.cache_location import cache_root
from wakefl.operating_point import with_shipped_threshold

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


def baseline_key(
    manifest: Path, width: float, seed: int, epochs: int, lr: float, batch_size: int
) -> str:
    recipe = {
        "v": RECIPE_VERSION,
        "width": width,
        "seed": seed,
        "epochs": epochs,
        "lr": lr,
        "batch_size": batch_size,
        "corpus": _corpus_fingerprint(manifest),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:20]


def _pooled_train_clips(manifest: Path, window_samples: int, seed: int) -> tuple[list[str], Any]:
    """The device types with training clips, and their augmented train splits pooled."""
    from torch.utils.data import ConcatDataset

    from wakefl.sdk.dataset import WakeWordDataset
    from wakefl.sdk.manifest import read_manifest

    device_types = sorted(
        {r.device_type for r in read_manifest(manifest) if r.kind == "clip" and r.split == "train"}
    )
    pooled: ConcatDataset[Any] = ConcatDataset(
        [
            WakeWordDataset(
                manifest, dt, "train", window_samples=window_samples, augment=True, seed=seed
            )
            for dt in device_types
        ]
    )
    return device_types, pooled


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

    from wakefl.models.kws_cnn import KwsCnn, ModelConfig, save_model
    from wakefl.sdk.local_training import train_supervised

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
    device_types, pooled = _pooled_train_clips(manifest, cfg.window_samples, seed)
    torch.manual_seed(seed)
    model = KwsCnn(cfg)
    if progress:
        print(
            f"[warm-start] training the baseline on {len(pooled)} pooled clips of "
            f"{len(device_types)} device types, width {width}, {epochs} epochs"
        )
    train_supervised(
        model, pooled, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed, progress=progress
    )
    cache.mkdir(parents=True, exist_ok=True)
    # Write under a temporary name, then rename both files: a crash never leaves a
    # half-written checkpoint that a later run would take for a cached one.
    tmp = cache / f".tmp-{key}-{os.getpid()}.safetensors"
    save_model(model, tmp)
    os.replace(tmp.with_suffix(".json"), out.with_suffix(".json"))
    os.replace(tmp, out)
    return out


# The shipped model of each width: a run at one of these widths starts from it by default.
PRETRAINED_BY_WIDTH = {0.25: "small", 1.0: "full"}
BASELINE_CHOICES = (
    "'pretrained', 'pretrained:small', 'pretrained:full', 'scratch' or a .safetensors path"
)


def pretrained_checkpoint(name: str, cache_dir: Path | str | None = None) -> Path:
    """The shipped model `name` as a float32 checkpoint (safetensors + JSON config) in the
    cache: every part of wakefl that takes a checkpoint path can start from it. The card
    (its shipped threshold) is copied beside it."""
    import shutil

    from wakefl.models.kws_cnn import save_model
    from wakefl.models.kws_cnn.pretrained import load_pretrained, pretrained_card, pretrained_path

    src = pretrained_path(name)
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    cache = Path(cache_dir) if cache_dir is not None else cache_root() / "baselines"
    out = cache / f"pretrained-{name}-{digest}.safetensors"
    if out.exists() and out.with_suffix(".json").exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".tmp-pretrained-{name}-{os.getpid()}.safetensors"
    save_model(load_pretrained(name), tmp)
    shutil.copy(src.with_suffix(".card.json"), out.with_suffix(".card.json"))
    meta = with_shipped_threshold(
        json.loads(tmp.with_suffix(".json").read_text(encoding="utf-8")),
        pretrained_card(name)["threshold"],
    )
    tmp.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp.with_suffix(".json"), out.with_suffix(".json"))
    os.replace(tmp, out)
    return out


def resolve_baseline(
    spec: str | Path | None,
    manifest: Path | str | None,
    width: float,
    seed: int = 0,
    cache_dir: Path | str | None = None,
    epochs: int | None = None,
    progress: bool = True,
) -> Path:
    """The warm-start checkpoint a run starts from.

    `spec`: None or "pretrained" takes the shipped model of `width` (small at 0.25, full at
    1.0) and trains from scratch at other widths; "pretrained:NAME" takes that shipped
    model whatever `width` says; "scratch" trains on `manifest`'s pooled training data (the
    old behaviour, cached); anything else is a checkpoint path."""
    from wakefl.errors import ConfigError
    from wakefl.models.kws_cnn.pretrained import NAMES, is_available

    text = "pretrained" if spec is None else str(spec)
    if text == "pretrained":
        name = PRETRAINED_BY_WIDTH.get(float(width))
        # An installation without the shipped files (a stripped package) still runs.
        text = f"pretrained:{name}" if name and is_available(name) else "scratch"
    if text.startswith("pretrained:"):
        name = text.split(":", 1)[1]
        if name not in NAMES:
            raise ConfigError(f"unknown shipped model {name!r}; the baseline is {BASELINE_CHOICES}")
        if progress:
            print(
                f"[warm-start] starting from the shipped pretrained model '{name}'", file=sys.stderr
            )
        return pretrained_checkpoint(name, cache_dir)
    if text == "scratch":
        if manifest is None:
            raise ConfigError("training a baseline from scratch needs a corpus manifest")
        return train_or_load_baseline(
            manifest, width=width, seed=seed, cache_dir=cache_dir, epochs=epochs, progress=progress
        )
    path = Path(text)
    if path.suffix != ".safetensors" or not path.is_file():
        raise ConfigError(
            f"baseline {text!r} is not an existing .safetensors checkpoint; the "
            f"baseline is {BASELINE_CHOICES}"
        )
    return path
