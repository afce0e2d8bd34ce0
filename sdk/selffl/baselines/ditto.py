"""DITTO (Li et al. 2021): the global model is trained as in FedAvg; each client also keeps
a personal model v_k trained on F_k(v) + (lambda/2) ||v - w||^2."""

from __future__ import annotations

import torch

from ..checks import require_count, require_non_negative, require_positive
from ..local_sgd import sgd_steps
from ..strategy import ClientInstructions, ClientResult, ClientState, LocalProblem
from .fedavg import PersonalFedAvg, copy_state, stored_personal


class Ditto(PersonalFedAvg):
    """DITTO with FedAvg as the global solver.

    Hyperparameters:
        weighting: FedAvg weights of the global model, "samples" (DITTO-w, default) or
            "equal" (DITTO-e).
        lr: local SGD learning rate of the global update (default 0.05).
        local_steps: local SGD steps of the global update per round (default 20).
        lam: lambda, the pull of the personal model towards the global one (default 0.1).
            lam = 0 is local training, lam -> infinity is FedAvg.
        personal_lr: learning rate of the personal model's steps (default: `lr`).
        personal_steps: personal-model steps per round (default: `local_steps`).

    The personal model starts from the global model at a client's first round; the prox
    centre is the global model the client received in that round.
    """

    method = "ditto"

    def __init__(
        self,
        weighting: str = "samples",
        lr: float = 0.05,
        local_steps: int = 20,
        lam: float = 0.1,
        personal_lr: float | None = None,
        personal_steps: int | None = None,
    ):
        super().__init__(weighting=weighting, lr=lr, local_steps=local_steps)
        self.lam = require_non_negative(lam, "lam")
        self.personal_lr = require_positive(
            lr if personal_lr is None else personal_lr, "personal_lr"
        )
        self.personal_steps = require_count(
            local_steps if personal_steps is None else personal_steps, "personal_steps"
        )

    def client_update(
        self,
        instructions: ClientInstructions,
        state: ClientState,
        problem: LocalProblem,
        generator: torch.Generator,
    ) -> tuple[ClientResult, ClientState]:
        result, new_state = super().client_update(instructions, state, problem, generator)
        global_params = instructions.global_params
        personal = stored_personal(state, global_params)
        start = global_params if personal is None else personal
        personal = sgd_steps(
            start,
            problem,
            generator,
            self.personal_lr,
            self.personal_steps,
            prox_center=global_params,
            lam=self.lam,
        )
        new_state = copy_state(new_state)
        new_state.tensors["personal"] = personal
        return result, new_state
