"""Per-FedAvg, first-order version (Fallah et al. 2020): the global model is trained
MAML-style so that a few local gradient steps adapt it well; personalization = those steps
at evaluation time."""

from __future__ import annotations

import torch
from torch import Tensor

from ..checks import require_count, require_finite, require_positive
from ..local_sgd import oracle_gradient, sgd_steps
from ..strategy import ClientState, LocalProblem, ServerState
from .fedavg import FedAvg


class PerFedAvg(FedAvg):
    """Per-FedAvg (FO).

    Each local step: u = w - alpha g(w; D), then w <- w - beta g(u; D'), with D and D'
    two independent minibatches.

    Hyperparameters:
        alpha: inner (adaptation) learning rate, also used at evaluation (default 0.01).
        beta: outer (meta) learning rate (default 0.05).
        local_steps: meta steps per round (default 20).
        adapt_steps: SGD steps with `alpha` from the global model that give the
            personalized model at evaluation (default 1).
        weighting: server weights, "equal" (default, as in the Per-FedAvg paper) or
            "samples".
    """

    method = "perfedavg"

    def __init__(
        self,
        alpha: float = 0.01,
        beta: float = 0.05,
        local_steps: int = 20,
        adapt_steps: int = 1,
        weighting: str = "equal",
    ):
        super().__init__(weighting=weighting, lr=beta, local_steps=local_steps)
        self.alpha = require_positive(alpha, "alpha")
        self.beta = self.lr
        self.adapt_steps = require_count(adapt_steps, "adapt_steps")
        self.name = "perfedavg"

    def local_train(
        self, start: Tensor, problem: LocalProblem, generator: torch.Generator
    ) -> Tensor:
        w = start.detach().clone()
        for _ in range(self.local_steps):
            adapted = w - self.alpha * oracle_gradient(problem, w, generator)
            w = w - self.beta * oracle_gradient(problem, adapted, generator)
        return require_finite(w, "locally trained parameters")

    def personalized_params(
        self,
        server: ServerState,
        state: ClientState,
        problem: LocalProblem,
        generator: torch.Generator,
        client_id: str | None = None,
    ) -> Tensor:
        return sgd_steps(server.global_params, problem, generator, self.alpha, self.adapt_steps)
