"""Update files of pruned rounds, kept to be written over by the next rounds' updates.

A full-size update is a 3 MB file. Written as a new file, each of its pages is new to the
page cache, and on a virtual machine that hands free memory back to its host (as this
project's machines do), touching such a page costs a fault in the host as well: writing a
new 3 MB file took 4.6-5.1 ms of CPU, writing the same bytes over a file whose pages are
still cached 0.5 ms (docs/SCALE.md, "Server CPU per update"). So, as databases recycle
their log segments, the store moves the files of a pruned round here instead of deleting
them, and `reuse` renames one to a new update's name to be written over.

Nothing about durability changes: a reused file is written, cut to the new length and
fsynced like a new one, its name is made durable with its round folder's, and nothing reads
it until a row names it. A crash between the rename and the row leaves a file no row names,
which the round's pruning later takes back. The pool is bounded in files (`limit`); the
rest of a pruned round is deleted.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from pathlib import Path

log = logging.getLogger("wakefl.server.store")

# About 3 GB of full-size int8 updates: one pruned round of a 1,000-device fleet, with room.
DEFAULT_LIMIT = 1024


class SpareFiles:
    """A bounded pool of files in `folder` (on the store's file system) to be written over."""

    def __init__(self, folder: Path, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 0:
            raise ValueError("limit must be >= 0")
        folder.mkdir(parents=True, exist_ok=True)
        self._folder = folder
        self._limit = limit
        self._lock = threading.Lock()
        # Left by an earlier run of the store: still good to write over.
        self._names = sorted(p.name for p in folder.iterdir() if p.is_file())
        while len(self._names) > limit:
            (folder / self._names.pop()).unlink(missing_ok=True)

    def __len__(self) -> int:
        with self._lock:
            return len(self._names)

    def keep(self, path: Path) -> bool:
        """Move `path` (a pruned update's file) into the pool; False, and nothing done,
        when the pool is full."""
        name = f"{uuid.uuid4().hex}.spare"
        with self._lock:
            if len(self._names) >= self._limit:
                return False
            self._names.append(name)
        try:
            os.rename(path, self._folder / name)
        except OSError:
            with self._lock:
                self._names.remove(name)
            return False
        return True

    def reuse(self, dest: Path) -> int | None:
        """A file descriptor open for writing at `dest` (a name no file has yet), from a
        spare file renamed there; None when the pool is empty."""
        while True:
            with self._lock:
                if not self._names:
                    return None
                name = self._names.pop()
            try:
                os.rename(self._folder / name, dest)
            except FileNotFoundError:
                if not dest.parent.is_dir():  # the caller's mistake: keep the spare
                    with self._lock:
                        self._names.append(name)
                    raise
                log.warning("spare update file %s vanished; trying another", name)
                continue
            return os.open(dest, os.O_WRONLY)
