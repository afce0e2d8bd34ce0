"""`wakefl server --broker embedded` leaves no broker behind (issue #50, item 2): SIGTERM,
SIGINT and SIGHUP stop the mosquitto it started, and so does its abrupt death (SIGKILL),
through the broker's parent-death signal. Real processes, bounded in time, cleaned up by
PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_server(state: Path) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "wakefl.tools.cli", "server", "--broker", "embedded"]
        + ["--state", str(state), "--random-weights", "--width", "0.05"]
        + ["--devices", "d1:A", "--rounds", "1", "--start-timeout", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        # SIGINT as a terminal's Ctrl-C delivers it: a suite started in the background
        # (`cmd &` in a script) hands its children SIGINT ignored, which Python keeps.
        preexec_fn=_sigint_default,
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        lines.extend(proc.stdout)

    threading.Thread(target=read, daemon=True).start()
    return proc, lines


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name
)
def test_the_embedded_broker_ends_with_the_server(tmp_path, sig):
    proc, lines = _start_server(tmp_path / "state")
    broker: list[int] = []
    try:
        assert _wait(lambda: any("waiting for devices" in ln for ln in lines), 90), "".join(lines)
        broker = [
            p for p in _children(proc.pid) if "mosquitto" in Path(f"/proc/{p}/comm").read_text()
        ]
        assert len(broker) == 1, broker
        proc.send_signal(sig)
        proc.wait(30)
        assert _wait(lambda: not _alive(broker[0]), 10), (
            f"mosquitto {broker[0]} outlived the server"
        )
        if sig != signal.SIGKILL:
            assert proc.returncode != 0 and "Traceback" not in "".join(lines), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in broker:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
