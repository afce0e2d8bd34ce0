"""The federation engine's pluggable algorithm interface, independent of any transport.

A `Strategy` says what the server sends each sampled client (`configure_client`), what a
client does with it on its own data (`client_update`), and how the server folds the
clients' results into its state (`aggregate`). The same strategy object drives the
in-process simulation (tests, studies) and the MQTT server/device (where the transport
carries `ClientInstructions` down and `ClientResult` up).

Everything here works on flat float parameter vectors (1-D tensors); local training is
reached only through the `LocalProblem` gradient oracle, so the scalar Gaussian study and
the wake-word CNN use the very same code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from wakefl.protocol.records import MAX_STEPS, RecordSchema, ScalarSpec


@runtime_checkable
class LocalProblem(Protocol):
    """A client's local objective, seen through a stochastic gradient oracle."""

    @property
    def num_samples(self) -> int:
        """Number of local training samples (n_m)."""

    def gradient(self, params: Tensor, generator: torch.Generator) -> Tensor:
        """Stochastic gradient of the local loss at `params` (one minibatch drawn with
        `generator`). Same shape as `params`; must not modify `params`."""


@dataclass(frozen=True)
class ClientInstructions:
    """Server -> client for one round (the downlink's content)."""

    client_id: str
    round_id: int
    global_params: Tensor
    scalars: dict[str, float] = field(default_factory=dict)  # e.g. sigma0_sq, others_precision
    tensors: dict[str, Tensor] = field(default_factory=dict)  # method-specific extras


@dataclass(frozen=True)
class ClientResult:
    """Client -> server for one round (the uplink's content)."""

    client_id: str
    round_id: int
    params: Tensor  # the model the server aggregates
    num_samples: int
    scalars: dict[str, float] = field(default_factory=dict)  # e.g. sigma_m_sq, local_steps
    tensors: dict[str, Tensor] = field(default_factory=dict)  # e.g. Algorithm 2's converged model
    group: str = ""  # cluster key (device type) for cluster-level aggregation
    # Words for the device's progress line (e.g. why this many local steps); never sent.
    note: str = ""


@dataclass
class ClientState:
    """What a client keeps between the rounds it takes part in (persisted on the device)."""

    tensors: dict[str, Tensor] = field(default_factory=dict)  # e.g. personal params, variance mean
    scalars: dict[str, float] = field(default_factory=dict)  # e.g. variance value, counter t_m


@dataclass
class ServerState:
    """What the server keeps between rounds (persisted by the server)."""

    round_id: int
    global_params: Tensor
    tensors: dict[str, Tensor] = field(default_factory=dict)  # e.g. cluster representatives
    scalars: dict[str, float] = field(default_factory=dict)  # e.g. sigma0_sq
    clients: dict[str, dict[str, float]] = field(default_factory=dict)  # per-client scalars


class Strategy(ABC):
    """A federated (personalization) algorithm. Implementations are pure: no I/O.

    The strategy owns its records (protocol/records.py; docs/PROTOCOL.md, protocol v3): what the
    scalars of its `ClientInstructions` (`downlink_schema`) and of its `ClientResult`
    (`uplink_schema`) may hold, name -> `ScalarSpec`. The wire checks them against these
    schemas; the transport, the device state and the server store never name them. A
    strategy that sends or returns other scalars declares them.
    """

    name: str = "strategy"
    downlink_schema: ClassVar[RecordSchema] = {}
    uplink_schema: ClassVar[RecordSchema] = {
        "local_steps": ScalarSpec(0, MAX_STEPS, integer=True, required=False),
    }
    # The uplink record entry that robust aggregation floors as a variance
    # (update_screening's rule 1); None: the strategy reports none.
    screened_variance: ClassVar[str | None] = None

    @abstractmethod
    def init_server(self, initial_params: Tensor) -> ServerState:
        """Server state before round 1, from the warm-start model."""

    @abstractmethod
    def configure_client(
        self, server: ServerState, client_id: str, round_id: int
    ) -> ClientInstructions:
        """What client `client_id` receives for `round_id`."""

    @abstractmethod
    def client_update(
        self,
        instructions: ClientInstructions,
        state: ClientState,
        problem: LocalProblem,
        generator: torch.Generator,
    ) -> tuple[ClientResult, ClientState]:
        """Local work of one client in one round; returns the uplink and the new state.
        Must refuse non-finite results (raise NonFiniteError) and leave `state` unchanged."""

    @abstractmethod
    def aggregate(
        self, server: ServerState, results: Iterable[ClientResult], activity_rate: float
    ) -> ServerState:
        """New server state from this round's results. `results` may be a lazy view that
        loads one update at a time (the server's disk-backed store): iterate it at most
        twice and keep O(d) memory, whatever the number of results."""

    @abstractmethod
    def personalized_params(
        self,
        server: ServerState,
        state: ClientState,
        problem: LocalProblem,
        generator: torch.Generator,
        client_id: str | None = None,
    ) -> Tensor:
        """The client's personalized model for evaluation (may run local steps, e.g.
        Per-FedAvg or fine-tuning). `client_id` names the client, for strategies whose
        personalization depends on who it is (Self-FL's S_-m leaves its own precision out);
        None when the caller cannot identify it."""

    def global_params(self, server: ServerState) -> Tensor:
        """The updated global model for evaluation."""
        return server.global_params

    def activity_share(self, aggregated: int, registry_size: int) -> float:
        """The activity rate C that `aggregate` is given for a round in which `aggregated`
        updates of a registry of `registry_size` clients are aggregated: by default the
        realised share, C = |A| / M (at most 1)."""
        return min(1.0, aggregated / max(1, registry_size))

    def skip_round(self, server: ServerState) -> ServerState:
        """The state after a round that aggregated no update (every sampled client
        declined, stayed silent or was screened out): by default the same state, one round
        on."""
        return ServerState(
            round_id=server.round_id + 1,
            global_params=server.global_params,
            tensors=server.tensors,
            scalars=server.scalars,
            clients=server.clients,
        )

    def describe_result(self, record: dict[str, float]) -> str:
        """One client's uplink record for a progress line."""
        return ", ".join(f"{k}={v:.4g}" for k, v in sorted(record.items()))

    def describe_server(self, server: ServerState) -> str:
        """The server state's figures worth a progress line ("" for none)."""
        return ""
