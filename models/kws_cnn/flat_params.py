"""The model as one flat vector of its trainable parameters, in `parameters()` order (the
classification head last): what federated strategies average and send over the wire."""

from __future__ import annotations

import torch
from torch import nn

from wakefl.errors import ConfigError, NonFiniteError
from wakefl.finite import all_finite


def _trainable(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def num_flat_params(model: nn.Module) -> int:
    return sum(p.numel() for p in _trainable(model))


def get_flat_params(model: nn.Module) -> torch.Tensor:
    """Detached float32 copy of all trainable parameters, [d]."""
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in _trainable(model)]).clone()


def set_flat_params(model: nn.Module, vec: torch.Tensor) -> None:
    """Writes `vec` into the model's trainable parameters (in place)."""
    if not isinstance(vec, torch.Tensor):
        vec = torch.as_tensor(vec)
    if vec.dim() != 1:
        raise ConfigError(f"flat parameter vector must be 1-D, got shape {tuple(vec.shape)}")
    d = num_flat_params(model)
    if vec.numel() != d:
        raise ConfigError(f"flat parameter vector has {vec.numel()} entries, the model has {d}")
    if not all_finite(vec):
        bad = int((~torch.isfinite(vec)).sum())
        raise NonFiniteError(f"flat parameter vector holds {bad} NaN/Inf value(s)")
    offset = 0
    with torch.no_grad():
        for p in _trainable(model):
            n = p.numel()
            p.copy_(vec[offset : offset + n].view_as(p).to(p.dtype))
            offset += n


def head_slice(model: nn.Module) -> slice:
    """Range of the classification head within the flat vector (it comes last)."""
    head = getattr(model, "head", None)
    if head is None:
        raise ConfigError("model has no classification head named 'head'")
    n_head = sum(p.numel() for p in head.parameters() if p.requires_grad)
    d = num_flat_params(model)
    return slice(d - n_head, d)
