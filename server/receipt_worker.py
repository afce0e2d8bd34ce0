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
from collections.abc import Callable

from wakefl.server.work_queue import WorkQueue

log = logging.getLogger("wakefl.server")


class ReceiptWorker:
    """Runs submitted jobs one at a time, in order, on one daemon thread."""

    def __init__(self, max_queued: int = 16) -> None:
        self._queue: WorkQueue[Callable[[], object]] = WorkQueue(
            _run_all, "wakefl-receipts", max_queued=max_queued
        )

    def submit(self, job: Callable[[], object]) -> None:
        """Queue `job`, waiting while `max_queued` jobs are queued; run it here once the
        worker is closed (nothing is dropped)."""
        if not self._queue.put(job):
            _run_all([job])

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far has run; False on timeout."""
        return self._queue.flush(timeout)

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        self._queue.close()

    def busy(self) -> bool:
        """Whether a job is running now."""
        return self._queue.busy()


def _run_all(jobs: list[Callable[[], object]]) -> None:
    for job in jobs:
        try:
            job()
        except Exception:  # noqa: BLE001 - the round's close reads an unfolded update from its file
            log.exception("folding an update into the round's receipts failed")
