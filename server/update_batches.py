"""Recording accepted updates in batches, each acknowledged only once it is durable.

The network thread checks an update (decoding, admission, checksum) and hands it here; a
recorder thread takes whatever has queued up (at most `max_batch`): it writes and fsyncs
each file, syncs their folders once, commits every row in one SQLite transaction (one
fsync), and only then calls each update's `done`, which sends the ack and the PUBACK. A
crash anywhere before that commit leaves the batch's updates unacknowledged (the broker
re-delivers them to the server's session, the devices re-send them), and their files
unnamed by any row, so never read. Checking the next updates overlaps with the disk work.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from wakefl.protocol.messages import Uplink
from wakefl.server.server_session import ServerSession
from wakefl.server.work_queue import WorkQueue

log = logging.getLogger("wakefl.server")

# Called once the update's fate is known: "" recorded, else the refusal reason.
Done = Callable[[str], None]


class BatchRecorder:
    """A `Recorder` (server/ingest.py) for the process that runs the rounds: an update is
    recorded only while its round is the session's open round."""

    def __init__(self, session: ServerSession, max_batch: int = 16) -> None:
        self.s = session
        self._queue: WorkQueue[tuple[Uplink, bytes, Done]] = WorkQueue(
            self._record, "wakefl-update-recorder", max_take=max_batch
        )
        self.batches = 0  # transactions committed (one fsync each)

    def __call__(self, msg: Uplink, payload: bytes, done: Done) -> None:
        if not self._queue.put((msg, payload, done)):
            raise RuntimeError("the update recorder is closed")

    def _record(self, batch: list[tuple[Uplink, bytes, Done]]) -> None:
        store = self.s.store
        try:
            written = [(msg, store.write_update_file(msg, p), len(p)) for msg, p, _ in batch]
            store.sync_update_dirs(msg.round_id for msg, _, _ in batch)
            with self.s.commit_lock:  # the round cannot close between this check and the commit
                held = self.s.open_round
                results = store.record_written(written, held.round_id if held else None)
            self.batches += 1
        except Exception:  # noqa: BLE001 - the devices are told; their updates are not lost
            log.exception("a batch of %d update(s) could not be recorded", len(batch))
            results = ["internal"] * len(batch)
        for (_, _, done), result in zip(batch, results, strict=True):
            try:
                done(result)
            except Exception:  # noqa: BLE001 - one failed ack must not stop the others
                log.exception("acknowledging a recorded update failed")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every update handed over so far is done."""
        return self._queue.flush(timeout)

    def close(self) -> None:
        """Record what is queued, then stop the thread."""
        self._queue.close()
