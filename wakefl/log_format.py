"""One log format for every long-running command: `2026-01-31 19:01:30 INFO wakefl.server:
round 1/10 ...`. Python logging (to stderr) and the progress lines of the server and the
device (to stdout) share it, so that their lines interleave in one readable, time-stamped
log. Configured once at the command-line entry point (`wakefl.tools.cli.main`)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%Y-%m-%d %H:%M:%S"


class _Handler(logging.StreamHandler):
    """The handler `configure` installs (recognised so it is installed once). It writes to
    whatever `sys.stderr` is when a record comes, not to the stream of its creation: an
    embedding program (or a test) may replace sys.stderr later."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure(verbose: bool = False) -> None:
    """Python logging to stderr in FORMAT; INFO with `verbose`, else WARNING."""
    root = logging.getLogger()
    if not any(isinstance(h, _Handler) for h in root.handlers):
        handler = _Handler()
        handler.setFormatter(logging.Formatter(FORMAT, DATEFMT))
        root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)


def progress_line(name: str, line: str, now: float | None = None) -> str:
    """A progress line in the log format."""
    stamp = time.strftime(DATEFMT, time.localtime(time.time() if now is None else now))
    return f"{stamp} INFO {name}: {line}"


def progress_printer(name: str) -> Callable[[str], None]:
    """Prints progress lines on stdout in the log format (always shown, unlike INFO logs
    without -v)."""

    def say(line: str) -> None:
        print(progress_line(name, line), flush=True)

    return say
