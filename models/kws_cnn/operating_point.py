"""Which operating point a model ships with: a shipped model's card, the card or config
beside a checkpoint, or for a model trained on a device its baseline's. The stored format
(`OperatingPoint`, its card, config, sidecar and ONNX metadata entries) is
wakefl/operating_point.py's, which the edge runtime reads without torch; this module is the
part that needs the weights.

A model trained on a device has no threshold of its own: it is exported with its
baseline's shipped threshold, and `threshold_source` says so."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from wakefl.errors import ConfigError
from wakefl.operating_point import METADATA_KEYS, OperatingPoint, from_card, shipped_threshold_in

from .flat_params import get_flat_params
from .model import KwsCnn


def shipped_operating_point(name: str) -> OperatingPoint:
    """The operating point of shipped model `name`, from its card."""
    from .pretrained import pretrained_card

    return from_card(pretrained_card(name), f"the card of the shipped model {name!r}")


def beside_weights(weights: Path | str) -> OperatingPoint | None:
    """The operating point stored beside a checkpoint: its card (`<w>.card.json`), else the
    `shipped_threshold` in its config (`<w>.json`, as the cached warm starts have it);
    None when neither holds one."""
    from .pretrained import card_beside

    path = Path(weights)
    card = card_beside(path)
    if card is not None:
        return from_card(card, f"the card of {path.name}")
    config = path.with_suffix(".json")
    if not config.is_file():
        return None
    try:
        meta = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {config}: {exc}") from None
    if not isinstance(meta, dict) or shipped_threshold_in(meta, str(config)) is None:
        return None
    return from_card(meta, f"the config of {path.name}")


@lru_cache(maxsize=4)
def _shipped_params(name: str) -> torch.Tensor:
    from .pretrained import load_pretrained

    return get_flat_params(load_pretrained(name))


def shipped_name(model: KwsCnn) -> str | None:
    """The name of the shipped model whose weights `model` holds exactly (as loaded, or
    as sent over the wire in fp32 or fp16), else None. Only a shipped model of the same
    config is loaded to compare."""
    from .checkpoint import read_config
    from .pretrained import NAMES, is_available, pretrained_path

    cfg = model.cfg.to_dict()
    for name in NAMES:
        if not is_available(name) or read_config(pretrained_path(name)).to_dict() != cfg:
            continue
        if torch.equal(_shipped_params(name), get_flat_params(model)):
            return name
    return None


def for_model(
    model: KwsCnn, baseline: KwsCnn | None = None, what: str = ""
) -> OperatingPoint | None:
    """The operating point to export `model` with: a shipped model's own; else, when
    `baseline` is a shipped model, the baseline's threshold with a note that `model`
    (`what`, e.g. "the personalized model of round 3") was not tuned for it; else None."""
    name = shipped_name(model)
    if name is not None:
        return shipped_operating_point(name)
    base = shipped_name(baseline) if baseline is not None else None
    if base is None:
        return None
    return shipped_operating_point(base).with_source(
        f"the baseline's shipped threshold (shipped model {base!r}); "
        f"{what or 'this model'} was not tuned for it"
    )


def for_export(
    model: KwsCnn, pretrained: str | None, weights: Path | None
) -> OperatingPoint | None:
    """The threshold an exported file carries: the shipped model `pretrained`'s card, the
    card or config beside `weights`, or, for weights equal to a shipped model's, that
    model's; None for a model from neither (random weights)."""
    if pretrained is not None:
        return shipped_operating_point(pretrained)
    if weights is not None:
        point = beside_weights(weights)
        if point is not None:
            return point
        return for_model(model)
    return None


__all__ = [
    "METADATA_KEYS",
    "OperatingPoint",
    "beside_weights",
    "for_export",
    "for_model",
    "from_card",
    "shipped_name",
    "shipped_operating_point",
]
