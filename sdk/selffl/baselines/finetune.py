"""Global-then-fine-tune: FedAvg's global model, then extra local SGD steps on each client
for its personalized model."""

from __future__ import annotations

import torch
from torch import Tensor

from ..checks import require_count, require_positive
from ..local_sgd import sgd_steps
from ..strategy import ClientState, LocalProblem, ServerState
from .fedavg import FedAvg


class FineTune(FedAvg):
    """FedAvg, personalized by fine-tuning the final global model locally.

    Hyperparameters:
        weighting: FedAvg weights, "samples" (default) or "equal".
        lr: local SGD learning rate during federated rounds (default 0.05).
        local_steps: local SGD steps per round (default 20).
        finetune_steps: extra local SGD steps from the global model that give the
            personalized model (default 20).
        finetune_lr: learning rate of those steps (default: `lr`).
    """

    method = "finetune"

    def __init__(
        self,
        weighting: str = "samples",
        lr: float = 0.05,
        local_steps: int = 20,
        finetune_steps: int = 20,
        finetune_lr: float | None = None,
    ):
        super().__init__(weighting=weighting, lr=lr, local_steps=local_steps)
        self.finetune_steps = require_count(finetune_steps, "finetune_steps")
        self.finetune_lr = require_positive(
            lr if finetune_lr is None else finetune_lr, "finetune_lr"
        )
        self.name = "finetune"

    def personalized_params(
        self,
        server: ServerState,
        state: ClientState,
        problem: LocalProblem,
        generator: torch.Generator,
        client_id: str | None = None,
    ) -> Tensor:
        return sgd_steps(
            server.global_params, problem, generator, self.finetune_lr, self.finetune_steps
        )
