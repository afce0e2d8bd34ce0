"""Pruned rounds' update files written over by new updates (server/spare_files.py): the
new update's file holds exactly its bytes whatever was there before, the pool is bounded,
outlives a restart, and a file in it never counts as an update."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from wakefl.protocol import messages as M
from wakefl.server.recorded_updates import read_recorded_update
from wakefl.server.spare_files import SpareFiles
from wakefl.server.state_store import StateStore

D = 1000


def _uplink(dev: str, rid: int, value: float, n: int = D) -> tuple[M.Uplink, bytes]:
    up = M.Uplink("f", "r", dev, "t", rid, torch.full((n,), value), 1, {"sigma_sq": 0.1})
    return up, M.encode(up)


def _record(store: StateStore, ups: list[tuple[M.Uplink, bytes]]) -> None:
    written = [(msg, store.write_update_file(msg, p), len(p)) for msg, p in ups]
    store.sync_update_dirs(msg.round_id for msg, _ in ups)
    assert store.record_written(written, ups[0][0].round_id) == [""] * len(ups)


def test_a_pruned_rounds_files_are_written_over_by_the_next_updates(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "s")
    try:
        # round 1: big updates; pruned, their files go to the pool
        _record(store, [_uplink(f"d{i}", 1, float(i), n=3 * D) for i in range(3)])
        store.prune_update_files(2)
        assert len(store.spares) == 3 and not (tmp_path / "s/updates/r000001").exists()
        # round 2: smaller updates land in those files, cut to their own length
        ups = [_uplink(f"d{i}", 2, 10.0 + i) for i in range(4)]
        _record(store, ups)
        assert len(store.spares) == 0  # three reused, the fourth a new file
        rows = {r["device_id"]: r for r in store.update_rows(2)}
        for msg, payload in ups:
            path = store.root / rows[msg.device_id]["path"]
            assert path.read_bytes() == payload
            got = read_recorded_update(path, D)
            assert torch.equal(got.params, msg.params) and got.device_id == msg.device_id
    finally:
        store.close()


def test_the_pool_is_bounded_and_outlives_a_restart(tmp_path: Path) -> None:
    folder = tmp_path / "spare"
    pool = SpareFiles(folder, limit=2)
    files = []
    for i in range(3):
        f = tmp_path / f"u{i}.wkfl"
        f.write_bytes(b"x" * 100)
        files.append(f)
    assert [pool.keep(f) for f in files] == [True, True, False]
    assert files[2].exists() and not files[0].exists()  # the caller deletes what is refused
    assert len(SpareFiles(folder, limit=2)) == 2  # found again by a restarted store
    assert len(SpareFiles(folder, limit=1)) == 1 and len(os.listdir(folder)) == 1
    again = SpareFiles(folder, limit=1)
    (tmp_path / "r").mkdir()
    fd = again.reuse(tmp_path / "r" / "new.wkfl")
    assert fd is not None
    os.close(fd)
    assert again.reuse(tmp_path / "r" / "other.wkfl") is None and not os.listdir(folder)


def test_reuse_into_a_missing_folder_keeps_the_spare(tmp_path: Path) -> None:
    pool = SpareFiles(tmp_path / "spare")
    f = tmp_path / "u.wkfl"
    f.write_bytes(b"x")
    assert pool.keep(f)
    with pytest.raises(FileNotFoundError):
        pool.reuse(tmp_path / "no-such-folder" / "new.wkfl")
    assert len(pool) == 1


def test_a_spare_file_is_never_read_as_an_update(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "s")
    try:
        _record(store, [_uplink("d0", 1, 1.0)])
        store.prune_update_files(2)
        assert len(store.spares) == 1
        # the round is pruned: its row stays as the record, no update is read from the pool
        assert store.count_updates(1) == 1
        assert store.update_rows(3) == []
    finally:
        store.close()
    # a store opened again over the same folder reuses it
    again = StateStore(tmp_path / "s")
    try:
        assert len(again.spares) == 1
        _record(again, [_uplink("d0", 3, 3.0)])
        assert len(again.spares) == 0
    finally:
        again.close()


def test_a_store_without_spares_deletes_what_it_prunes(tmp_path: Path) -> None:
    # (the sharded coordinator's: its workers write every update file anew)
    store = StateStore(tmp_path / "s", spare_files=0)
    try:
        _record(store, [_uplink(f"d{i}", 1, float(i)) for i in range(2)])
        store.prune_update_files(2)
        assert len(store.spares) == 0 and not os.listdir(tmp_path / "s/updates/spare")
        assert not (tmp_path / "s/updates/r000001").exists()
    finally:
        store.close()
