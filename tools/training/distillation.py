"""Distillation in `wakefl model pretrain`: the teacher model a run learns scores from, and
the loss that compares its scores with the student's."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from wakefl.errors import ConfigError

if TYPE_CHECKING:
    from torch import Tensor

    from wakefl.models.kws_cnn import KwsCnn
    from wakefl.tools.training.settings import PretrainSettings


def distill_loss(student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
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


def load_teacher(
    s: PretrainSettings, model: KwsCnn, info: dict[str, Any], out: Path
) -> KwsCnn | None:
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
