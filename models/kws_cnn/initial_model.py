"""The starting model of a federation: a shipped model by name, a wakefl checkpoint, a flat
parameter vector, or a fresh model of a given width."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from wakefl.errors import ConfigError

if TYPE_CHECKING:
    from torch import Tensor


def load_initial_model(path: str | None, width: float, seed: int) -> tuple[Tensor, dict[str, Any]]:
    """(flat params, model config dict) from a shipped model (`pretrained:full`,
    `pretrained:small`, as `wakefl demo` and `eval` take them), a wakefl checkpoint (with its
    .json config), a flat safetensors file holding one 1-D tensor `params`, or a fresh
    model."""
    import torch

    from .checkpoint import load_model
    from .config import ModelConfig
    from .flat_params import get_flat_params
    from .model import KwsCnn

    if path is None:
        torch.manual_seed(seed)
        cfg = ModelConfig(width=width)
        return get_flat_params(KwsCnn(cfg)).detach().clone(), cfg.to_dict()
    if path.startswith("pretrained:"):
        from .pretrained import NAMES, load_pretrained

        name = path.split(":", 1)[1]
        if name not in NAMES:
            choices = ", ".join(f"pretrained:{n}" for n in NAMES)
            raise ConfigError(f"initial model {path!r}: no such shipped model; choose {choices}")
        model = load_pretrained(name)
        return get_flat_params(model).detach().clone(), model.cfg.to_dict()
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"initial model {p} does not exist")
    if p.with_suffix(p.suffix + ".json").is_file() or p.with_suffix(".json").is_file():
        model = load_model(p)
        return get_flat_params(model).detach().clone(), model.cfg.to_dict()
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(p))
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"initial model {p} is not a safetensors file: {exc}") from exc
    if set(tensors) != {"params"} or tensors["params"].dim() != 1:
        raise ConfigError(
            f"{p}: expected a checkpoint with a .json config or one flat 'params' tensor"
        )
    return tensors["params"].float(), {}
