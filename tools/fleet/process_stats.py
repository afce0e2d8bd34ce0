"""What the benchmarks measure of a process: CPU seconds (user + system, every thread) of
this process or another one by its id, and the id of a managed broker's process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (all threads) or of process `pid`."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def broker_pid(broker: Any) -> int:
    """The process id of a started ManagedBroker (server/broker.py)."""
    if broker.proc is None:
        raise RuntimeError("the broker is not running")
    return int(broker.proc.pid)
