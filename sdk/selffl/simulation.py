"""In-process federation: the same `Strategy` the MQTT server and devices run, driven in a
loop with client sampling (activity rate C). Deterministic under the seed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from wakefl.errors import ConfigError
from wakefl.sdk.selffl.rules import sampled_count
from wakefl.sdk.selffl.strategy import (
    ClientResult,
    ClientState,
    LocalProblem,
    ServerState,
    Strategy,
)


@dataclass
class RoundRecord:
    """What happened in one round."""

    round_id: int
    sampled: list[str]
    local_steps: dict[str, float] = field(default_factory=dict)
    sigma_sq: dict[str, float] = field(default_factory=dict)
    sigma0_sq: float = 0.0


@dataclass
class SimulationResult:
    server: ServerState
    clients: dict[str, ClientState]
    records: list[RoundRecord]
    participation: dict[str, int]  # rounds each client took part in


def client_generator(seed: int, round_id: int, index: int) -> torch.Generator:
    """Per (round, client) random stream, independent of the order clients run in."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + round_id * 10_007 + index) % (2**63 - 1))
    return g


def run_simulation(
    strategy: Strategy,
    problems: Mapping[str, LocalProblem],
    initial_params: Tensor,
    rounds: int,
    activity_rate: float,
    seed: int,
    groups: Mapping[str, str] | None = None,
    on_round: Callable[[int, ServerState, RoundRecord], None] | None = None,
) -> SimulationResult:
    """Run `rounds` rounds; each samples `sampled_count(C, M)` = floor(C * M) (at least 1)
    clients uniformly without replacement.

    A client's state changes only in the rounds it is sampled, so its counter t_m counts
    only those. `groups` (client -> cluster key) fills `ClientResult.group`. The activity
    rate passed to `Strategy.aggregate` is the realised share |A| / M. Errors from a client
    (e.g. `NonFiniteError`) propagate; states already returned are left intact.
    """
    if rounds < 0:
        raise ConfigError(f"rounds must be >= 0, got {rounds}")
    ids = sorted(problems)
    if not ids:
        raise ConfigError("a simulation needs at least one client")
    index = {cid: i for i, cid in enumerate(ids)}
    k = sampled_count(activity_rate, len(ids))
    sampler = torch.Generator()
    sampler.manual_seed(int(seed))
    server = strategy.init_server(initial_params)
    states: dict[str, ClientState] = {cid: ClientState() for cid in ids}
    participation = dict.fromkeys(ids, 0)
    records: list[RoundRecord] = []
    for r in range(1, rounds + 1):
        chosen = sorted(ids[i] for i in torch.randperm(len(ids), generator=sampler)[:k].tolist())
        results: list[ClientResult] = []
        record = RoundRecord(round_id=r, sampled=chosen)
        for cid in chosen:
            ins = strategy.configure_client(server, cid, r)
            res, new_state = strategy.client_update(
                ins, states[cid], problems[cid], client_generator(seed, r, index[cid])
            )
            if groups is not None:
                res = dataclasses.replace(res, group=str(groups[cid]))
            results.append(res)
            states[cid] = new_state
            participation[cid] += 1
            if "local_steps" in res.scalars:
                record.local_steps[cid] = res.scalars["local_steps"]
            if "sigma_sq" in res.scalars:
                record.sigma_sq[cid] = res.scalars["sigma_sq"]
        server = strategy.aggregate(server, results, len(chosen) / len(ids))
        record.sigma0_sq = float(server.scalars.get("sigma0_sq", 0.0))
        records.append(record)
        if on_round is not None:
            on_round(r, server, record)
    return SimulationResult(
        server=server, clients=states, records=records, participation=participation
    )
