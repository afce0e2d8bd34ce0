"""The device's persistent state: round trip, refusal of foreign or corrupt state, and a
crash at every step of a save (a forked child dies with os._exit, as in a power cut:
no cleanup code runs) leaves the previous or the new state, complete."""

from __future__ import annotations

import json
import os

import pytest
import torch

from wakefl.errors import ConfigError, NonFiniteError
from wakefl.sdk.device_state import (
    DeviceState,
    DeviceStateStore,
    PendingUpdate,
    load_or_create,
)
from wakefl.sdk.selffl.strategy import ClientState


def _state(seed: int, d: int = 1000) -> DeviceState:
    g = torch.Generator().manual_seed(seed)
    return DeviceState(
        device_id="dev-1",
        device_type="A",
        fleet="default",
        client=ClientState(
            tensors={
                "personal": torch.randn(d, generator=g),
                "var_mean": torch.randn(d, generator=g),
            },
            scalars={"var_value": float(seed) + 0.5, "t_m": float(seed)},
        ),
        personal_params=torch.randn(d, generator=g),
        baseline_params=torch.randn(d, generator=g),
        baseline_round=1,
        model_config={"width": 0.25},
        participations=seed,
        last_round=seed + 1,
        last_acked_round=seed,
        run_id="run-x",
        pending=PendingUpdate(
            round_id=seed + 1,
            num_samples=12,
            scalars={"sigma_m_sq": 0.1 * seed},
            tensors={"extra": torch.randn(3, generator=g)},
            report={"relative_fa": 0.9},
        ),
    )


def _assert_same(a: DeviceState, b: DeviceState) -> None:
    assert a.device_id == b.device_id and a.device_type == b.device_type and a.fleet == b.fleet
    assert a.client.scalars == b.client.scalars
    assert a.client.tensors.keys() == b.client.tensors.keys()
    for k in a.client.tensors:
        assert torch.equal(a.client.tensors[k], b.client.tensors[k])
    assert torch.equal(a.personal_params, b.personal_params)
    assert torch.equal(a.baseline_params, b.baseline_params)
    assert (a.participations, a.last_round, a.last_acked_round, a.run_id) == (
        b.participations,
        b.last_round,
        b.last_acked_round,
        b.run_id,
    )
    assert a.model_config == b.model_config
    assert (a.pending is None) == (b.pending is None)
    if a.pending is not None:
        assert a.pending.round_id == b.pending.round_id
        assert a.pending.scalars == b.pending.scalars
        assert a.pending.report == b.pending.report
        assert torch.equal(a.pending.tensors["extra"], b.pending.tensors["extra"])


def test_round_trip_and_scalar_only_save(tmp_path):
    store = DeviceStateStore(tmp_path)
    s = _state(3)
    store.save(s)
    _assert_same(DeviceStateStore(tmp_path).load(), s)

    s.last_acked_round = 99
    s.pending = None
    store.save(s, tensors_changed=False)
    loaded = DeviceStateStore(tmp_path).load()
    assert loaded.last_acked_round == 99 and loaded.pending is None
    assert torch.equal(loaded.personal_params, s.personal_params)
    # Only one tensor generation is kept.
    assert len(list(tmp_path.glob("tensors-*.safetensors"))) == 1


def test_refuses_non_finite_and_keeps_previous(tmp_path):
    store = DeviceStateStore(tmp_path)
    good = _state(1)
    store.save(good)
    bad = _state(2)
    bad.personal_params[5] = float("nan")
    with pytest.raises(NonFiniteError):
        store.save(bad)
    bad = _state(2)
    bad.client.scalars["var_value"] = float("inf")
    with pytest.raises(NonFiniteError):
        store.save(bad)
    _assert_same(DeviceStateStore(tmp_path).load(), good)


def test_corrupt_tensor_file_is_detected(tmp_path):
    store = DeviceStateStore(tmp_path)
    store.save(_state(1))
    (tfile,) = tmp_path.glob("tensors-*.safetensors")
    data = bytearray(tfile.read_bytes())
    data[-10] ^= 0xFF
    tfile.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="corrupt"):
        DeviceStateStore(tmp_path).load()


def test_foreign_state_folder_is_refused(tmp_path):
    DeviceStateStore(tmp_path).save(_state(1))
    with pytest.raises(ConfigError, match="device id"):
        load_or_create(tmp_path, "dev-2", "A")
    with pytest.raises(ConfigError, match="device type"):
        load_or_create(tmp_path, "dev-1", "B")
    _, s = load_or_create(tmp_path, "dev-1", "A")
    assert s.participations == 1
    _, fresh = load_or_create(tmp_path / "new", "dev-9", "C")
    assert fresh.personal_params is None and fresh.participations == 0


def _crash_during_save(tmp_path, op: str, nth: int, after: bool) -> bool:
    """Fork a child that saves state 2 over state 1 and dies at the `nth` call of os.`op`
    (before or after it takes effect). Returns whether the crash point was reached."""
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            real = getattr(os, op)
            calls = {"n": 0}

            def dying(*a, **kw):
                calls["n"] += 1
                if calls["n"] == nth:
                    if after:
                        real(*a, **kw)
                    os._exit(17)
                return real(*a, **kw)

            setattr(os, op, dying)
            DeviceStateStore(tmp_path).save(_state(2))
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 17), f"child failed with exit code {code}"
    return code == 17


@pytest.mark.parametrize("op", ["fsync", "replace"])
@pytest.mark.parametrize("after", [False, True])
def test_crash_at_every_step_leaves_old_or_new_state(tmp_path, op, after):
    old, new = _state(1), _state(2)
    seen_new = False
    nth = 1
    while True:
        d = tmp_path / f"{op}-{after}-{nth}"
        DeviceStateStore(d).save(old)
        crashed = _crash_during_save(d, op, nth, after)
        loaded = DeviceStateStore(d).load(cleanup=True)
        if loaded.participations == old.participations:
            _assert_same(loaded, old)
        else:
            _assert_same(loaded, new)
            seen_new = True
        # Leftovers of the interrupted save are gone after the load.
        assert not list(d.glob(".*.tmp-*"))
        assert len(list(d.glob("tensors-*.safetensors"))) == 1
        if not crashed:
            break
        nth += 1
    assert nth > 2, "the save should have passed through several crash points"
    assert seen_new


def test_torn_state_json_write_keeps_previous(tmp_path):
    """A temp file that was half written when the power went is ignored."""
    store = DeviceStateStore(tmp_path)
    store.save(_state(1))
    (tmp_path / ".state.json.tmp-12345").write_text('{"format": 1, "gener')
    (tmp_path / ".tensors-2.safetensors.tmp-12345").write_bytes(b"\x00" * 100)
    (tmp_path / "tensors-2.safetensors").write_bytes(b"\x00" * 100)
    snapshot = sorted(p.name for p in tmp_path.iterdir())
    _assert_same(DeviceStateStore(tmp_path).load(), _state(1))
    # A plain reader deletes nothing (a writer may be producing those files right now).
    assert sorted(p.name for p in tmp_path.iterdir()) == snapshot
    loaded = DeviceStateStore(tmp_path).load(cleanup=True)
    _assert_same(loaded, _state(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "tensors-1.safetensors"]
    assert json.loads((tmp_path / "state.json").read_text())["generation"] == 1


def test_shared_tensors_are_stored_once_and_restored(tmp_path):
    """The personal model is both the served model and the strategy's `personal` tensor
    (and the pending update's params): one copy on disk, all three restored."""
    s = _state(4, d=50_000)
    s.personal_params = s.client.tensors["personal"]
    s.pending.tensors = {"params": s.personal_params}
    store = DeviceStateStore(tmp_path)
    store.save(s)
    (tfile,) = tmp_path.glob("tensors-*.safetensors")
    # personal + var_mean + baseline, 50k float32 each; the aliases add nothing.
    assert tfile.stat().st_size < 3 * 50_000 * 4 + 4096
    loaded = DeviceStateStore(tmp_path).load()
    assert torch.equal(loaded.personal_params, s.personal_params)
    assert torch.equal(loaded.client.tensors["personal"], s.personal_params)
    assert torch.equal(loaded.pending.tensors["params"], s.personal_params)


def test_served_model_round_trip_stored_once_when_shared(tmp_path):
    st = _state(3)
    st.served_params, st.served_name, st.served_round = st.personal_params, "personalized", 4
    store = DeviceStateStore(tmp_path)
    store.save(st)
    back = DeviceStateStore(tmp_path).load()
    assert (back.served_name, back.served_round) == ("personalized", 4)
    assert torch.equal(back.served_params, st.personal_params)
    meta = json.loads((tmp_path / "state.json").read_text())
    assert meta["format"] == 2 and meta["served"] == {"name": "personalized", "round": 4}
    assert "served" in meta["tensor_aliases"]  # the same tensor as the personal model
    fresh = _state(4)
    store.save(fresh)  # nothing served yet
    back = DeviceStateStore(tmp_path).load()
    assert back.served_name == "" and back.served_params is None


def test_format_1_state_migrates_to_serving_the_baseline(tmp_path):
    """A folder written before the served-model gate: its personal model was never checked,
    so the device serves its baseline; the next save writes format 2."""
    st = _state(2)
    store = DeviceStateStore(tmp_path)
    store.save(st)
    meta = json.loads((tmp_path / "state.json").read_text())
    meta["format"] = 1
    del meta["served"]
    (tmp_path / "state.json").write_text(json.dumps(meta))
    store, back = load_or_create(tmp_path, "dev-1", "A")
    assert (back.served_name, back.served_round) == ("baseline", st.baseline_round)
    assert torch.equal(back.served_params, st.baseline_params)
    store.save(back)
    again = DeviceStateStore(tmp_path).load()
    assert json.loads((tmp_path / "state.json").read_text())["format"] == 2
    assert again.served_name == "baseline" and torch.equal(again.served_params, st.baseline_params)


@pytest.mark.parametrize(
    "change",
    [
        {"format": 3},
        {"served": {"name": "mystery", "round": 1}},
        {"served": {"name": "global", "round": 1}},  # no served tensor in the file
    ],
)
def test_unknown_format_or_served_model_is_refused(tmp_path, change):
    DeviceStateStore(tmp_path).save(_state(1))
    meta = json.loads((tmp_path / "state.json").read_text())
    meta.update(change)
    (tmp_path / "state.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="format 3 .*reads formats 1, 2|served model"):
        DeviceStateStore(tmp_path).load()
