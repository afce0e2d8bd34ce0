"""Counting refused messages without an fsync each.

A device flooding the server with refused messages would otherwise queue every honest
update behind one synchronous commit per refusal. `RejectionLog.count` only adds to
counts in memory; a writer thread commits them in one transaction at most every
REJECTION_FLUSH_S (also `flush()`, called at round close, and `close()`). In-process
readers see the pending counts too (`pending_counts`); SIGKILL loses at most the last
interval's counts, never an accepted update.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from sqlite3 import Connection

log = logging.getLogger("wakefl.server.store")

# Pending rejections are committed at most this often, in one transaction.
REJECTION_FLUSH_S = 0.5
# rejection_log rows per batch; refusals beyond it are still counted exactly (table
# `rejections`) and summarised in one log row per reason, so a flood cannot fill the disk.
MAX_LOG_ROWS_PER_FLUSH = 1000
# Per-device tallies (`clients.rejected`) kept per batch; a flood naming more distinct
# device ids than this (only possible for unregistered ones) is counted by reason only.
MAX_DEVICES_PER_FLUSH = 4096

Transaction = Callable[[], contextlib.AbstractContextManager[Connection]]


class RejectionLog:
    """Pending rejection counts of one store and the thread that commits them. `lock` is
    the store's; `_pending_lock` is only ever taken after it (or alone), and never held
    during a write."""

    def __init__(self, lock: threading.RLock, tx: Transaction) -> None:
        self._lock = lock
        self._tx = tx
        self._pending_lock = threading.Lock()
        self._pending = PendingRejections()
        self._has_pending = threading.Event()
        self._stop_flush = threading.Event()
        self._flusher: threading.Thread | None = None

    def close(self) -> None:
        self._stop_flush.set()
        self._has_pending.set()
        if self._flusher is not None:
            self._flusher.join()
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - closing must go on; the counts are in the log
            log.exception("pending rejection counts not written at close")

    def pending_counts(self) -> dict[str, int]:
        with self._pending_lock:
            return dict(self._pending.counts)

    def count(self, reason: str, device_id: str | None, round_id: int | None, detail: str) -> None:
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
                self.flush()
            except Exception:  # noqa: BLE001 - kept pending, retried next interval
                log.exception("rejection counts not written yet; retrying")
                self._has_pending.set()

    def flush(self) -> None:
        """Commit the pending rejections in one transaction; on failure they stay pending."""
        with self._lock:
            with self._pending_lock:
                batch, self._pending = self._pending, PendingRejections()
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


class PendingRejections:
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

    def merge(self, newer: PendingRejections) -> None:
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
