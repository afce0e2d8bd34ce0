"""The round's downlink (docs/PROTOCOL.md, "Downlink"): the strategy's per-device
instructions and shared tensors, the run's settings, encoded once per round."""

from __future__ import annotations

import torch
from torch import Tensor

from wakefl.errors import ConfigError
from wakefl.protocol.messages import Downlink, encode
from wakefl.sdk.selffl.strategy import ServerState, Strategy
from wakefl.server.server_session import ServerSession


def build_downlink(
    session: ServerSession,
    strategy: Strategy,
    state: ServerState,
    round_id: int,
    sampled: list[str],
    deadline: float,
    final: bool = False,
) -> bytes:
    instructions: dict[str, dict[str, float]] = {}
    shared: dict[str, Tensor] = {}
    params = state.global_params
    for dev in sampled:
        ins = strategy.configure_client(state, dev, round_id)
        instructions[dev] = {k: float(v) for k, v in ins.scalars.items()}
        params = ins.global_params
        for k, v in ins.tensors.items():
            if k in shared and not torch.equal(shared[k], v):
                raise ConfigError(
                    f"strategy {strategy.name} sends per-device tensor "
                    f"{k!r}; protocol v1 carries shared tensors only"
                )
            shared[k] = v
    msg = Downlink(
        fleet=session.cfg.fleet,
        run_id=session.run_id,
        round_id=round_id,
        global_params=params,
        model_config=session.cfg.model_config,
        instructions=instructions,
        settings=session.cfg.round_settings(),
        deadline=deadline,
        final=final,
        strategy=strategy.name,
        tensors=shared,
    )
    return encode(msg, wire_dtype=session.cfg.wire_dtype, max_bytes=session.cfg.max_bytes)
