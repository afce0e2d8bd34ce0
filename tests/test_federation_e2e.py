"""The whole federation as separate processes: a real mosquitto on 127.0.0.1 (the managed
broker), a real `wakefl server` and five real `wakefl device` processes, one per device
type of the tiny corpus, with the smallest model width. Checks that the run completes,
that a device killed mid-round lets the round close at its deadline with the others, and
that the clients reconnect on their own after a broker restart."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from wakefl.sdk.device_state import DeviceStateStore
from wakefl.server.broker import ManagedBroker

pytestmark = pytest.mark.slow

TYPES = ("A", "B", "C", "D", "E")
WIDTH = "0.05"
STRATEGY_ARGS = ("lr=0.05", "batch_size=4", "l_max=3", "warmup_steps=2")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES=""
    )
    return env


class Proc:
    """A `wakefl` sub-process whose output goes to a file the test can poll."""

    def __init__(self, name: str, args: list[str], logdir: Path) -> None:
        self.name = name
        self.log = logdir / f"{name}.log"
        with open(self.log, "wb") as out:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "wakefl.tools.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_env(),
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(pattern, self.text())
            if m:
                return m
            if self.p.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(
            f"{self.name}: no {pattern!r} within {timeout} s "
            f"(exit {self.p.poll()}):\n{self.text()[-3000:]}"
        )

    def finish(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            raise AssertionError(
                f"{self.name} did not exit within {timeout} s:\n{self.text()[-3000:]}"
            ) from None

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def _federation(
    tmp_path: Path,
    broker: ManagedBroker,
    manifest: Path,
    rounds: int,
    round_timeout: float,
    verbose: bool = False,
    min_clients: int | None = None,
) -> tuple[Proc, dict[str, Proc]]:
    logs = tmp_path / "logs"
    logs.mkdir()
    devices = ",".join(f"dev{t}:{t}" for t in TYPES)
    server_args = [
        "server",
        "--broker",
        broker.url,
        "--state",
        str(tmp_path / "server"),
        "--rounds",
        str(rounds),
        "--random-weights",
        "--width",
        WIDTH,
        "--devices",
        devices,
        "--round-timeout",
        str(round_timeout),
        "--ack-timeout",
        "3",
        "--group-by",
        "device_type",
        "--start-timeout",
        "120",
    ]
    for a in STRATEGY_ARGS:
        server_args += ["--strategy-arg", a]
    if min_clients is not None:
        server_args += ["--min-clients", str(min_clients)]
    server = Proc("server", server_args, logs)
    devs = {
        t: Proc(
            f"dev{t}",
            [
                "device",
                "--id",
                f"dev{t}",
                "--type",
                t,
                "--data",
                str(manifest),
                "--broker",
                broker.url,
                "--state",
                str(tmp_path / f"dev{t}"),
                "--width",
                WIDTH,
                "--idle-timeout",
                "120",
                *(["--verbose"] if verbose else []),
            ],
            logs,
        )
        for t in TYPES
    }
    return server, devs


def _stop_all(server: Proc, devs: dict[str, Proc]) -> None:
    for p in [server, *devs.values()]:
        p.kill()


@pytest.fixture()
def broker():
    # Directly under /tmp: mosquitto runs as its own user when started as root and must be
    # able to reach its persistence folder (pytest's tmp_path sits in a 0700 folder).
    folder = tempfile.mkdtemp(prefix="wakefl-e2e-broker-")
    b = ManagedBroker(folder).start()
    yield b
    b.stop()
    shutil.rmtree(folder, ignore_errors=True)


def test_run_completes_and_a_killed_device_does_not_hang_the_round(tmp_path, broker, tiny_corpus):
    server, devs = _federation(tmp_path, broker, tiny_corpus, rounds=2, round_timeout=12)
    try:
        server.wait_for(r"round 1/2: closed by all with 5/5 updates", 120)
        # Freeze device E between the rounds (its connection stays up, so the server still
        # counts it online and samples it), then kill it once round 2 is open: it dies
        # mid-round without having sent its update.
        devs["E"].p.send_signal(signal.SIGSTOP)
        server.wait_for(r"round 2/2: sampled 5", 60)
        devs["E"].p.send_signal(signal.SIGKILL)
        devs["E"].p.wait()
        m = server.wait_for(r"round 2/2: closed by (\w+) with (\d)/5 updates in ([\d.]+) s", 60)
        assert (m.group(1), m.group(2)) == ("deadline", "4")
        assert 11.0 < float(m.group(3)) < 30.0  # the 12 s deadline, not longer
        server.wait_for(r"run finished after 2 rounds", 30)
        assert server.finish(30) == 0
        for t in "ABCD":
            assert devs[t].finish(60) == 0, devs[t].text()
            out = devs[t].text()
            assert "run finished" in out and "2 trained, 2 update(s) accepted" in out, out
            state = DeviceStateStore(tmp_path / f"dev{t}").load()
            assert state.finished and state.participations == 2 and state.last_acked_round == 2
            assert state.pending is None and state.personal_params is not None
            # The local relative FA/FR report was printed for every round.
            assert len(re.findall(r"relative FA \d", out)) == 2, out
        state_e = DeviceStateStore(tmp_path / "devE").load()
        assert state_e.participations == 1 and not state_e.finished
    finally:
        _stop_all(server, devs)


def test_clients_reconnect_after_a_broker_restart(tmp_path, broker, tiny_corpus):
    # Round 3 waits for all five: a round samples the devices online when it opens, and
    # right after the restart a device's new Hello may not have been read yet.
    server, devs = _federation(
        tmp_path, broker, tiny_corpus, rounds=3, round_timeout=60, verbose=True, min_clients=5
    )
    try:
        server.wait_for(r"round 1/3: closed by all with 5/5 updates", 120)
        server.wait_for(r"round 2/3: sampled 5", 60)
        broker.restart()  # SIGTERM (mosquitto saves sessions and retained messages), start
        assert "round 3/3" not in server.text()  # round 3 needs the restarted broker
        server.wait_for(r"round 2/3: closed by all with 5/5 updates", 90)
        server.wait_for(r"run finished after 3 rounds", 90)
        assert server.finish(30) == 0
        for t in TYPES:
            assert devs[t].finish(60) == 0, devs[t].text()
            state = DeviceStateStore(tmp_path / f"dev{t}").load()
            assert state.finished and state.participations == 3 and state.last_acked_round == 3
            # It reconnected on its own, resuming its persistent session.
            out = devs[t].text()
            assert len(re.findall(rf"connected to \S+ as dev{t} ", out)) >= 2, out
            assert re.search(rf"as dev{t} \(session resumed\)", out), out
    finally:
        _stop_all(server, devs)


def _run_once(folder: Path, manifest: Path) -> tuple[dict[str, DeviceStateStore], Path]:
    """One whole federation of 2 rounds on its own broker; returns the device state stores
    and the server's state folder."""
    from wakefl.server.state_store import StateStore

    folder.mkdir()
    broker_dir = tempfile.mkdtemp(prefix="wakefl-e2e-broker-")
    b = ManagedBroker(broker_dir).start()
    try:
        server, devs = _federation(folder, b, manifest, rounds=2, round_timeout=60, min_clients=5)
        try:
            server.wait_for(r"run finished after 2 rounds", 240)
            assert server.finish(30) == 0
            for t in TYPES:
                assert devs[t].finish(60) == 0, devs[t].text()
        finally:
            _stop_all(server, devs)
    finally:
        b.stop()
        shutil.rmtree(broker_dir, ignore_errors=True)
    store = StateStore(folder / "server")
    try:
        state = store.load_server_state()
    finally:
        store.close()
    assert state is not None
    return {t: DeviceStateStore(folder / f"dev{t}") for t in TYPES}, state.global_params


def test_two_runs_with_the_same_seed_serve_the_same_models_bit_for_bit(tmp_path, tiny_corpus):
    # Updates arrive in whatever order the devices finish; the aggregate and every model a
    # device trains, personalizes and serves must not depend on it (nor on thread counts).
    import torch

    first, global_1 = _run_once(tmp_path / "run1", tiny_corpus)
    second, global_2 = _run_once(tmp_path / "run2", tiny_corpus)
    assert torch.equal(global_1, global_2)
    for t in TYPES:
        a, b = first[t].load(), second[t].load()
        assert a.participations == b.participations == 2
        assert a.served_name == b.served_name, t
        for name in ("personal_params", "served_params", "baseline_params"):
            x, y = getattr(a, name), getattr(b, name)
            assert x is not None and y is not None and torch.equal(x, y), (t, name)
