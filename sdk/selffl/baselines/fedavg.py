"""FedAvg (McMahan et al. 2017): fixed local SGD from the global model, server average
weighted by sample size (FedAvg-w) or equally (FedAvg-e). Also the base class of the
baselines that train their global model the FedAvg way."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from ..checks import (
    require_activity_rate,
    require_count,
    require_finite,
    require_like,
    require_positive,
)
from ..local_sgd import sgd_steps
from ..strategy import (
    ClientInstructions,
    ClientResult,
    ClientState,
    LocalProblem,
    ServerState,
    Strategy,
)
from .averaging import WeightedMean, check_weighting, fedavg_weight


def copy_state(state: ClientState) -> ClientState:
    """A shallow copy, so a strategy never mutates the state it was given."""
    return ClientState(tensors=dict(state.tensors), scalars=dict(state.scalars))


class FedAvg(Strategy):
    """Federated averaging.

    Hyperparameters:
        weighting: "samples" -> weight n_k (FedAvg-w), "equal" -> weight 1 (FedAvg-e).
        lr: local SGD learning rate (default 0.05).
        local_steps: fixed number of local SGD steps per round (default 20, the fixed count
            the Self-FL paper gives its baselines).

    The minibatch size is a property of the `LocalProblem` (each gradient call draws one
    minibatch), e.g. `TorchLocalProblem(batch_size=32)`. The activity rate is not used: the
    new global model is the average over the clients that took part (a round without
    results keeps the global model). The personalized model is the global model.
    """

    method = "fedavg"

    def __init__(self, weighting: str = "samples", lr: float = 0.05, local_steps: int = 20):
        self.weighting = check_weighting(weighting)
        self.lr = require_positive(lr, "lr")
        self.local_steps = require_count(local_steps, "local_steps", minimum=1)
        self.name = f"{self.method}-{'w' if self.weighting == 'samples' else 'e'}"

    # --- server side -------------------------------------------------------------------
    def init_server(self, initial_params: Tensor) -> ServerState:
        params = require_finite(initial_params.detach().clone(), "initial parameters")
        return ServerState(round_id=0, global_params=params)

    def configure_client(
        self, server: ServerState, client_id: str, round_id: int
    ) -> ClientInstructions:
        return ClientInstructions(
            client_id=client_id, round_id=round_id, global_params=server.global_params
        )

    def aggregate(
        self, server: ServerState, results: Iterable[ClientResult], activity_rate: float
    ) -> ServerState:
        require_activity_rate(activity_rate)
        mean = WeightedMean(server.global_params)
        for result in results:
            mean.add(result.params, fedavg_weight(result, self.weighting), _origin(result))
        new_global = self.server_step(server.global_params, mean)
        return ServerState(
            round_id=server.round_id + 1,
            global_params=new_global,
            tensors=dict(server.tensors),
            scalars=dict(server.scalars),
            clients=dict(server.clients),
        )

    def server_step(self, previous: Tensor, mean: WeightedMean) -> Tensor:
        """New global model from the clients' average (FedAvg: the average itself)."""
        return previous if mean.count == 0 else mean.value()

    # --- client side -------------------------------------------------------------------
    def received_global(self, instructions: ClientInstructions) -> Tensor:
        return require_finite(instructions.global_params, "global parameters from the server")

    def local_train(
        self, start: Tensor, problem: LocalProblem, generator: torch.Generator
    ) -> Tensor:
        """The local update sent to the server (FedAvg: plain SGD from the global model)."""
        return sgd_steps(start, problem, generator, self.lr, self.local_steps)

    def client_update(
        self,
        instructions: ClientInstructions,
        state: ClientState,
        problem: LocalProblem,
        generator: torch.Generator,
    ) -> tuple[ClientResult, ClientState]:
        global_params = self.received_global(instructions)
        params = self.local_train(global_params, problem, generator)
        result = ClientResult(
            client_id=instructions.client_id,
            round_id=instructions.round_id,
            params=params,
            num_samples=int(problem.num_samples),
            scalars={"local_steps": float(self.local_steps)},
        )
        return result, copy_state(state)

    def personalized_params(
        self,
        server: ServerState,
        state: ClientState,
        problem: LocalProblem,
        generator: torch.Generator,
        client_id: str | None = None,
    ) -> Tensor:
        return server.global_params


def stored_personal(state: ClientState, like: Tensor, key: str = "personal") -> Tensor | None:
    """The personal vector a client keeps in its state, checked, or None before its first
    round."""
    vec = state.tensors.get(key)
    if vec is None:
        return None
    require_like(vec, like, f"stored {key} parameters")
    return require_finite(vec, f"stored {key} parameters")


class PersonalFedAvg(FedAvg):
    """FedAvg's server for a strategy whose clients also keep a personal model in their
    state (`personal`): that model is what a client serves, the global one before its
    first round (DITTO, local-only training)."""

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


def _origin(result: ClientResult) -> str:
    return f"update from client {result.client_id!r}"
