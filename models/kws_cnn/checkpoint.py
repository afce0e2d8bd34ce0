"""Checkpoints: trainable weights in safetensors, the configuration as JSON beside them
(`model.safetensors` + `model.json`). Loading checks the two against each other and
refuses any mismatch instead of silently loading a different model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from wakefl.errors import ConfigError

from .config import ARCHITECTURE, SUPPORTED_VERSIONS, ModelConfig
from .model import KwsCnn


def config_path(weights_path: Path | str) -> Path:
    return Path(weights_path).with_suffix(".json")


def save_model(model: KwsCnn, path: Path | str) -> Path:
    """Writes `path` (safetensors, trainable parameters only) and its `.json` config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().cpu().contiguous() for name, p in model.named_parameters()}
    meta = {
        "architecture": ARCHITECTURE,
        "version": model.cfg.version,
        "config": model.cfg.to_dict(),
        "trainable_params": model.num_trainable_params(),
    }
    save_file(
        tensors,
        str(path),
        metadata={"architecture": ARCHITECTURE, "config": json.dumps(meta["config"])},
    )
    config_path(path).write_text(json.dumps(meta, indent=2) + "\n")
    return path


def read_config(path: Path | str) -> ModelConfig:
    """The `ModelConfig` stored beside checkpoint `path` (validated)."""
    cpath = config_path(path)
    if not cpath.exists():
        raise ConfigError(f"model config {cpath} not found (expected beside {path})")
    try:
        meta = json.loads(cpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"model config {cpath} is not valid JSON: {exc}") from exc
    if not isinstance(meta, dict) or "config" not in meta:
        raise ConfigError(f"model config {cpath} has no 'config' object")
    if meta.get("architecture") != ARCHITECTURE:
        raise ConfigError(
            f"{cpath}: architecture {meta.get('architecture')!r} is not {ARCHITECTURE!r}"
        )
    version = meta.get("version")
    if version not in SUPPORTED_VERSIONS:
        raise ConfigError(
            f"{cpath}: unknown model version {version!r}; this build supports {SUPPORTED_VERSIONS}"
        )
    cfg = ModelConfig.from_dict(meta["config"])
    if cfg.version != version:
        raise ConfigError(f"{cpath}: version {version} disagrees with config version {cfg.version}")
    return cfg


def load_model(path: Path | str) -> KwsCnn:
    """Rebuilds the model from its JSON config and loads the safetensors weights, refusing
    missing, extra or wrongly shaped tensors."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"checkpoint {path} not found")
    cfg = read_config(path)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"checkpoint {path} is not a readable safetensors file: {exc}") from exc
    model = KwsCnn(cfg)
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    wrong = sorted(
        f"{k} {tuple(tensors[k].shape)} != {tuple(v.shape)}"
        for k, v in expected.items()
        if k in tensors and tensors[k].shape != v.shape
    )
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}")
        if wrong:
            parts.append(f"wrong shape {wrong[:5]}{'...' if len(wrong) > 5 else ''}")
        raise ConfigError(
            f"checkpoint {path} does not match its config (width {cfg.width}): " + "; ".join(parts)
        )
    with torch.no_grad():
        for name, p in expected.items():
            t = tensors[name]
            if not torch.isfinite(t).all():
                raise ConfigError(f"checkpoint {path}: tensor {name} holds NaN/Inf")
            p.copy_(t.to(p.dtype))
    model.eval()
    return model


def weights_digest(path: Path | str) -> str:
    """SHA-256 of a safetensors file's tensors (names, dtypes, shapes, values), not of its
    bytes: the file's header serializes its metadata in an order that may differ between
    two writes of the same weights."""
    import hashlib

    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise ConfigError(f"{path}: not a readable safetensors file ({exc})") from None
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
