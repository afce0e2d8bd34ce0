"""What the benchmarks measure of a process: CPU seconds (user + system, every thread) of
this process or another one by its id, this process's CPU seconds at the end of each round
of a server it runs, this process's peak memory, and the id of a managed broker's process."""

from __future__ import annotations

import contextlib
import os
import resource
import threading
from pathlib import Path
from typing import Any


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (all threads) or of process `pid`."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def peak_rss_kb() -> int:
    """VmHWM of this process (ru_maxrss would carry the parent's peak across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reset_peak_rss() -> int:
    """Reset the peak to the current RSS (Linux clear_refs 5); returns the current RSS."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return peak_rss_kb()


def broker_pid(broker: Any) -> int:
    """The process id of a started ManagedBroker (server/broker.py)."""
    if broker.proc is None:
        raise RuntimeError("the broker is not running")
    return int(broker.proc.pid)


class CpuAtRoundEnds:
    """This process's CPU seconds each time `server.reports` grows (a round closed), polled
    every `poll_s` from a thread of its own: the CPU of some rounds alone, the warm-up
    rounds left out (a long-running server's steady state reuses the update files of its
    pruned rounds, server/spare_files.py, which the first rounds have none of)."""

    def __init__(self, server: Any, poll_s: float = 0.2) -> None:
        self._server = server
        self._poll_s = poll_s
        self.marks: list[float] = []  # CPU seconds at the end of round 1, 2, ...
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-at-round-ends", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._catch_up()
            self._stop.wait(self._poll_s)

    def _catch_up(self) -> None:
        while len(self.marks) < len(self._server.reports):
            self.marks.append(cpu_seconds())

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        self._catch_up()  # a round closed since the last poll
        return self.marks
