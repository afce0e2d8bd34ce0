"""The passes of a sharded round: what the coordinator asks an aggregation worker to
compute over some recorded updates (`ShardTask`), the partial sums it answers
(`ShardResult`), their encoding on the server's own MQTT topics, and `ShardReader`, which
runs a task against the shared state folder (in a worker, or in the coordinator when no
worker is left). The maths is server/partial_aggregate.py's.

Tasks are JSON; results are safetensors (float64 partial sums, so the merge loses nothing
to the wire) with JSON metadata. Both travel only on topics the broker's ACL gives to the
server's processes (protocol/topics.py, docs/SCALE.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from wakefl.errors import ConfigError
from wakefl.protocol import frames
from wakefl.protocol.messages import Downlink, decode_as
from wakefl.sdk.selffl.aggregation import PrecisionSum
from wakefl.server.partial_aggregate import Spread, shard_norms, shard_spread, shard_sum
from wakefl.server.recorded_updates import read_recorded_update, server_state_from_bytes

PHASES = ("norms", "spread", "sum")
# The key of a shard result's JSON fields in its safetensors metadata.
SHARD_RESULT_KEY = "wakefl_shard"


def downlink_file(round_id: int) -> str:
    """Where the coordinator keeps a round's downlink (models/...), the base of packed
    updates for every process that reads them."""
    return f"downlink_r{round_id:06d}.wkfl"


@dataclass
class ShardTask:
    task_id: str
    round_id: int
    phase: str  # one of PHASES
    paths: list[str]  # recorded update files, relative to the state folder
    state_file: str  # models/<name>: the state the round started from (its global model)
    downlink_file: str  # models/<name>: the round's downlink (base of packed updates)
    scales: list[float] = field(default_factory=list)  # screening's clip factors ("spread", "sum")
    sigmas: list[float] = field(default_factory=list)  # Eqn 11's sigma_m^2 ("sum")
    sigma0_sq: float = 0.0  # ("sum")

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, payload: bytes) -> ShardTask:
        try:
            task = cls(**json.loads(payload))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"malformed shard task: {exc}") from exc
        if task.phase not in PHASES:
            raise ConfigError(f"unknown shard task phase {task.phase!r}")
        for name in (task.state_file, task.downlink_file, *task.paths):
            if ".." in Path(name).parts or Path(name).is_absolute():
                raise ConfigError(f"shard task names a file outside the state folder: {name!r}")
        return task


@dataclass
class ShardResult:
    task_id: str
    worker: str
    norms: list[float] = field(default_factory=list)
    spread: Spread | None = None
    psum: PrecisionSum | None = None
    error: str = ""

    def encode(self) -> bytes:
        meta: dict = {"task_id": self.task_id, "worker": self.worker, "error": self.error}
        tensors: dict[str, Tensor] = {}
        meta["norms"] = self.norms
        if self.spread is not None:
            meta["spread"] = {"count": self.spread.count, "m2": self.spread.m2}
            if self.spread.mean is not None:
                tensors["mean"] = self.spread.mean
        if self.psum is not None:
            p = self.psum
            meta["psum"] = {
                "numel": p.numel,
                "weight": p.weight,
                "certain_count": p.certain_count,
                "inverse_variance": p.inverse_variance,
            }
            tensors["weighted"] = p.weighted
            if p.certain is not None:
                tensors["certain"] = p.certain
        return st_save(tensors, metadata={SHARD_RESULT_KEY: json.dumps(meta)})

    @classmethod
    def decode(cls, payload: bytes) -> ShardResult:
        try:
            meta = frames.body_metadata(payload, SHARD_RESULT_KEY)
            tensors = st_load(payload)
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"malformed shard result: {exc}") from exc
        out = cls(meta["task_id"], meta["worker"], [float(n) for n in meta["norms"]])
        out.error = str(meta.get("error", ""))
        if "spread" in meta:
            s = meta["spread"]
            out.spread = Spread(int(s["count"]), tensors.get("mean"), float(s["m2"]))
        if "psum" in meta:
            p = meta["psum"]
            out.psum = PrecisionSum(int(p["numel"]), torch.float32)
            out.psum.weighted = tensors["weighted"]
            out.psum.weight = float(p["weight"])
            out.psum.certain = tensors.get("certain")
            out.psum.certain_count = int(p["certain_count"])
            out.psum.inverse_variance = float(p["inverse_variance"])
        return out


class ShardReader:
    """Runs shard tasks over the recorded updates of a state folder, one update in memory
    at a time; keeps the last global model and downlink base it decoded (O(d))."""

    def __init__(self, root: Path, numel: int, max_bytes: int, worker: str) -> None:
        self.root, self.numel, self.max_bytes, self.worker = Path(root), numel, max_bytes, worker
        self._global: tuple[str, Tensor] | None = None
        self._base: tuple[str, Tensor] | None = None

    def global_params(self, state_file: str) -> Tensor:
        if self._global is None or self._global[0] != state_file:
            data = (self.root / "models" / state_file).read_bytes()
            self._global = (state_file, server_state_from_bytes(data).global_params.float())
        return self._global[1]

    def base(self, name: str) -> Tensor:
        if self._base is None or self._base[0] != name:
            data = (self.root / "models" / name).read_bytes()
            down = decode_as(data, Downlink, max_bytes=self.max_bytes)
            self._base = (name, down.global_params)
        return self._base[1]

    def run(self, task: ShardTask) -> ShardResult:
        """The task's partial result; a failure comes back as `error`, not raised, so the
        coordinator learns why instead of waiting."""
        out = ShardResult(task.task_id, self.worker)
        try:
            g = self.global_params(task.state_file)
            updates = (
                read_recorded_update(
                    self.root / p, self.numel, lambda: self.base(task.downlink_file)
                ).params
                for p in task.paths
            )
            if task.phase == "norms":
                out.norms = shard_norms(updates, g)
            elif task.phase == "spread":
                out.spread = shard_spread(updates, task.scales, g)
            else:
                out.psum = shard_sum(updates, task.scales, task.sigmas, task.sigma0_sq, g)
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator
            out.error = f"{type(exc).__name__}: {str(exc)[:500]}"
        if out.psum is not None and not math.isfinite(out.psum.weight):
            out.error = "the partial sum of weights is not finite"
        return out
