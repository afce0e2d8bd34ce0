"""The server's durable state: one SQLite database plus files written atomically.

Layout of the state directory:

    server.sqlite                 meta, rounds, devices, clients, updates, rejections
    models/state_rNNNNNN.st       ServerState after round N (safetensors + JSON metadata)
    updates/rNNNNNN/<device>.wkfl the accepted uplink frame, byte for byte

An update counts as accepted once its row is committed (synchronous=FULL, after the file
was fsynced); only then is it acknowledged. A round's new ServerState file is written and
fsynced first, then the round is marked closed in the same transaction that points at that
file, so SIGKILL at any point leaves either the old or the new state, never a mix.

Rejections are not worth an fsync each: a device flooding the server with refused messages
would otherwise queue every honest update behind one synchronous commit per refusal.
`count_rejection` only adds to counts in memory; a writer thread commits them in one
transaction at most every REJECTION_FLUSH_S (also `flush_rejections()`, called at round
close, and `close()`). In-process readers (`rejection_counts`) see the pending counts too;
SIGKILL loses at most the last interval's counts, never an accepted update.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from wakefl.errors import ConfigError
from wakefl.sdk import update_codec
from wakefl.sdk.atomic_files import write_atomic
from wakefl.sdk.messages import DEFAULT_MAX_BYTES, MAGIC, Uplink
from wakefl.sdk.selffl.strategy import ClientResult, ServerState

log = logging.getLogger("wakefl.server.store")

# Pending rejections are committed at most this often, in one transaction.
REJECTION_FLUSH_S = 0.5
# rejection_log rows per batch; refusals beyond it are still counted exactly (table
# `rejections`) and summarised in one log row per reason, so a flood cannot fill the disk.
MAX_LOG_ROWS_PER_FLUSH = 1000
# Per-device tallies (`clients.rejected`) kept per batch; a flood naming more distinct
# device ids than this (only possible for unregistered ones) is counted by reason only.
MAX_DEVICES_PER_FLUSH = 4096

# Format 2 (protocol v3): the strategy's uplink record is stored as JSON (`updates.record`,
# `clients.record`) instead of Self-FL's columns (sigma_m_sq, local_steps). A format 1
# store (written before protocol v3) is refused, not migrated: its recorded update files
# are v2 frames the server no longer reads (docs/PROTOCOL.md).
STORE_FORMAT = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (
    round_id INTEGER PRIMARY KEY, status TEXT NOT NULL, sampled TEXT NOT NULL,
    deadline REAL NOT NULL, opened_at REAL NOT NULL, closed_at REAL,
    accepted INTEGER NOT NULL DEFAULT 0, state_file TEXT);
CREATE TABLE IF NOT EXISTS devices (
    device_id TEXT PRIMARY KEY, device_type TEXT NOT NULL, source TEXT NOT NULL,
    online INTEGER NOT NULL DEFAULT 0, last_seen REAL);
CREATE TABLE IF NOT EXISTS clients (
    device_id TEXT PRIMARY KEY, num_samples INTEGER, record TEXT,
    rounds_reported INTEGER NOT NULL DEFAULT 0, last_round INTEGER,
    relative_fa REAL, relative_fr REAL, rejected INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS updates (
    round_id INTEGER NOT NULL, device_id TEXT NOT NULL, device_type TEXT NOT NULL,
    path TEXT NOT NULL, nbytes INTEGER NOT NULL, num_samples INTEGER NOT NULL,
    record TEXT NOT NULL, received_at REAL NOT NULL,
    PRIMARY KEY (round_id, device_id));
CREATE TABLE IF NOT EXISTS rejections (reason TEXT PRIMARY KEY, count INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS rejection_log (
    at REAL NOT NULL, reason TEXT NOT NULL, device_id TEXT, round_id INTEGER, detail TEXT);
CREATE TABLE IF NOT EXISTS declines (
    round_id INTEGER NOT NULL, device_id TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (round_id, device_id));
"""


def server_state_to_bytes(state: ServerState) -> bytes:
    tensors = {"global_params": state.global_params.detach().cpu().contiguous().clone()}
    for k, v in state.tensors.items():
        tensors[f"t.{k}"] = v.detach().cpu().contiguous().clone()
    meta = {"round_id": state.round_id, "scalars": state.scalars, "clients": state.clients}
    return st_save(tensors, metadata={"wakefl_server_state": json.dumps(meta)})


def server_state_from_bytes(data: bytes) -> ServerState:
    hlen = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + hlen])
    meta = json.loads(header["__metadata__"]["wakefl_server_state"])
    tensors = st_load(data)
    return ServerState(
        round_id=int(meta["round_id"]),
        global_params=tensors.pop("global_params"),
        tensors={k[2:]: v for k, v in tensors.items()},
        scalars={k: float(v) for k, v in meta["scalars"].items()},
        clients={c: {k: float(v) for k, v in d.items()} for c, d in meta["clients"].items()},
    )


# The wire frame: MAGIC | sha256(body) | body, body = u64 header length | JSON header | data.
_FRAME_PREFIX = len(MAGIC) + hashlib.sha256().digest_size
_FILE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "I8": torch.int8}
BaseFn = Callable[[], torch.Tensor]


def _recorded_params(
    tensors: dict[str, torch.Tensor], meta: dict[str, Any], base: BaseFn | None
) -> torch.Tensor:
    """The update's float32 parameters: the plain tensor, or a packed update (protocol v4)
    rebuilt from the round's global model `base()`. Its checksum was verified on receipt,
    against the same base, so it is not recomputed here."""
    codec = meta.get("codec")
    if codec is None:
        return tensors.pop("params").float()
    if base is None:
        raise ValueError("a packed update needs its round's global model to be read")
    parts = {k[len("params.") :]: tensors.pop(k) for k in list(tensors) if k.startswith("params.")}
    packed = update_codec.Packed(
        codec["name"], int(codec["numel"]), int(codec["block"]), parts, codec["sha256"]
    )
    return update_codec.decode(packed, base())


def read_recorded_update(
    path: Path, expected_numel: int | None = None, base: BaseFn | None = None
) -> Uplink:
    """One update file written by `StateStore.record_update`, read straight into tensors.

    The file is the uplink frame the server validated on receipt (hash, header, dtypes,
    shapes, finiteness, a packed update's checksum) and fsynced before acknowledging it, so
    it is trusted here: no re-hashing and no second safetensors parse, each tensor is read
    once from the file into its own buffer. A packed update is rebuilt from `base()`, the
    round's global model. A truncated or foreign file raises ConfigError."""
    try:
        with open(path, "rb") as f:
            head = f.read(_FRAME_PREFIX + 8)
            if len(head) != _FRAME_PREFIX + 8 or head[: len(MAGIC)] != MAGIC:
                raise ValueError("not a wakefl frame")
            hlen = int.from_bytes(head[_FRAME_PREFIX:], "little")
            header = json.loads(f.read(hlen))
            meta = json.loads(header.pop("__metadata__")["wakefl"])
            data_start = _FRAME_PREFIX + 8 + hlen
            tensors: dict[str, torch.Tensor] = {}
            for name, entry in header.items():
                t = torch.empty(entry["shape"], dtype=_FILE_DTYPES[entry["dtype"]])
                start, end = entry["data_offsets"]
                f.seek(data_start + start)
                if f.readinto(t.numpy().data.cast("B")) != end - start:
                    raise ValueError(f"tensor {name!r} is truncated")
                tensors[name] = t
        params = _recorded_params(tensors, meta, base)
        if expected_numel is not None and params.numel() != expected_numel:
            raise ValueError(f"{params.numel()} parameters, the model has {expected_numel}")
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
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(f"recorded update {path} is unreadable: {exc}") from exc


@dataclass(frozen=True)
class RoundRecord:
    round_id: int
    status: str  # "open" or "closed"
    sampled: list[str]
    deadline: float
    accepted: int


class UpdateView:
    """The accepted updates of one round as `ClientResult`s, read from disk one at a time
    on each iteration (re-iterable; memory O(d) whatever the number of updates)."""

    def __init__(
        self,
        store: StateStore,
        round_id: int,
        expected_numel: int | None,
        max_bytes: int,
        base: BaseFn | None = None,
    ) -> None:
        self.round_id = round_id
        self._root = store.root
        self._expected = expected_numel
        self._max_bytes = max_bytes
        self._base = base  # the round's global model, for packed updates (called lazily)
        self.rows = store.update_rows(round_id)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[ClientResult]:
        for row in self.rows:
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


class StateStore:
    """All durable server state of one fleet run. Thread-safe (one lock, one connection)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "models").mkdir(exist_ok=True)
        (self.root / "updates").mkdir(exist_ok=True)
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(
                self.root / "server.sqlite",
                check_same_thread=False,
                isolation_level=None,
                timeout=30,
            )
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._check_format()
            self._db.executescript(_SCHEMA)
            self._db.execute(
                "INSERT OR IGNORE INTO meta VALUES ('store_format', ?)", (json.dumps(STORE_FORMAT),)
            )
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"server state {self.root} is not usable: {exc}") from exc
        self.transactions = 0  # write transactions committed (one fsync each)
        # Rejections counted but not yet committed; `_pending_lock` is only ever taken
        # after `_lock` (or alone), and never held during a write.
        self._pending_lock = threading.Lock()
        self._pending = _PendingRejections()
        self._has_pending = threading.Event()
        self._stop_flush = threading.Event()
        self._flusher: threading.Thread | None = None

    def _check_format(self) -> None:
        """Refuse a store of another format (ConfigError) before anything is written."""
        tables = {
            r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")
        }
        if "meta" not in tables:
            return  # a new store
        row = self._db.execute("SELECT value FROM meta WHERE key='store_format'").fetchone()
        found = json.loads(row[0]) if row is not None else 1
        if found != STORE_FORMAT:
            self._db.close()
            raise ConfigError(
                f"server state {self.root} is in store format {found} (written before wire "
                f"protocol v3); this server reads format {STORE_FORMAT}. Finish "
                "that run with the release that started it, or start this one in a new --state "
                "folder"
            )

    def close(self) -> None:
        self._stop_flush.set()
        self._has_pending.set()
        if self._flusher is not None:
            self._flusher.join()
        try:
            self.flush_rejections()
        except Exception:  # noqa: BLE001 - closing must go on; the counts are in the log
            log.exception("pending rejection counts not written at close")
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction. On any error it is rolled back before the error goes on:
        a transaction left open would make every later BEGIN fail ("cannot start a
        transaction within a transaction"), i.e. one bad insert would stop all recording."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
                self.transactions += 1
            except BaseException:
                if self._db.in_transaction:  # a failed COMMIT (disk full) leaves it open too
                    self._db.rollback()
                raise

    # ------------------------------------------------------------------ meta
    def get_meta(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def set_meta(self, **values: Any) -> None:
        with self._tx() as db:
            for k, v in values.items():
                db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (k, json.dumps(v)))

    def run_id(self) -> str:
        rid = self.get_meta("run_id")
        if rid is None:
            rid = uuid.uuid4().hex[:16]
            self.set_meta(run_id=rid)
        return rid

    # ------------------------------------------------------------------ server state
    def load_server_state(self) -> ServerState | None:
        name = self.get_meta("state_file")
        if name is None:
            return None
        return server_state_from_bytes((self.root / "models" / name).read_bytes())

    def save_initial_state(self, state: ServerState) -> None:
        name = f"state_r{state.round_id:06d}.st"
        write_atomic(self.root / "models" / name, server_state_to_bytes(state))
        self.set_meta(state_file=name)

    # ------------------------------------------------------------------ rounds
    def open_round(self, round_id: int, sampled: list[str], deadline: float) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO rounds (round_id, status, sampled, deadline, opened_at)"
                " VALUES (?, 'open', ?, ?, ?)",
                (round_id, json.dumps(sampled), deadline, time.time()),
            )

    def extend_deadline(self, round_id: int, deadline: float) -> None:
        with self._tx() as db:
            db.execute("UPDATE rounds SET deadline=? WHERE round_id=?", (deadline, round_id))

    def round(self, round_id: int) -> RoundRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM rounds WHERE round_id=?", (round_id,)).fetchone()
            n = self._db.execute(
                "SELECT COUNT(*) FROM updates WHERE round_id=?", (round_id,)
            ).fetchone()[0]
        if row is None:
            return None
        return RoundRecord(
            row["round_id"], row["status"], json.loads(row["sampled"]), row["deadline"], n
        )

    def set_round_status(self, round_id: int, status: str) -> None:
        """ "sealed": the round takes no more updates but is not aggregated yet (sharded
        aggregation); "open" again when a restarted coordinator resumes it."""
        with self._tx() as db:
            db.execute(
                "UPDATE rounds SET status=? WHERE round_id=? AND status!='closed'",
                (status, round_id),
            )

    def open_round_record(self) -> RoundRecord | None:
        """The round now taking updates, if any (the newest one marked open)."""
        with self._lock:
            row = self._db.execute(
                "SELECT round_id FROM rounds WHERE status='open' ORDER BY round_id DESC LIMIT 1"
            ).fetchone()
        return None if row is None else self.round(int(row[0]))

    def close_round(self, round_id: int, new_state: ServerState) -> None:
        """Persist the state after `round_id` (file first), then mark the round closed."""
        name = f"state_r{new_state.round_id:06d}.st"
        write_atomic(self.root / "models" / name, server_state_to_bytes(new_state))
        with self._tx() as db:
            n = db.execute("SELECT COUNT(*) FROM updates WHERE round_id=?", (round_id,)).fetchone()[
                0
            ]
            db.execute(
                "UPDATE rounds SET status='closed', closed_at=?, accepted=?, state_file=?"
                " WHERE round_id=?",
                (time.time(), n, name, round_id),
            )
            db.execute("INSERT OR REPLACE INTO meta VALUES ('state_file', ?)", (json.dumps(name),))
        # Keep the previous state file as a fallback; older ones are no longer referenced.
        for old in (self.root / "models").glob("state_r*.st"):
            if old.name < f"state_r{new_state.round_id - 1:06d}.st":
                old.unlink(missing_ok=True)

    # ------------------------------------------------------------------ devices
    def register_device(self, device_id: str, device_type: str, source: str) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO devices (device_id, device_type, source) VALUES (?, ?, ?)",
                (device_id, device_type, source),
            )

    def devices(self) -> dict[str, str]:
        with self._lock:
            rows = self._db.execute("SELECT device_id, device_type FROM devices").fetchall()
        return {r[0]: r[1] for r in rows}

    def set_online(self, device_id: str, online: bool) -> None:
        with self._tx() as db:
            self._mark_online(db, device_id, online)

    @staticmethod
    def _mark_online(db: sqlite3.Connection, device_id: str, online: bool) -> None:
        db.execute(
            "UPDATE devices SET online=?, last_seen=? WHERE device_id=?",
            (int(online), time.time(), device_id),
        )

    def online_devices(self) -> list[str]:
        with self._lock:
            rows = self._db.execute("SELECT device_id FROM devices WHERE online=1").fetchall()
        return sorted(r[0] for r in rows)

    # ------------------------------------------------------------------ updates
    def has_update(self, round_id: int, device_id: str) -> bool:
        with self._lock:
            return (
                self._db.execute(
                    "SELECT 1 FROM updates WHERE round_id=? AND device_id=?", (round_id, device_id)
                ).fetchone()
                is not None
            )

    def record_update(self, msg: Uplink, payload: bytes) -> bool:
        """Durably record an accepted update; False when (round, device) is already on record."""
        rel = f"updates/r{msg.round_id:06d}/{msg.device_id}.wkfl"
        with self._lock:
            if self.has_update(msg.round_id, msg.device_id):
                return False
            write_atomic(self.root / rel, payload)
            # A file without its row is never read (rows name the files); the next accepted
            # send of this update overwrites it.
            with self._tx() as db:
                self._insert_update(db, msg, rel, len(payload))
        return True

    def record_update_if_open(self, msg: Uplink, payload: bytes, writer: str) -> str:
        """`record_update` for one of several processes sharing this store (aggregation
        workers): the row goes in only while its round is still open, checked in the same
        transaction, so once the coordinator sealed the round (`set_round_status`) no
        update can be acknowledged without being aggregated. The file is named for its
        writer, so two workers handed re-sends of one update never write the same file.
        Returns "" (recorded), "duplicate" or "stale_round"."""
        rel = f"updates/r{msg.round_id:06d}/{msg.device_id}.{writer}.wkfl"
        if self.has_update(msg.round_id, msg.device_id):
            return "duplicate"
        write_atomic(self.root / rel, payload)
        with self._tx() as db:
            status = db.execute(
                "SELECT status FROM rounds WHERE round_id=?", (msg.round_id,)
            ).fetchone()
            if status is None or status[0] != "open":
                return "stale_round"
            if db.execute(
                "SELECT 1 FROM updates WHERE round_id=? AND device_id=?",
                (msg.round_id, msg.device_id),
            ).fetchone():
                return "duplicate"
            self._insert_update(db, msg, rel, len(payload))
        return ""

    @staticmethod
    def _insert_update(db: sqlite3.Connection, msg: Uplink, rel: str, nbytes: int) -> None:
        # An accepted update proves the device is connected. Its Hello may say otherwise:
        # after a broker restart the server can read a device's will (offline) after the
        # device's new Hello, and the device repeats no Hello once it hears the server; it
        # would then be left out of every later round's sampling.
        StateStore._mark_online(db, msg.device_id, True)
        record = json.dumps(msg.record, sort_keys=True)
        db.execute(
            "INSERT INTO updates VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                msg.round_id,
                msg.device_id,
                msg.device_type,
                rel,
                nbytes,
                msg.num_samples,
                record,
                time.time(),
            ),
        )
        db.execute(
            "INSERT INTO clients (device_id, num_samples, record,"
            " rounds_reported, last_round, relative_fa, relative_fr) VALUES (?,?,?,1,?,?,?)"
            " ON CONFLICT(device_id) DO UPDATE SET num_samples=excluded.num_samples,"
            " record=excluded.record,"
            " rounds_reported=rounds_reported+1, last_round=excluded.last_round,"
            " relative_fa=excluded.relative_fa, relative_fr=excluded.relative_fr",
            (
                msg.device_id,
                msg.num_samples,
                record,
                msg.round_id,
                msg.relative_fa,
                msg.relative_fr,
            ),
        )

    def count_updates(self, round_id: int) -> int:
        with self._lock:
            return int(
                self._db.execute(
                    "SELECT COUNT(*) FROM updates WHERE round_id=?", (round_id,)
                ).fetchone()[0]
            )

    def record_decline(self, round_id: int, device_id: str, reason: str) -> bool:
        """A sampled device said it cannot train this round; False when already on record."""
        with self._tx() as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO declines VALUES (?, ?, ?, ?)",
                (round_id, device_id, reason[:500], time.time()),
            )
            return cur.rowcount == 1

    def declines(self, round_id: int) -> dict[str, str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT device_id, reason FROM declines WHERE round_id=?", (round_id,)
            ).fetchall()
        return {r[0]: r[1] for r in rows}

    def update_rows(self, round_id: int) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM updates WHERE round_id=? ORDER BY received_at, device_id",
                (round_id,),
            ).fetchall()
        return [dict(r) for r in rows]

    def updates(
        self,
        round_id: int,
        expected_numel: int | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        base: BaseFn | None = None,
    ) -> UpdateView:
        """The round's updates; `base` returns the round's global model for packed ones."""
        return UpdateView(self, round_id, expected_numel, max_bytes, base)

    def clients(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM clients").fetchall()
        return {r["device_id"]: dict(r) for r in rows}

    def prune_update_files(self, before_round: int) -> None:
        """Delete the tensor files of rounds < before_round (their rows stay as the record)."""
        for d in (self.root / "updates").glob("r*"):
            if d.is_dir() and d.name < f"r{before_round:06d}":
                for f in d.iterdir():
                    f.unlink(missing_ok=True)
                d.rmdir()

    # ------------------------------------------------------------------ rejections
    def count_rejection(
        self, reason: str, device_id: str | None, round_id: int | None, detail: str
    ) -> None:
        """Count one refused message. In memory only: the writer thread commits the batch
        within REJECTION_FLUSH_S, so this never waits for the disk."""
        with self._pending_lock:
            self._pending.add(reason, device_id, round_id, detail, time.time())
            if self._flusher is None and not self._stop_flush.is_set():
                self._flusher = threading.Thread(
                    target=self._flush_loop, daemon=True, name="wakefl-rejection-writer"
                )
                self._flusher.start()
        self._has_pending.set()

    def _flush_loop(self) -> None:
        while not self._stop_flush.is_set():
            self._has_pending.wait()
            if self._stop_flush.wait(REJECTION_FLUSH_S):
                return  # close() writes what is left
            self._has_pending.clear()
            try:
                self.flush_rejections()
            except Exception:  # noqa: BLE001 - kept pending, retried next interval
                log.exception("rejection counts not written yet; retrying")
                self._has_pending.set()

    def flush_rejections(self) -> None:
        """Commit the pending rejections in one transaction; on failure they stay pending."""
        with self._lock:
            with self._pending_lock:
                batch, self._pending = self._pending, _PendingRejections()
            if not batch.counts:
                return
            try:
                with self._tx() as db:
                    db.executemany(
                        "INSERT INTO rejections VALUES (?, ?) ON CONFLICT(reason)"
                        " DO UPDATE SET count=count+excluded.count",
                        batch.counts.items(),
                    )
                    db.executemany(
                        "INSERT INTO rejection_log VALUES (?, ?, ?, ?, ?)",
                        batch.log_rows + batch.summary_rows(),
                    )
                    db.executemany(
                        "UPDATE clients SET rejected=rejected+? WHERE device_id=?",
                        [(n, d) for d, n in batch.by_device.items()],
                    )
            except BaseException:
                with self._pending_lock:
                    batch.merge(self._pending)
                    self._pending = batch
                raise

    def rejection_counts(self) -> dict[str, int]:
        """Every rejection counted so far, committed or still pending."""
        with self._lock:
            rows = self._db.execute("SELECT reason, count FROM rejections").fetchall()
            with self._pending_lock:
                pending = dict(self._pending.counts)
        counts = {r[0]: r[1] for r in rows}
        for reason, n in pending.items():
            counts[reason] = counts.get(reason, 0) + n
        return counts

    def recent_rejections(self, limit: int = 20) -> list[dict[str, Any]]:
        """The newest committed rejections (time, reason, device, round, detail), newest
        first: what `wakefl status` shows an operator."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM rejection_log ORDER BY at DESC LIMIT ?", (int(limit),)
            ).fetchall()
        return [dict(r) for r in rows]


class _PendingRejections:
    """Rejections counted since the last commit: exact counts per reason, bounded log rows
    and per-device tallies (overflow summarised per reason)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.by_device: dict[str, int] = {}
        self.log_rows: list[tuple[float, str, str | None, int | None, str]] = []
        self.unlogged: dict[str, int] = {}

    def add(
        self, reason: str, device_id: str | None, round_id: int | None, detail: str, at: float
    ) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if device_id is not None and (
            device_id in self.by_device or len(self.by_device) < MAX_DEVICES_PER_FLUSH
        ):
            self.by_device[device_id] = self.by_device.get(device_id, 0) + 1
        if len(self.log_rows) < MAX_LOG_ROWS_PER_FLUSH:
            self.log_rows.append((at, reason, device_id, round_id, detail[:500]))
        else:
            self.unlogged[reason] = self.unlogged.get(reason, 0) + 1

    def summary_rows(self) -> list[tuple[float, str, str | None, int | None, str]]:
        now = time.time()
        return [
            (
                now,
                reason,
                None,
                None,
                f"{n} more rejection(s) of this reason in this batch, "
                "counted but not logged one by one",
            )
            for reason, n in self.unlogged.items()
        ]

    def merge(self, newer: _PendingRejections) -> None:
        """Add the rejections counted after this batch (a failed write keeps both)."""
        for reason, n in newer.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
        for dev, n in newer.by_device.items():
            if dev in self.by_device or len(self.by_device) < MAX_DEVICES_PER_FLUSH:
                self.by_device[dev] = self.by_device.get(dev, 0) + n
        room = max(0, MAX_LOG_ROWS_PER_FLUSH - len(self.log_rows))
        self.log_rows.extend(newer.log_rows[:room])
        for row in newer.log_rows[room:]:
            self.unlogged[row[1]] = self.unlogged.get(row[1], 0) + 1
        for reason, n in newer.unlogged.items():
            self.unlogged[reason] = self.unlogged.get(reason, 0) + n
