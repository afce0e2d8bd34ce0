"""Updates recorded in batches (server/update_batches.py): one transaction per batch, and
no update acknowledged before its batch is durable. The crash is a real one: a child
process records updates into a real store and dies (os._exit, no cleanup, as SIGKILL)
halfway through writing a batch; the store it leaves is then read back."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from wakefl.protocol import messages as M
from wakefl.server.recorded_updates import read_recorded_update
from wakefl.server.state_store import StateStore

D = 1000

_CHILD = textwrap.dedent(
    """
    import os, sys, threading
    from pathlib import Path
    import torch
    from wakefl.protocol import messages as M
    from wakefl.server.admission import OpenRound
    from wakefl.server.server_config import ServerConfig
    from wakefl.server.server_session import ServerSession
    from wakefl.server.update_batches import BatchRecorder

    state, acks, crash_at = Path(sys.argv[1]), open(sys.argv[2], "a"), int(sys.argv[3])
    cfg = ServerConfig(broker_url="mqtt://127.0.0.1:1", state_dir=state,
                       initial_params=torch.zeros(1000))
    session = ServerSession(cfg, progress=lambda line: None)
    session.open_round = OpenRound.of(1, [f"d{i}" for i in range(20)], 1e12)
    recorder = BatchRecorder(session, max_batch=8)
    writes = 0
    write = session.store.write_update_file

    def write_or_die(msg, payload):
        global writes
        writes += 1
        if writes == crash_at:  # the files before it in this batch are on disk, no row yet
            os._exit(9)
        return write(msg, payload)

    session.store.write_update_file = write_or_die

    def acked(dev):
        def done(result):
            if result == "":  # the ack goes out now: noted durably first
                acks.write(dev + "\\n"); acks.flush(); os.fsync(acks.fileno())
        return done

    def update(i):
        up = M.Uplink("f", "r", f"d{i}", "t", 1, torch.full((1000,), float(i)), 1,
                      {"sigma_sq": 0.1, "has_variance": 1.0, "local_steps": 1.0})
        return up, M.encode(up)

    for i in range(3):  # a first batch, recorded and acknowledged
        recorder(*update(i), acked(f"d{i}"))
    recorder.flush()
    with session.commit_lock:  # the next updates queue up behind a commit waiting for it
        for i in range(3, 9):
            recorder(*update(i), acked(f"d{i}"))
    recorder.flush()
    print("no crash")
    """
)


def test_a_crash_in_the_middle_of_a_batch_loses_no_acknowledged_update(tmp_path):
    state, acks = tmp_path / "server", tmp_path / "acks.txt"
    acks.touch()
    # Files 1-3 are the first batch's. The 4th update is taken alone or with the ones
    # queued behind it; either way the 6th file write is not the first of its batch, so
    # the process dies with a batch's file on disk and its rows not committed.
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(state), str(acks), "6"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 9, proc.stderr[-2000:]
    acked = set(acks.read_text().split())
    store = StateStore(state)
    try:
        rows = {r["device_id"]: r for r in store.update_rows(1)}
        written = sorted(p.name for p in (state / "updates" / "r000001").iterdir())
    finally:
        store.close()
    assert {"d0", "d1", "d2"} <= acked  # the first batch went through
    assert acked <= set(rows), "an acknowledged update is not on record"
    for dev in acked:  # and its file holds exactly what was sent
        up = read_recorded_update(state / rows[dev]["path"], D)
        i = int(dev[1:])
        assert torch.equal(up.params, torch.full((D,), float(i))) and up.device_id == dev
    # the crash hit a batch with a file already written: an update on disk, in no row,
    # never acknowledged (its device re-sends it; the broker re-delivers it)
    on_record = {Path(r["path"]).name for r in rows.values()}
    orphans = [name for name in written if name not in on_record]
    assert orphans and all(name.split(".")[0] not in acked for name in orphans)
    assert len(rows) < 9


def test_a_batch_commits_once_and_refuses_what_its_round_no_longer_takes(tmp_path):
    from wakefl.server.admission import OpenRound
    from wakefl.server.server_config import ServerConfig
    from wakefl.server.server_session import ServerSession
    from wakefl.server.update_batches import BatchRecorder

    cfg = ServerConfig(
        broker_url="mqtt://127.0.0.1:1", state_dir=tmp_path / "s", initial_params=torch.zeros(D)
    )
    session = ServerSession(cfg, progress=lambda line: None)
    session.open_round = OpenRound.of(2, ["a", "b", "c"], 1e12)
    recorder = BatchRecorder(session, max_batch=16)
    results: dict[str, str] = {}
    tx0 = session.store.transactions

    def up(dev: str, rid: int = 2) -> tuple[M.Uplink, bytes]:
        u = M.Uplink("f", "r", dev, "t", rid, torch.ones(D), 1, {"sigma_sq": 0.1})
        return u, M.encode(u)

    with session.commit_lock:  # all four queue up before the first commit
        for key, (dev, rid) in {
            "a": ("a", 2),
            "b": ("b", 2),
            "a again": ("a", 2),
            "old": ("c", 1),
        }.items():
            recorder(*up(dev, rid), lambda r, key=key: results.__setitem__(key, r))
    assert recorder.flush(30)
    recorder.close()
    assert results == {"a": "", "b": "", "a again": "duplicate", "old": "stale_round"}
    assert session.store.transactions - tx0 <= 2  # not one commit per update
    assert session.store.count_updates(2) == 2
    session.store.close()
