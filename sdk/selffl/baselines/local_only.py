"""Local training only: every client trains its own model, nothing is federated."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..checks import require_activity_rate
from ..local_sgd import sgd_steps
from ..strategy import ClientInstructions, ClientResult, ClientState, LocalProblem, ServerState
from .averaging import WeightedMean
from .fedavg import PersonalFedAvg, _origin, copy_state, stored_personal


class LocalOnly(PersonalFedAvg):
    """Local-only training (the no-federation reference).

    Hyperparameters:
        lr: local SGD learning rate (default 0.05).
        local_steps: local SGD steps per round the client takes part in (default 20).

    A client starts from the warm-start (global) model at its first round and keeps
    training its own model afterwards; that model is its personalized model. The server
    checks the uploads (refusing non-finite ones) but never changes the global model, which
    stays the warm-start model.
    """

    method = "local"

    def __init__(self, lr: float = 0.05, local_steps: int = 20):
        super().__init__(weighting="equal", lr=lr, local_steps=local_steps)
        self.name = "local"

    def aggregate(
        self, server: ServerState, results: Iterable[ClientResult], activity_rate: float
    ) -> ServerState:
        require_activity_rate(activity_rate)
        check = WeightedMean(server.global_params)
        for result in results:
            check.add(result.params, 1.0, _origin(result))
        return ServerState(
            round_id=server.round_id + 1,
            global_params=server.global_params,
            tensors=dict(server.tensors),
            scalars=dict(server.scalars),
            clients=dict(server.clients),
        )

    def client_update(
        self,
        instructions: ClientInstructions,
        state: ClientState,
        problem: LocalProblem,
        generator: torch.Generator,
    ) -> tuple[ClientResult, ClientState]:
        global_params = self.received_global(instructions)
        personal = stored_personal(state, global_params)
        start = global_params if personal is None else personal
        params = sgd_steps(start, problem, generator, self.lr, self.local_steps)
        new_state = copy_state(state)
        new_state.tensors["personal"] = params
        result = ClientResult(
            client_id=instructions.client_id,
            round_id=instructions.round_id,
            params=params,
            num_samples=int(problem.num_samples),
            scalars={"local_steps": float(self.local_steps)},
        )
        return result, new_state
