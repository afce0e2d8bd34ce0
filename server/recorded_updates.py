"""Reading what the store wrote: a recorded update file (the uplink frame as received)
straight into tensors, a round's updates as a lazy view, and the server state file."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from wakefl.errors import ConfigError
from wakefl.protocol import frames, update_codec
from wakefl.protocol.messages import Uplink
from wakefl.protocol.update_codec import Packed
from wakefl.sdk.selffl.strategy import ClientResult, ServerState

# The key of the server state's JSON fields in its safetensors metadata.
SERVER_STATE_KEY = "wakefl_server_state"


def server_state_to_bytes(state: ServerState) -> bytes:
    tensors = {"global_params": state.global_params.detach().cpu().contiguous().clone()}
    for k, v in state.tensors.items():
        tensors[f"t.{k}"] = v.detach().cpu().contiguous().clone()
    meta = {"round_id": state.round_id, "scalars": state.scalars, "clients": state.clients}
    return st_save(tensors, metadata={SERVER_STATE_KEY: json.dumps(meta)})


def server_state_from_bytes(data: bytes) -> ServerState:
    meta = frames.body_metadata(data, SERVER_STATE_KEY)
    tensors = st_load(data)
    return ServerState(
        round_id=int(meta["round_id"]),
        global_params=tensors.pop("global_params"),
        tensors={k[2:]: v for k, v in tensors.items()},
        scalars={k: float(v) for k, v in meta["scalars"].items()},
        clients={c: {k: float(v) for k, v in d.items()} for c, d in meta["clients"].items()},
    )


_FILE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "I8": torch.int8}
BaseFn = Callable[[], torch.Tensor]


def _recorded_packed(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Packed | None:
    """The packed update the file holds (protocol v4 and later), None for a plain one. Its
    checksum was verified on receipt, against the round's base, so it is not again."""
    codec = meta.get("codec")
    if codec is None:
        return None
    parts = {k[len("params.") :]: tensors.pop(k) for k in list(tensors) if k.startswith("params.")}
    return Packed(codec["name"], int(codec["numel"]), int(codec["block"]), parts, codec["sha256"])


def read_recorded_update(
    path: Path,
    expected_numel: int | None = None,
    base: BaseFn | None = None,
    keep_packed: bool = False,
) -> Uplink:
    """One update file written by `StateStore.record_update`, read straight into tensors.

    The file is the uplink frame the server validated on receipt (hash, header, dtypes,
    shapes, finiteness, a packed update's checksum) and fsynced before acknowledging it, so
    it is trusted here: no re-hashing and no second safetensors parse, each tensor is read
    once from the file into its own buffer. A packed update is rebuilt from `base()`, the
    round's global model, unless `keep_packed` (then `params` is empty and `packed` holds
    it, to decode on the fly). A truncated or foreign file raises ConfigError."""
    try:
        with open(path, "rb") as f:
            head = f.read(frames.PREFIX_LEN + 8)
            if len(head) != frames.PREFIX_LEN + 8 or head[: len(frames.MAGIC)] != frames.MAGIC:
                raise ValueError("not a wakefl frame")
            hlen = frames.header_length(head[frames.PREFIX_LEN :])
            header = frames.read_header(f.read(hlen), hlen)
            meta = header.meta
            data_start = frames.PREFIX_LEN + header.data_start
            tensors: dict[str, torch.Tensor] = {}
            for name, entry in header.entries.items():
                t = torch.empty(entry["shape"], dtype=_FILE_DTYPES[entry["dtype"]])
                start, end = entry["data_offsets"]
                f.seek(data_start + start)
                if f.readinto(t.numpy().data.cast("B")) != end - start:
                    raise ValueError(f"tensor {name!r} is truncated")
                tensors[name] = t
        packed = _recorded_packed(tensors, meta)
        if packed is None:
            params = tensors.pop("params").float()
        elif keep_packed:
            params = torch.empty(0)
        elif base is None:
            raise ValueError("a packed update needs its round's global model to be read")
        else:
            params = update_codec.decode(packed, base())
        numel = packed.numel if packed is not None else params.numel()
        if expected_numel is not None and numel != expected_numel:
            raise ValueError(f"{numel} parameters, the model has {expected_numel}")
        return Uplink(
            fleet=meta["fleet"],
            run_id=meta["run_id"],
            device_id=meta["device_id"],
            device_type=meta["device_type"],
            round_id=int(meta["round_id"]),
            params=params,
            num_samples=int(meta["num_samples"]),
            record={k: float(v) for k, v in meta.get("record", {}).items()},
            relative_fa=meta.get("relative_fa"),
            relative_fr=meta.get("relative_fr"),
            tensors={k[2:]: v.float() for k, v in tensors.items()},
            version=int(meta["v"]),
            packed=packed if keep_packed else None,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(f"recorded update {path} is unreadable: {exc}") from exc


class UpdateView:
    """The accepted updates of one round as `ClientResult`s, read from disk one at a time
    on each iteration (re-iterable; memory O(d) whatever the number of updates)."""

    def __init__(
        self,
        root: Path,
        rows: list[dict[str, Any]],
        round_id: int,
        expected_numel: int | None,
        max_bytes: int,
        base: BaseFn | None = None,
    ) -> None:
        self.round_id = round_id
        self._root = root
        self._expected = expected_numel
        self._max_bytes = max_bytes
        self._base = base  # the round's global model, for packed updates (called lazily)
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[ClientResult]:
        return self.only(range(len(self.rows)))

    def round_base(self) -> torch.Tensor:
        """The round's global model as the devices decoded it: the base of its packed
        updates."""
        if self._base is None:
            raise ConfigError("a packed update needs its round's global model to be read")
        return self._base()

    def read(self, index: int, keep_packed: bool = False) -> Uplink:
        """The update of row `index` as recorded (see `read_recorded_update`)."""
        path = self._root / self.rows[index]["path"]
        return read_recorded_update(path, self._expected, self._base, keep_packed)

    def only(self, indices: Iterable[int]) -> Iterator[ClientResult]:
        """The updates of the rows at `indices`, read one at a time."""
        for row in (self.rows[i] for i in indices):
            msg = read_recorded_update(self._root / row["path"], self._expected, self._base)
            scalars = dict(msg.record)
            yield ClientResult(
                client_id=msg.device_id,
                round_id=msg.round_id,
                params=msg.params,
                num_samples=msg.num_samples,
                scalars=scalars,
                tensors=msg.tensors,
                group=msg.device_type,
            )
