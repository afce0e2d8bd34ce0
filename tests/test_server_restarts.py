"""The server's state across failures: killed mid-round it resumes without losing an
update, it outlives a broker restart, updates queued while it was down are taken after,
recorded updates read back as received, and a state folder of an older format is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from server_sim import (
    FLEET,
    D,
    SimDevice,
    close_all,
    collect_lines,
    expected_global,
    make_server,
    round_orders,
    start,
    wait_for,
)

from wakefl.protocol import messages as M
from wakefl.server.state_store import StateStore
from wakefl.tools.fleet.bench_hostile_fleet import server_command


def _cli_server(broker_url: str, state: Path, init: Path, rounds: int) -> subprocess.Popen:
    cmd = server_command(
        broker_url, state, FLEET, "a:speaker,b:speaker,c:tv",
        "--rounds", str(rounds), "--round-timeout", "60", "--init-model", str(init),
        "--ack-timeout", "2",
    )  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_server_sigkill_mid_round_resumes_without_losing_updates(mqtt_broker, tmp_path):
    init = tmp_path / "init.safetensors"
    save_file({"params": torch.zeros(D)}, str(init))
    state = tmp_path / "server"
    devs = [
        SimDevice(mqtt_broker.url, d, t)
        for d, t in {"a": "speaker", "b": "speaker", "c": "tv"}.items()
    ]
    c = devs[2]
    c.hold_from = 2
    c.hold.clear()
    proc = _cli_server(mqtt_broker.url, state, init, rounds=3)
    try:
        wait_for(lambda: all(1 in d.acked for d in devs), 30, "round 1")
        wait_for(lambda: all(2 in d.acked for d in devs[:2]), 30, "a and b acked in round 2")
        acked_before = {(d.dev, r) for d in devs for r in d.acked}
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = _cli_server(mqtt_broker.url, state, init, rounds=3)
        lines = collect_lines(proc)
        # c's held update goes out only once the restarted server has read its state, so the
        # resume line counts what was on record before the kill, not a race with c.
        wait_for(lambda: any("resumed with" in line for line in lines), 30, "the resume line")
        c.hold.set()
        proc.wait(60)
        out = "".join(lines)
        assert proc.returncode == 0, out
        assert "resumed with 2/3 updates on record" in out
        wait_for(lambda: all(d.final is not None for d in devs), 10, "the end announcement")
    finally:
        if proc.poll() is None:
            proc.kill()
        for d in devs:
            d.close()
    store = StateStore(state)
    recorded = {(row["device_id"], r) for r in (1, 2, 3) for row in store.update_rows(r)}
    assert acked_before <= recorded
    assert len(recorded) == 9
    assert store.load_server_state().round_id == 3
    want = expected_global(devs, 3, 3, False, round_orders(state, 3))
    torch.testing.assert_close(store.load_server_state().global_params, want, rtol=0, atol=1e-6)


def test_broker_restart_run_completes(mqtt_broker, tmp_path):
    reg = {"a": "speaker", "b": "tv"}
    devs = [SimDevice(mqtt_broker.url, d, t) for d, t in reg.items()]
    devs[1].hold_from = 2
    devs[1].hold.clear()
    srv = make_server(mqtt_broker, tmp_path, reg, rounds=3, round_timeout=60)
    thread = start(srv)
    try:
        wait_for(lambda: 2 in devs[0].acked, 30, "a's round 2 ack")
        mqtt_broker.restart(kill=True)
        devs[1].hold.set()
        thread.join(60)
        assert not thread.is_alive()
    finally:
        close_all(devs)
    assert [r.round_id for r in srv.reports] == [1, 2, 3]
    assert all(sorted(r.reported) == ["a", "b"] for r in srv.reports)
    assert srv.link.connects >= 2


def test_updates_queued_while_server_was_down_are_accepted_after_restart(mqtt_broker, tmp_path):
    reg = {"a": "speaker", "b": "speaker", "c": "tv"}
    # resend_s=300: b's single send is the one queued in the server's broker session
    devs = [SimDevice(mqtt_broker.url, d, t, resend_s=300) for d, t in reg.items()]
    b = devs[1]
    b.hold.clear()
    srv = make_server(mqtt_broker, tmp_path, reg, rounds=1, round_timeout=60)
    thread = start(srv)
    try:
        wait_for(lambda: all(1 in d.acked for d in (devs[0], devs[2])), 20, "a and c acked")
        srv.stop_event.set()
        thread.join(20)
        assert not thread.is_alive()
        b.hold.set()  # published while no server is connected: queued by the broker
        wait_for(lambda: 1 in b.sent, 5, "b's update sent")
        time.sleep(0.5)
        srv2 = make_server(mqtt_broker, tmp_path, reg, rounds=1, round_timeout=60)
        t0 = time.monotonic()
        srv2.run()
        wall = time.monotonic() - t0
    finally:
        close_all(devs)
    assert "stale_round" not in srv2.rejections, dict(srv2.rejections)
    assert srv2.reports[0].closed_by == "all" and sorted(srv2.reports[0].reported) == [
        "a",
        "b",
        "c",
    ]
    assert 1 in b.acked and wall < 30


@pytest.mark.parametrize("wire_dtype", ["fp32", "fp16"])
def test_recorded_update_reads_back_what_was_received(tmp_path, wire_dtype):
    from wakefl.errors import ConfigError
    from wakefl.server.recorded_updates import read_recorded_update

    g = torch.Generator().manual_seed(3)
    up = M.Uplink(
        fleet="f",
        run_id="r",
        device_id="d1",
        device_type="A",
        round_id=2,
        params=torch.randn(1000, generator=g),
        num_samples=40,
        record={"sigma_sq": 0.25, "local_steps": 7},
        relative_fa=0.9,
        relative_fr=1.0,
        tensors={"converged": torch.randn(1000, generator=g)},
    )
    frame = M.encode(up, wire_dtype=wire_dtype)
    path = tmp_path / "u.bin"
    path.write_bytes(frame)
    fast = read_recorded_update(path, expected_numel=1000)
    full = M.decode_as(frame, M.Uplink)
    assert torch.equal(fast.params, full.params) and fast.params.dtype == torch.float32
    assert torch.equal(fast.tensors["converged"], full.tensors["converged"])
    assert (fast.device_id, fast.round_id, fast.record, fast.num_samples) == (
        "d1",
        2,
        {"sigma_sq": 0.25, "local_steps": 7},
        40,
    )
    path.write_bytes(frame[: len(frame) // 2])  # truncated by a disk fault
    with pytest.raises(ConfigError):
        read_recorded_update(path, expected_numel=1000)
    path.write_bytes(b"not a frame at all")
    with pytest.raises(ConfigError):
        read_recorded_update(path)


def test_store_write_rolls_back_so_later_updates_are_recorded(tmp_path):
    store = StateStore(tmp_path / "s")
    bad = M.Uplink(FLEET, "r", "evil", "tv", 1, torch.zeros(4), num_samples=2**63)
    with pytest.raises(OverflowError):
        store.record_update(bad, b"x")
    good = M.Uplink(FLEET, "r", "a", "tv", 1, torch.zeros(4), num_samples=5)
    assert store.record_update(good, b"y")
    store.count_rejection("malformed", "a", 1, "still writable")
    assert [r["device_id"] for r in store.update_rows(1)] == ["a"]
    assert store.rejection_counts() == {"malformed": 1}


def test_a_state_folder_of_the_previous_store_format_is_refused_with_a_clear_message(tmp_path):
    """Protocol v3 stores the uplink record as JSON; a folder written before (Self-FL's
    sigma_m_sq / local_steps columns, v2 update files) is refused, never half read."""
    import sqlite3

    from wakefl.errors import ConfigError

    folder = tmp_path / "old"
    folder.mkdir()
    db = sqlite3.connect(folder / "server.sqlite")
    db.executescript(
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "INSERT INTO meta VALUES ('run_id', '\"abc\"');"
        "CREATE TABLE updates (round_id INTEGER NOT NULL, device_id TEXT NOT NULL,"
        " device_type TEXT NOT NULL, path TEXT NOT NULL, nbytes INTEGER NOT NULL,"
        " sigma_m_sq REAL NOT NULL, num_samples INTEGER NOT NULL, local_steps INTEGER NOT NULL,"
        " received_at REAL NOT NULL, PRIMARY KEY (round_id, device_id));"
    )
    db.commit()
    db.close()
    with pytest.raises(ConfigError, match="store format 1.*reads format 2.*new --state"):
        StateStore(folder)
    fresh = StateStore(tmp_path / "new")  # a new folder is created in the current format
    fresh.close()
    again = StateStore(tmp_path / "new")  # and opens again
    assert again.get_meta("store_format") == 2
    again.close()
