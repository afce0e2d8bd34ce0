"""The server's durable state: one SQLite database plus files written atomically.

Layout of the state directory:

    server.sqlite                 meta, rounds, devices, clients, updates, rejections
    models/state_rNNNNNN.st       ServerState after round N (safetensors + JSON metadata)
    updates/rNNNNNN/<device>.wkfl the accepted uplink frame, byte for byte
    updates/spare/                pruned rounds' files, written over by new updates

An update counts as accepted once its row is committed (synchronous=FULL, after the file
was fsynced); only then is it acknowledged. A round's new ServerState file is written and
fsynced first, then the round is marked closed in the same transaction that points at that
file, so SIGKILL at any point leaves either the old or the new state, never a mix.

Rejections are not worth an fsync each: they are counted in memory and committed in
batches (server/rejection_log.py). Reading the files back: server/recorded_updates.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wakefl.protocol.messages import DEFAULT_MAX_BYTES, Uplink
from wakefl.sdk.atomic_files import fsync_dir, write_atomic
from wakefl.sdk.selffl.strategy import ServerState
from wakefl.server.recorded_updates import (
    BaseFn,
    UpdateView,
    server_state_from_bytes,
    server_state_to_bytes,
)
from wakefl.server.rejection_log import RejectionLog
from wakefl.server.spare_files import DEFAULT_LIMIT as DEFAULT_SPARES
from wakefl.server.spare_files import SpareFiles
from wakefl.server.store_schema import insert_update, mark_online, open_database

log = logging.getLogger("wakefl.server.store")


@dataclass(frozen=True)
class RoundRecord:
    round_id: int
    status: str  # "open" or "closed"
    sampled: list[str]
    deadline: float
    accepted: int


class StateStore:
    """All durable server state of one fleet run. Thread-safe (one lock, one connection)."""

    def __init__(self, root: str | Path, spare_files: int = DEFAULT_SPARES) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "models").mkdir(exist_ok=True)
        (self.root / "updates").mkdir(exist_ok=True)
        self._lock = threading.RLock()
        self._db = open_database(self.root)
        self.transactions = 0  # write transactions committed (one fsync each)
        self._rejections = RejectionLog(self._lock, self._tx)
        self.spares = SpareFiles(self.root / "updates" / "spare", spare_files)

    def close(self) -> None:
        self._rejections.close()
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

    def unseal_rounds(self) -> None:
        """Open again a round left sealed (its coordinator was killed while aggregating)."""
        with self._tx() as db:
            db.execute("UPDATE rounds SET status='open' WHERE status='sealed'")

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
            mark_online(db, device_id, online)

    def presence(self) -> dict[str, tuple[bool, float | None]]:
        """Each device's last word on its presence (True: its last Hello said online, or
        an update came since) and when the server last heard from it (epoch s)."""
        with self._lock:
            rows = self._db.execute("SELECT device_id, online, last_seen FROM devices").fetchall()
        return {r[0]: (bool(r[1]), r[2]) for r in rows}

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
                insert_update(db, msg, rel, len(payload))
        return True

    def write_update_file(self, msg: Uplink, payload: bytes) -> str:
        """Write an update's frame under a name of its own and fsync it (its directory is
        synced by `sync_update_dirs`, once per batch); the path relative to the store.
        Nothing reads the file until a row names it (`record_written`), and a recorded file
        is never overwritten."""
        rel = f"updates/r{msg.round_id:06d}/{msg.device_id}.{uuid.uuid4().hex[:12]}.wkfl"
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = self.spares.reuse(path)  # a pruned round's file, its pages still cached
        if fd is None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
        return rel

    def sync_update_dirs(self, round_ids: Iterable[int]) -> None:
        """Make the names of the files just written durable: their round folders, and the
        folder holding those."""
        for rid in sorted(set(round_ids)):
            fsync_dir(self.root / f"updates/r{rid:06d}")
        fsync_dir(self.root / "updates")

    def record_written(
        self, batch: list[tuple[Uplink, str, int]], open_round: int | None
    ) -> list[str]:
        """Commit the rows of updates whose files are written and synced (update, path,
        bytes), in one transaction: per update "" (recorded), "stale_round" (its round is
        not `open_round`) or "duplicate" (on record already, this batch included)."""
        out = []
        with self._tx() as db:
            for msg, rel, nbytes in batch:
                if msg.round_id != open_round:
                    out.append("stale_round")
                elif db.execute(
                    "SELECT 1 FROM updates WHERE round_id=? AND device_id=?",
                    (msg.round_id, msg.device_id),
                ).fetchone():
                    out.append("duplicate")
                else:
                    insert_update(db, msg, rel, nbytes)
                    out.append("")
        return out

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
            insert_update(db, msg, rel, len(payload))
        return ""

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
        return UpdateView(
            self.root, self.update_rows(round_id), round_id, expected_numel, max_bytes, base
        )

    def clients(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM clients").fetchall()
        return {r["device_id"]: dict(r) for r in rows}

    def prune_update_files(self, before_round: int) -> None:
        """Take back the tensor files of rounds < before_round (their rows stay as the
        record): into the pool of spare files while it has room, else deleted."""
        for d in (self.root / "updates").glob("r*"):
            if d.is_dir() and d.name < f"r{before_round:06d}":
                for f in d.iterdir():
                    if not self.spares.keep(f):
                        f.unlink(missing_ok=True)
                d.rmdir()

    # ------------------------------------------------------------------ rejections
    def count_rejection(
        self, reason: str, device_id: str | None, round_id: int | None, detail: str
    ) -> None:
        """Count one refused message, in memory (server/rejection_log.py): never waits for
        the disk."""
        self._rejections.count(reason, device_id, round_id, detail)

    def flush_rejections(self) -> None:
        """Commit the pending rejections in one transaction; on failure they stay pending."""
        self._rejections.flush()

    def recent_rejections(self, limit: int = 20) -> list[dict[str, Any]]:
        """The newest committed rejections (time, reason, device, round, detail), newest
        first: what `wakefl status` shows an operator."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM rejection_log ORDER BY at DESC LIMIT ?", (int(limit),)
            ).fetchall()
        return [dict(r) for r in rows]

    def rejection_counts(self) -> dict[str, int]:
        """Every rejection counted so far, committed or still pending."""
        with self._lock:
            rows = self._db.execute("SELECT reason, count FROM rejections").fetchall()
            pending = self._rejections.pending_counts()
        counts = {r[0]: r[1] for r in rows}
        for reason, n in pending.items():
            counts[reason] = counts.get(reason, 0) + n
        return counts
