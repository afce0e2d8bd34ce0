"""One process at a time on a folder of the cache: two runs that want the same corpus
built (two demos started together) must not both write it, and the second should reuse
what the first built rather than fail on a half-written folder."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import WakeflError

# A corpus build of the largest demo profile takes minutes on 2 cores; a holder past this
# is taken for stuck, and the waiter says so instead of waiting for ever.
DEFAULT_WAIT_S = 3 * 3600.0


def lock_path(folder: Path) -> Path:
    """The lock file beside `folder` (not inside it: the folder may be removed and built
    again while the lock is held)."""
    return folder.with_name(folder.name + ".lock")


@contextmanager
def folder_lock(
    folder: Path,
    wait_s: float = DEFAULT_WAIT_S,
    on_wait: Callable[[str], None] | None = None,
    poll_s: float = 1.0,
) -> Iterator[None]:
    """Hold an exclusive lock on `folder` for the block, waiting at most `wait_s` for
    another process to release it (`on_wait` is told once that it waits). The lock is the
    kernel's (flock): a holder that dies releases it."""
    path = lock_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise WakeflError(
                        f"another process has held {path} for over {wait_s:.0f} s; if no "
                        "other wakefl run is building there, remove that file and retry"
                    ) from None
                if on_wait is not None and not told:
                    on_wait(f"another run is building {folder}: waiting for it")
                    told = True
                time.sleep(poll_s)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock
