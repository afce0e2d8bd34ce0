"""Pretraining's checkpoints: the run state (weights and optimizer moments, safetensors,
plus state.json) written atomically and read back on `--resume`, and the best model so far
with its card."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wakefl.edge_runtime.detection_rule import (
    DEFAULT_HOP_S,
    DEFAULT_REFRACTORY_S,
    DEFAULT_SMOOTHING,
)
from wakefl.errors import ConfigError
from wakefl.tools.training.settings import BEST, BEST_CARD, LAST, STATE_INFO, STATE_WEIGHTS

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from wakefl.models.kws_cnn import KwsCnn


def save_state(out: Path, model: KwsCnn, opt: torch.optim.Optimizer, info: dict[str, Any]) -> None:
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


def copy_weights(model: KwsCnn, tensors: dict[str, Tensor], error: str) -> None:
    """Copy a checkpoint's `model.<name>` tensors into `model`; ConfigError(`error`) naming
    the first parameter that is missing or of another shape."""
    import torch

    with torch.no_grad():
        for k, p in model.named_parameters():
            t = tensors.get(f"model.{k}")
            if t is None or t.shape != p.shape:
                raise ConfigError(f"{error} ({k})")
            p.copy_(t)


def load_state(out: Path, model: KwsCnn, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from safetensors.torch import load_file

    try:
        info = json.loads((out / STATE_INFO).read_text())
        tensors = load_file(str(out / STATE_WEIGHTS))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot resume from {out}: {exc}") from None
    copy_weights(model, tensors, f"cannot resume from {out}: its weights do not fit this model")
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


def save_last(out: Path, model: KwsCnn) -> None:
    """The weights of the latest checkpoint as a model file (LAST, with its config beside
    it): what a fixed-budget comparison scores, and what a benchmark loads directly."""
    from wakefl.models.kws_cnn import save_model

    tmp = out / ".last-tmp.safetensors"
    save_model(model, tmp)
    tmp.with_suffix(".json").replace(out / "last.json")
    tmp.replace(out / LAST)


def save_best(out: Path, model: KwsCnn, metrics: dict[str, float], info: dict[str, Any]) -> None:
    from wakefl.models.kws_cnn import save_model
    from wakefl.sdk.atomic_files import write_atomic

    tmp = out / ".best-tmp.safetensors"
    save_model(model, tmp)
    tmp.with_suffix(".json").replace(out / "best.json")
    tmp.replace(out / BEST)
    card = {
        "threshold": metrics["threshold"],
        "hop_s": DEFAULT_HOP_S,
        "smoothing": DEFAULT_SMOOTHING,
        "refractory_s": DEFAULT_REFRACTORY_S,
        "validation": metrics,
        **info,
    }
    write_atomic(out / BEST_CARD, (json.dumps(card, indent=1) + "\n").encode())
