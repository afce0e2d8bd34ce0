"""Crash-safe file replacement, shared by the device's state and the server's store.

Write to a temporary file beside the target, fsync it, rename it over the target, fsync
the directory: after a power cut the target holds the old or the new content, never a mix.
Temporary files are named `.<name>.tmp-<pid>-<thread>` so that an owner can find and
remove the leftovers of an interrupted write."""

from __future__ import annotations

import os
import threading
from pathlib import Path

TMP_GLOB = ".*.tmp-*"


def fsync_dir(path: Path) -> None:
    # The rename lives in the directory entry; without this a power cut may lose it.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data`: old or new content after a crash, never half. `mode`
    (before the umask) applies from the file's creation, so a private file (0o600) is
    never readable by others, not even while it is being written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
