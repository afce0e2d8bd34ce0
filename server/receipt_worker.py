"""A thread of its own for folding accepted updates into the open round's receipts
(server/round_receipts.py), so that the recorder thread goes on writing, syncing and
acknowledging the next updates meanwhile.

On the recorder thread, the receipts (a full-size update's decode, float64 sum and norm:
about 7 ms of CPU) were the slowest stage of the path an update takes, and every update
waited for the one before: a 300-device round collected in 5.9 s, against 3.0 s with no
receipts at all (docs/SCALE.md, "Server CPU per update"). Folding is work on data already
durable and acknowledged, so nothing waits for it but the round's close, which `flush`es
this worker before it seals the receipts; an update still queued then is read from its file
(`RoundReceipts.include`), as after a restart.

The queue is bounded (`max_queued` updates, each holding its packed tensors): when folding
falls behind, `submit` waits, and so does the recorder's next acknowledgement.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger("wakefl.server")


class ReceiptWorker:
    """Runs submitted jobs one at a time, in order, on one daemon thread."""

    def __init__(self, max_queued: int = 16) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be at least 1, got {max_queued}")
        self.max_queued = max_queued
        self._jobs: deque[Callable[[], object]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], object]) -> None:
        """Queue `job`, waiting while `max_queued` jobs are queued; run it here once the
        worker is closed (nothing is dropped)."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._jobs) < self.max_queued or self._stop)
            if not self._stop:
                self._jobs.append(job)
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._loop, daemon=True, name="wakefl-receipts"
                    )
                    self._thread.start()
                self._cond.notify_all()
                return
        _run(job)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far has run; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._jobs) or self._stop)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
                self._cond.notify_all()  # a submitter waits for room
            _run(job)
            with self._cond:
                self._busy = False
                self._cond.notify_all()


def _run(job: Callable[[], object]) -> None:
    try:
        job()
    except Exception:  # noqa: BLE001 - the round's close reads an unfolded update from its file
        log.exception("folding an update into the round's receipts failed")
