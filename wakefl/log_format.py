"""One log format for every long-running command: `2026-01-31 19:01:30 INFO wakefl.server:
round 1/10 ...`. Python logging (to stderr) and the progress lines of the server and the
device (to stdout) share it, so that their lines interleave in one readable, time-stamped
log. Configured once at the command-line entry point (`wakefl.tools.cli.main`). The line a
command ends on (`wakefl: error: ...`) takes the format too where stderr is a log (a file or
a pipe), and stays a plain sentence where a person reads it on a terminal."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

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


def log_line(name: str, line: str, level: str = "INFO", now: float | None = None) -> str:
    """One line in the log format."""
    stamp = time.strftime(DATEFMT, time.localtime(time.time() if now is None else now))
    return f"{stamp} {level} {name}: {line}"


def progress_line(name: str, line: str, now: float | None = None) -> str:
    """A progress line in the log format."""
    return log_line(name, line, "INFO", now)


def is_terminal(stream: TextIO) -> bool:
    """Whether a person reads `stream` on a terminal (not a log file or a pipe)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def final_line(name: str, line: str, stream: TextIO, level: str = "ERROR") -> str:
    """The line a command ends on (`wakefl: error: ...`): plain on a terminal; in the log
    format elsewhere, so that a log's last line is stamped like all the others."""
    return f"{name}: {line}" if is_terminal(stream) else log_line(name, line, level)


def progress_printer(name: str) -> Callable[[str], None]:
    """Prints progress lines on stdout in the log format (always shown, unlike INFO logs
    without -v)."""

    def say(line: str) -> None:
        print(progress_line(name, line), flush=True)

    return say
