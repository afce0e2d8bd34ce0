"""One thread that drains a queue of work in order, for the server's background stages: the
recorder's batches (server/update_batches.py) and the receipts' folds
(server/receipt_worker.py).

The thread starts with the first item. `flush` waits until everything put so far has been
handled; `close` handles what is queued, then ends the thread. A queue bounded by
`max_queued` holds `put` back while it is full, so a slow stage slows its producer instead
of holding an unbounded number of model-sized updates in memory.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class WorkQueue(Generic[T]):
    """`handle` gets the items in order, up to `max_take` at a time, on one daemon thread
    named `name`."""

    def __init__(
        self,
        handle: Callable[[list[T]], None],
        name: str,
        max_take: int = 1,
        max_queued: int | None = None,
    ) -> None:
        if max_take < 1 or (max_queued is not None and max_queued < 1):
            raise ValueError(
                f"max_take and max_queued must be at least 1: {max_take}, {max_queued}"
            )
        self._handle = handle
        self._name = name
        self.max_take = max_take
        self.max_queued = max_queued
        self._items: deque[T] = deque()
        self._cond = threading.Condition()
        self._busy = 0  # items taken from the queue and not handled yet
        self._stop = False
        self._thread: threading.Thread | None = None

    def put(self, item: T) -> bool:
        """Queue `item` (waiting while the queue is full); False, and nothing queued, once
        the queue is closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._stop or not self._full())
            if self._stop:
                return False
            self._items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name=self._name)
                self._thread.start()
            self._cond.notify_all()
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every item put so far has been handled; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items and not self._busy, timeout)

    def close(self) -> None:
        """Handle what is queued, then stop the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def busy(self) -> bool:
        """Whether the thread is handling items now."""
        with self._cond:
            return bool(self._busy)

    def _full(self) -> bool:
        return self.max_queued is not None and len(self._items) >= self.max_queued

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._items) or self._stop)
                if not self._items:
                    return
                n = min(len(self._items), self.max_take)
                batch = [self._items.popleft() for _ in range(n)]
                self._busy = n
                self._cond.notify_all()  # a producer may wait for room
            self._handle(batch)
            with self._cond:
                self._busy = 0
                self._cond.notify_all()
