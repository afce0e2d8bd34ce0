"""pFedMe (Dinh, Tran and Nguyen 2020): personalized models as Moreau envelopes.

Each local round the client draws one minibatch and approximately solves
v = argmin_v F_k(v; batch) + (lambda/2) ||v - theta||^2 with `inner_steps` gradient steps
(all on that batch), then moves its local copy theta toward v:
theta <- theta - lr * lambda * (theta - v). The server mixes: w <- (1 - beta) w + beta *
mean_k theta_k."""

from __future__ import annotations

import torch
from torch import Tensor

from ..checks import require_count, require_finite, require_positive
from ..local_sgd import fixed_batch_generator, oracle_gradient
from ..strategy import ClientInstructions, ClientResult, ClientState, LocalProblem, ServerState
from .averaging import WeightedMean
from .fedavg import FedAvg, copy_state, stored_personal


def prox_solve(
    center: Tensor,
    problem: LocalProblem,
    generator: torch.Generator,
    lam: float,
    lr: float,
    steps: int,
    start: Tensor | None = None,
) -> Tensor:
    """Approximate argmin_v F(v; one minibatch) + lam/2 ||v - center||^2 by `steps` gradient
    steps; the minibatch is drawn once (from `generator`) and replayed at every step."""
    sub, seed = fixed_batch_generator(generator)
    v = (center if start is None else start).detach().clone()
    for _ in range(steps):
        sub.manual_seed(seed)
        v = v - lr * (oracle_gradient(problem, v, sub) + lam * (v - center))
    return v


class PFedMe(FedAvg):
    """pFedMe.

    Hyperparameters:
        lam: lambda, strength of the tie between personal and local-global models
            (default 15, the pFedMe paper's common choice).
        personal_lr: learning rate of the inner solver (default 0.01).
        inner_steps: K, inner gradient steps per local round (default 5).
        lr: eta, learning rate of the local-global update (default 0.005).
        local_steps: R, local rounds per federated round (default 20).
        beta: server mixing, w <- (1 - beta) w + beta * average (default 1.0 = plain
            average; the paper also uses 2.0).
        weighting: "equal" (default, as in the paper) or "samples" for the average.

    The personalized model is the last inner solution v of the client's latest round
    (the global model before its first round).
    """

    method = "pfedme"

    def __init__(
        self,
        lam: float = 15.0,
        personal_lr: float = 0.01,
        inner_steps: int = 5,
        lr: float = 0.005,
        local_steps: int = 20,
        beta: float = 1.0,
        weighting: str = "equal",
    ):
        super().__init__(weighting=weighting, lr=lr, local_steps=local_steps)
        self.lam = require_positive(lam, "lam")
        self.personal_lr = require_positive(personal_lr, "personal_lr")
        self.inner_steps = require_count(inner_steps, "inner_steps", minimum=1)
        self.beta = require_positive(beta, "beta")
        self.name = "pfedme"

    def client_update(
        self,
        instructions: ClientInstructions,
        state: ClientState,
        problem: LocalProblem,
        generator: torch.Generator,
    ) -> tuple[ClientResult, ClientState]:
        theta = self.received_global(instructions).detach().clone()
        v = theta
        for _ in range(self.local_steps):
            v = prox_solve(
                theta, problem, generator, self.lam, self.personal_lr, self.inner_steps, start=v
            )
            theta = theta - self.lr * self.lam * (theta - v)
        require_finite(theta, "locally trained parameters")
        require_finite(v, "personal parameters")
        result = ClientResult(
            client_id=instructions.client_id,
            round_id=instructions.round_id,
            params=theta,
            num_samples=int(problem.num_samples),
            scalars={"local_steps": float(self.local_steps)},
        )
        new_state = copy_state(state)
        new_state.tensors["personal"] = v
        return result, new_state

    def server_step(self, previous: Tensor, mean: WeightedMean) -> Tensor:
        if mean.count == 0:
            return previous
        mixed = (1.0 - self.beta) * previous + self.beta * mean.value()
        return require_finite(mixed, "aggregated parameters")

    def personalized_params(
        self,
        server: ServerState,
        state: ClientState,
        problem: LocalProblem,
        generator: torch.Generator,
        client_id: str | None = None,
    ) -> Tensor:
        personal = stored_personal(state, server.global_params)
        return server.global_params if personal is None else personal
