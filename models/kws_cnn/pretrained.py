"""The shipped pretrained wake-word models ("hey nova"): `full` (width 1.0) and `small`
(width 0.25), each as fp16 safetensors with its JSON config and an operating-point card
(`<name>.card.json`: the shipped threshold and the detector settings it was chosen for).
MODEL_CARD.md in the same folder describes their data, training and measured figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wakefl.errors import ConfigError

from .checkpoint import load_model
from .model import KwsCnn

PRETRAINED_DIR = Path(__file__).resolve().parent / "pretrained"
NAMES = ("full", "small")


def pretrained_path(name: str) -> Path:
    """The safetensors file of shipped model `name`; ConfigError if unknown or missing."""
    if name not in NAMES:
        raise ConfigError(f"unknown pretrained model {name!r}; choose one of {', '.join(NAMES)}")
    path = PRETRAINED_DIR / f"{name}.safetensors"
    if not path.exists():
        raise ConfigError(f"the pretrained model {name!r} is not in this installation ({path})")
    return path


def is_available(name: str) -> bool:
    return name in NAMES and (PRETRAINED_DIR / f"{name}.safetensors").exists()


def load_pretrained(name: str) -> KwsCnn:
    """The shipped model as float32, in eval mode."""
    return load_model(pretrained_path(name)).float().eval()


def pretrained_card(name: str) -> dict[str, Any]:
    """The operating-point card: `threshold`, `hop_s`, `smoothing`, `refractory_s`, the
    phrase and the validation figures it was chosen on."""
    card = card_beside(pretrained_path(name))
    if card is None:
        raise ConfigError(f"the pretrained model {name!r} has no card")
    return card


def card_beside(weights: Path | str) -> dict[str, Any] | None:
    """The operating-point card beside a weights file (`<weights>.card.json`, as
    `wakefl model pretrain` and `publish` write it); None when there is none, ConfigError
    when it cannot be read or has no numeric `threshold`."""
    path = Path(weights).with_suffix(".card.json")
    if not path.exists():
        return None
    try:
        card = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the card {path}: {exc}") from None
    if not isinstance(card, dict) or not isinstance(card.get("threshold"), int | float):
        raise ConfigError(f"{path}: no numeric 'threshold'")
    return card
