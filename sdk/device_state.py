"""The device's persistent state, written so that a power cut at any instant leaves either
the previous state or the new one on disk, never a mixture.

Layout of the state folder:

* `tensors-<generation>.safetensors` — personal parameters, baseline parameters, the
  parameters of the model the device serves (stored once when they are the personal or the
  baseline ones), the strategy's `ClientState` tensors (e.g. the running-variance mean)
  and the tensors of an update not yet acknowledged by the server.
* `state.json` — scalars and metadata, and the name and SHA-256 of the tensors file it
  belongs to. Replacing this file is the commit point.

A save writes the new tensors file (temp name, fsync, rename), then the new `state.json`
(temp name, fsync, `os.replace`, fsync of the folder), and only then deletes tensor files of
older generations. Until `state.json` is replaced, the old one still names the old tensors
file, which is still there; after it, the new pair is complete on disk.

Format 2 adds the served model (`served_name`, `served_round` and its tensor). A format-1
folder, written before the served-model gate, is read as serving the baseline: its
personal model was never checked against it, so the device serves the shipped model until
the gate admits another. Any other format is refused with a message naming both.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from wakefl.errors import ConfigError, NonFiniteError, WakeflError
from wakefl.finite import all_finite
from wakefl.sdk.atomic_files import TMP_GLOB, temp_path, write_atomic
from wakefl.sdk.selffl.strategy import ClientState

STATE_FILE = "state.json"
FORMAT_VERSION = 2
_READABLE_FORMATS = (1, 2)
SERVED_NAMES = ("", "baseline", "personalized", "global")  # "": nothing served yet
_TENSOR_FILE_RE = re.compile(r"^tensors-(\d+)\.safetensors$")
# Prefixes of the keys in the tensors file, so one file holds several tensor dicts.
_CLIENT = "client/"
_PENDING = "pending/"
_PERSONAL = "personal"
_BASELINE = "baseline"
_SERVED = "served"


class FolderInUse(ConfigError):
    """Another process holds the state folder's lock."""


@dataclass
class PendingUpdate:
    """An update that was computed and saved but not yet acknowledged by the server. After a
    restart the device re-sends exactly this update instead of training the round again
    (training twice would count the round twice in the running variance)."""

    round_id: int
    num_samples: int
    scalars: dict[str, float] = field(default_factory=dict)
    tensors: dict[str, Tensor] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)  # local relative FA/FR
    attempts: int = 0  # sends so far, across restarts
    wire_dtype: str = ""  # the dtype the server asked for; "" = the device's default


@dataclass
class DeviceState:
    """Everything a device keeps between rounds and across restarts."""

    device_id: str
    device_type: str
    fleet: str = "default"
    client: ClientState = field(default_factory=ClientState)
    personal_params: Tensor | None = None  # the latest personalized model
    baseline_params: Tensor | None = None  # the reference for relative FA/FR
    baseline_round: int = 0  # the round whose global model became the baseline
    served_params: Tensor | None = None  # the model the device serves (the gate's choice)
    served_name: str = ""  # baseline, personalized or global; "" before the first round
    served_round: int = 0  # the round that produced the served model
    model_config: dict[str, Any] | None = None
    participations: int = 0  # rounds this device took part in (t_m)
    last_round: int = 0  # highest round id seen on the downlink
    last_acked_round: int = 0  # highest round whose update the server acknowledged
    last_trained_round: int = 0  # a round is trained at most once, whatever the server says
    run_id: str = ""  # the server run this state belongs to
    finished: bool = False  # the server announced the end of the run
    pending: PendingUpdate | None = None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_finite(name: str, t: Tensor) -> None:
    if not all_finite(t):
        raise NonFiniteError(f"device state: tensor {name!r} holds NaN or Inf; not saved")


def _check_scalars(where: str, scalars: dict[str, float]) -> dict[str, float]:
    out = {}
    for k, v in scalars.items():
        v = float(v)
        if not math.isfinite(v):
            raise NonFiniteError(f"device state: {where} scalar {k!r} is {v}; not saved")
        out[str(k)] = v
    return out


def _collect_tensors(state: DeviceState) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors to write, and aliases (name -> stored name) for tensors that are the same
    object as another one (e.g. the personal model is also the strategy's `personal`
    tensor): each is stored once, and safetensors refuses shared storage anyway."""
    tensors: dict[str, Tensor] = {}
    for k, t in state.client.tensors.items():
        tensors[_CLIENT + k] = t
    if state.personal_params is not None:
        tensors[_PERSONAL] = state.personal_params
    if state.baseline_params is not None:
        tensors[_BASELINE] = state.baseline_params
    if state.served_params is not None:
        tensors[_SERVED] = state.served_params
    if state.pending is not None:
        for k, t in state.pending.tensors.items():
            tensors[_PENDING + k] = t
    out: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, tuple[int, ...], torch.dtype], str] = {}
    for k, t in tensors.items():
        _check_finite(k, t)
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if t.numel() > 0 and key in seen:
            aliases[k] = seen[key]
            continue
        seen[key] = k
        out[k] = t.detach().to("cpu").contiguous().clone()
    return out, aliases


def _tensor_files(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for p in directory.iterdir():
        m = _TENSOR_FILE_RE.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


class DeviceStateStore:
    """Reads and writes one device's state folder."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._generation = 0
        self._tensor_file: str | None = None
        self._tensor_sha: str | None = None
        self._aliases: dict[str, str] = {}

    @property
    def state_path(self) -> Path:
        return self.directory / STATE_FILE

    def exists(self) -> bool:
        return self.state_path.is_file()

    def load(self, *, cleanup: bool = False) -> DeviceState:
        """The last committed state. With `cleanup` (only the process that owns the folder
        may ask for it: a reader must never delete a file a writer is producing), leftovers
        of an interrupted save are removed."""
        meta = self._read_meta()
        tensors = self._read_tensors(meta)
        self._generation = int(meta.get("generation", 0))
        self._tensor_file = meta.get("tensor_file")
        self._tensor_sha = meta.get("tensor_sha256")
        self._aliases = dict(meta.get("tensor_aliases") or {})
        if cleanup:
            self._remove_leftovers()
        return _state_from(meta, tensors)

    def _read_meta(self) -> dict[str, Any]:
        path = self.state_path
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"no device state in {self.directory}") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"device state {path} is unreadable: {exc}") from exc
        if not isinstance(meta, dict) or meta.get("format") not in _READABLE_FORMATS:
            found = meta.get("format") if isinstance(meta, dict) else meta
            raise ConfigError(
                f"device state {path}: unsupported format {found!r} (this version reads "
                f"formats {', '.join(map(str, _READABLE_FORMATS))})"
            )
        return meta

    def _read_tensors(self, meta: dict[str, Any]) -> dict[str, Tensor]:
        """The committed tensors file (checked against its SHA-256), aliases resolved."""
        path = self.state_path
        tensors: dict[str, Tensor] = {}
        tfile = meta.get("tensor_file")
        if tfile:
            tpath = self.directory / tfile
            if not tpath.is_file():
                raise ConfigError(f"device state {path} names {tfile}, which is missing")
            if _sha256(tpath) != meta.get("tensor_sha256"):
                raise ConfigError(f"device state file {tpath} is corrupt (SHA-256 mismatch)")
            tensors = load_file(str(tpath))
        for name, target in (meta.get("tensor_aliases") or {}).items():
            if target not in tensors:
                raise ConfigError(f"device state {path}: alias {name!r} -> missing {target!r}")
            tensors[name] = tensors[target]
        return tensors

    def save(self, state: DeviceState, *, tensors_changed: bool = True) -> None:
        """Commit `state` atomically. With `tensors_changed=False` only the scalars are
        rewritten and the committed tensors file is reused (cheap bookkeeping saves, e.g.
        after an acknowledgement)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        client_scalars = _check_scalars("client", state.client.scalars)
        pending_meta = None
        if state.pending is not None:
            pending_meta = {
                "round_id": int(state.pending.round_id),
                "num_samples": int(state.pending.num_samples),
                "scalars": _check_scalars("update", state.pending.scalars),
                "report": state.pending.report,
                "attempts": int(state.pending.attempts),
                "wire_dtype": state.pending.wire_dtype,
            }
        if tensors_changed or self._tensor_file is None:
            tensors, aliases = _collect_tensors(state)
            # Never reuse the number of a file on disk: it may be the committed one.
            on_disk = [g for g, _ in _tensor_files(self.directory)]
            generation = max([self._generation, *on_disk]) + 1
            new_file = f"tensors-{generation}.safetensors"
            tpath = self.directory / new_file
            tmp = temp_path(tpath)
            save_file(tensors, str(tmp))
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, tpath)
            tfile: str | None = new_file
            tsha: str | None = _sha256(tpath)
        else:
            generation, tfile, tsha = self._generation, self._tensor_file, self._tensor_sha
            aliases = self._aliases
        meta = {
            "format": FORMAT_VERSION,
            "generation": generation,
            "tensor_file": tfile,
            "tensor_sha256": tsha,
            "tensor_aliases": aliases,
            "device_id": state.device_id,
            "device_type": state.device_type,
            "fleet": state.fleet,
            "client_scalars": client_scalars,
            "baseline_round": int(state.baseline_round),
            "model_config": state.model_config,
            "participations": int(state.participations),
            "last_round": int(state.last_round),
            "last_acked_round": int(state.last_acked_round),
            "last_trained_round": int(state.last_trained_round),
            "run_id": state.run_id,
            "finished": bool(state.finished),
            "pending": pending_meta,
            "served": {"name": state.served_name, "round": int(state.served_round)},
        }
        write_atomic(self.state_path, json.dumps(meta, indent=1, sort_keys=True).encode())
        self._generation, self._tensor_file, self._tensor_sha = generation, tfile, tsha
        self._aliases = aliases
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        # Older generations and temp files of interrupted saves; never the committed file.
        for gen, p in _tensor_files(self.directory):
            if p.name != self._tensor_file and gen != self._generation:
                p.unlink(missing_ok=True)
        for p in self.directory.glob(TMP_GLOB):
            p.unlink(missing_ok=True)


def _state_from(meta: dict[str, Any], tensors: dict[str, Tensor]) -> DeviceState:
    client = ClientState(
        tensors={k[len(_CLIENT) :]: v for k, v in tensors.items() if k.startswith(_CLIENT)},
        scalars={k: float(v) for k, v in meta.get("client_scalars", {}).items()},
    )
    pending = None
    if meta.get("pending") is not None:
        p = meta["pending"]
        pending = PendingUpdate(
            round_id=int(p["round_id"]),
            num_samples=int(p["num_samples"]),
            scalars={k: float(v) for k, v in p.get("scalars", {}).items()},
            tensors={k[len(_PENDING) :]: v for k, v in tensors.items() if k.startswith(_PENDING)},
            report=dict(p.get("report", {})),
            attempts=int(p.get("attempts", 0)),
            wire_dtype=str(p.get("wire_dtype", "")),
        )
    return DeviceState(
        device_id=str(meta["device_id"]),
        device_type=str(meta["device_type"]),
        fleet=str(meta.get("fleet", "default")),
        client=client,
        personal_params=tensors.get(_PERSONAL),
        baseline_params=tensors.get(_BASELINE),
        baseline_round=int(meta.get("baseline_round", 0)),
        model_config=meta.get("model_config"),
        participations=int(meta.get("participations", 0)),
        last_round=int(meta.get("last_round", 0)),
        last_acked_round=int(meta.get("last_acked_round", 0)),
        last_trained_round=int(meta.get("last_trained_round", 0)),
        run_id=str(meta.get("run_id", "")),
        finished=bool(meta.get("finished", False)),
        pending=pending,
        **_served_from(meta, tensors),
    )


def _served_from(meta: dict[str, Any], tensors: dict[str, Tensor]) -> dict[str, Any]:
    """The served model's fields. Format 1 predates the gate: such a device serves its
    baseline (its personal model was never checked against it)."""
    if meta.get("format") == 1:
        base = tensors.get(_BASELINE)
        return {
            "served_params": base,
            "served_name": "baseline" if base is not None else "",
            "served_round": int(meta.get("baseline_round", 0)) if base is not None else 0,
        }
    served = meta.get("served") or {}
    name = served.get("name", "") if isinstance(served, dict) else None
    if name not in SERVED_NAMES:
        raise ConfigError(f"device state: unknown served model {name!r}")
    params = tensors.get(_SERVED)
    if bool(name) != (params is not None):
        raise ConfigError(f"device state: served model {name!r} without its parameters")
    return {
        "served_params": params,
        "served_name": name,
        "served_round": int(served.get("round", 0)) if name else 0,
    }


def lock_folder(directory: Path) -> int:
    """An exclusive lock on the state folder for the life of the process (closing the
    returned descriptor releases it): two processes writing one device's state would undo
    each other's rounds."""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise FolderInUse(f"state folder {directory} is in use by another process") from None
    return fd


def load_or_create(
    directory: str | Path, device_id: str, device_type: str, fleet: str = "default"
) -> tuple[DeviceStateStore, DeviceState]:
    """Open a state folder as its owner (removing leftovers of an interrupted save); a new
    device starts empty. A folder that belongs to another device (id, type or fleet) is
    refused rather than silently reused."""
    store = DeviceStateStore(directory)
    if not store.exists():
        return store, DeviceState(device_id=device_id, device_type=device_type, fleet=fleet)
    state = store.load(cleanup=True)
    for what, have, want in (
        ("device id", state.device_id, device_id),
        ("device type", state.device_type, device_type),
        ("fleet", state.fleet, fleet),
    ):
        if have != want:
            raise ConfigError(
                f"state folder {directory} belongs to {what} {have!r}, not {want!r}; "
                "use another --state folder"
            )
    return store, state


def open_state_folder(
    directory: Path, device_id: str, device_type: str, fleet: str
) -> tuple[int | None, DeviceStateStore, DeviceState, Exception | None]:
    """Lock and load a device's state folder as its owner: (lock descriptor, store, state,
    None). A folder in use by another process raises `FolderInUse`; one that cannot be
    read (unreadable, corrupt, another device's, a bare OSError such as PermissionError)
    gives (None, a store never to be written, a fresh in-memory state, the error), so the
    device can still tell the server it declines before it stops."""
    fd: int | None = None
    try:
        fd = lock_folder(directory)
        store, state = load_or_create(directory, device_id, device_type, fleet)
    except FolderInUse:
        raise
    except (WakeflError, OSError, ValueError, KeyError, TypeError) as exc:
        if fd is not None:
            os.close(fd)
        return None, DeviceStateStore(directory), DeviceState(device_id, device_type, fleet), exc
    return fd, store, state, None
