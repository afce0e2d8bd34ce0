"""The aggregation server against a real mosquitto, with lightweight simulated devices
written here on top of paho directly (small vectors, no training)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import paho.mqtt.client as paho
import pytest
import torch
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from safetensors.torch import save_file

from wakefl.protocol import frames, topics
from wakefl.protocol import messages as M
from wakefl.sdk.selffl.registry import make_strategy
from wakefl.sdk.selffl.strategy import ClientResult
from wakefl.server.aggregation_server import AggregationServer, ServerConfig
from wakefl.server.state_store import StateStore

FLEET = "t"
D = 48


class SimDevice:
    """A device that answers each round it is sampled for with a deterministic update,
    waits for the ack and re-sends on timeout. While `hold` is clear it does not answer
    rounds >= `hold_from`."""

    def __init__(self, url: str, dev: str, typ: str, *, answer: bool = True, resend_s: float = 2.0):
        self.dev, self.typ, self.answer, self.resend_s = dev, typ, answer, resend_s
        self.hold = threading.Event()
        self.hold.set()
        self.hold_from = 1
        self.sent: dict[int, M.Uplink] = {}  # round -> the update it sent
        self.acked: dict[int, M.Ack] = {}
        self.final: M.Downlink | None = None
        self._lock = threading.Lock()
        self._todo: M.Downlink | None = None
        host, port = url.removeprefix("mqtt://").split(":")
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=dev, protocol=paho.MQTTv5)
        c.will_set(
            topics.hello(FLEET, dev),
            M.encode(M.Hello(FLEET, dev, typ, 10, online=False)),
            qos=1,
            retain=True,
        )
        c.on_connect = self._on_connect
        c.on_message = self._on_message
        c.reconnect_delay_set(0.2, 1)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        c.connect(host, int(port), keepalive=60, clean_start=False, properties=props)
        self.client = c
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._work, daemon=True)
        c.loop_start()
        self._worker.start()

    def _on_connect(self, client, userdata, flags, rc, props):
        client.subscribe([(topics.downlink(FLEET), 1), (topics.ack(FLEET, self.dev), 1)])
        client.publish(
            topics.hello(FLEET, self.dev),
            M.encode(M.Hello(FLEET, self.dev, self.typ, 10)),
            qos=1,
            retain=True,
        )

    def _on_message(self, client, userdata, msg):
        m = M.decode(msg.payload)
        with self._lock:
            if isinstance(m, M.Ack) and m.accepted:
                self.acked[m.round_id] = m
            elif isinstance(m, M.Downlink):
                if m.final:
                    self.final = m
                elif self.dev in m.instructions and m.round_id not in self.acked:
                    self._todo = m

    def update_for(self, down: M.Downlink) -> M.Uplink:
        seed = zlib.crc32(f"{self.dev}:{down.round_id}".encode())
        g = torch.Generator().manual_seed(seed)
        idx = zlib.crc32(self.dev.encode()) % 5
        params = down.global_params + 0.3 * (idx - 2) + 0.05 * torch.randn(D, generator=g)
        sigma = 0.1 + 0.05 * idx
        return M.Uplink(
            FLEET,
            down.run_id,
            self.dev,
            self.typ,
            down.round_id,
            params,
            num_samples=10 + idx,
            record={"has_variance": 1.0, "sigma_sq": sigma, "local_steps": 5 + idx},
        )

    def _work(self):
        last_sent = 0.0
        while not self._stop.is_set():
            time.sleep(0.02)
            if not self.answer:
                continue
            with self._lock:
                down = self._todo
                if down is None or down.round_id in self.acked:
                    continue
                if down.round_id >= self.hold_from and not self.hold.is_set():
                    continue
                up = self.sent.get(down.round_id)
            if up is None:
                up = self.sent[down.round_id] = self.update_for(down)
            elif time.monotonic() - last_sent < self.resend_s:
                continue
            self.client.publish(topics.uplink(FLEET, self.dev), M.encode(up), qos=1)
            last_sent = time.monotonic()

    def close(self):
        _close_all([self])


def _close_all(devices: list[SimDevice]) -> None:
    # Disconnect every client first: paho's loop thread then ends at once instead of
    # sleeping out its select timeout in loop_stop.
    for d in devices:
        d._stop.set()
    for d in devices:
        d._worker.join()
        d.client.disconnect()
    for d in devices:
        d.client.loop_stop()


def _wait(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _server(broker, tmp_path, devices: dict[str, str], **kw) -> AggregationServer:
    strategy_args = kw.pop("strategy_args", {})
    cfg = ServerConfig(
        broker_url=broker.url,
        state_dir=tmp_path / "server",
        initial_params=torch.zeros(D),
        fleet=FLEET,
        devices=devices,
        strategy_args=strategy_args,
        **kw,
    )
    return AggregationServer(cfg, make_strategy("selffl", **strategy_args), progress=lambda s: None)


def _start(server: AggregationServer) -> threading.Thread:
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    return t


def _expected(
    devices: list[SimDevice],
    rounds: int,
    registry_size: int,
    cluster: bool,
    order: dict[int, list[str]],
) -> torch.Tensor:
    """The in-process strategy on the very updates the devices sent, in the server's order."""
    strat = make_strategy("selffl", cluster_by_group=cluster)
    state = strat.init_server(torch.zeros(D))
    by_id = {d.dev: d for d in devices}
    for r in range(1, rounds + 1):
        results = []
        for dev in order[r]:
            up = by_id[dev].sent[r]
            results.append(
                ClientResult(dev, r, up.params, up.num_samples, dict(up.record), {}, up.device_type)
            )
        state = strat.aggregate(state, results, len(results) / registry_size)
    return state.global_params


def _round_orders(state_dir: Path, rounds: int) -> dict[int, list[str]]:
    store = StateStore(state_dir)
    try:
        return {r: [row["device_id"] for row in store.update_rows(r)] for r in range(1, rounds + 1)}
    finally:
        store.close()


@pytest.mark.parametrize("cluster", [False, True])
def test_aggregate_equals_in_process_strategy(mqtt_broker, tmp_path, cluster):
    reg = {"a": "speaker", "b": "speaker", "c": "tv"}
    devs = [SimDevice(mqtt_broker.url, d, t) for d, t in reg.items()]
    srv = _server(
        mqtt_broker,
        tmp_path,
        reg,
        rounds=3,
        round_timeout=20,
        strategy_args={"cluster_by_group": True} if cluster else {},
    )
    try:
        final = srv.run()
        _wait(lambda: all(d.final is not None for d in devs), 10, "the end announcement")
    finally:
        _close_all(devs)
    assert final.round_id == 3
    assert [r.closed_by for r in srv.reports] == ["all"] * 3
    want = _expected(devs, 3, len(reg), cluster, _round_orders(tmp_path / "server", 3))
    torch.testing.assert_close(final.global_params, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(devs[0].final.global_params, want, rtol=0, atol=1e-6)
    assert not srv.rejections


def test_every_rejection_kind_counted_while_round_completes(mqtt_broker, tmp_path):
    reg = {"a": "speaker", "b": "tv", "evil": "speaker"}
    a, b = SimDevice(mqtt_broker.url, "a", "speaker"), SimDevice(mqtt_broker.url, "b", "tv")
    a.hold.clear()
    b.hold.clear()
    srv = _server(
        mqtt_broker, tmp_path, reg, rounds=1, round_timeout=30, min_clients=2, max_bytes=64 * 1024
    )
    thread = _start(srv)
    evil = _Raw(mqtt_broker.url, "evil")
    try:
        _wait(lambda: a._todo is not None, 15, "round 1 downlink")
        down = a._todo
        good = a.update_for(down)

        def up(dev="evil", typ="speaker", **kw):
            fields = dict(
                fleet=FLEET,
                run_id=down.run_id,
                device_id=dev,
                device_type=typ,
                round_id=1,
                params=torch.ones(D),
                num_samples=1,
                record={"sigma_sq": 0.1, "has_variance": 1.0, "local_steps": 1},
            )
            fields.update(kw)
            return M.Uplink(**fields)

        corrupted = bytearray(M.encode(up()))
        corrupted[-3] ^= 1
        body = bytearray(M.encode(up())[36:])  # a valid frame, its last entry set to NaN
        body[-4:] = torch.tensor([float("nan")]).numpy().tobytes()
        nan = frames.seal(bytes(body))
        hostile = {
            "malformed": (topics.uplink(FLEET, "evil"), b"garbage" * 10),
            "bad_hash": (topics.uplink(FLEET, "evil"), bytes(corrupted)),
            "oversized": (topics.uplink(FLEET, "evil"), M.encode(up(params=torch.ones(20000)))),
            "version": (topics.uplink(FLEET, "evil"), M.encode(up(version=9))),
            "pickle": (topics.uplink(FLEET, "evil"), pickle.dumps([1, 2])),
            "shape": (topics.uplink(FLEET, "evil"), M.encode(up(params=torch.ones(D + 1)))),
            "non_finite": (topics.uplink(FLEET, "evil"), nan),
            "topic_mismatch": (topics.uplink(FLEET, "evil"), M.encode(up(dev="a"))),
            "unknown_device": (topics.uplink(FLEET, "ghost"), M.encode(up(dev="ghost"))),
            "wrong_device_type": (topics.uplink(FLEET, "evil"), M.encode(up(typ="tv"))),
            "stale_round": (topics.uplink(FLEET, "evil"), M.encode(up(round_id=7))),
            "not_sampled": (topics.uplink(FLEET, "evil"), M.encode(up())),
            "wrong_kind": (topics.uplink(FLEET, "evil"), M.encode(M.Ack(FLEET, "evil", 1, True))),
        }
        for topic, payload in hostile.values():
            evil.send(topic, payload)
        # the QoS 1 duplicate: a's valid update arrives twice
        payload = M.encode(good)
        a.sent[1] = good
        for _ in range(2):
            evil.send(topics.uplink(FLEET, "a"), payload)
        _wait(lambda: sum(srv.rejections.values()) >= len(hostile) + 1, 15, "rejections counted")
        b.hold.set()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        evil.close()
        a.close()
        b.close()
    for reason in hostile:
        assert srv.rejections[reason] == 1, (reason, dict(srv.rejections))
    assert srv.rejections["duplicate"] == 1
    rep = srv.reports[0]
    assert sorted(rep.reported) == ["a", "b"] and rep.closed_by == "all"
    want = _expected([a, b], 1, len(reg), False, _round_orders(tmp_path / "server", 1))
    store = StateStore(tmp_path / "server")
    torch.testing.assert_close(store.load_server_state().global_params, want, rtol=0, atol=1e-6)
    assert store.rejection_counts()["shape"] == 1


def test_silent_device_round_closes_at_deadline(mqtt_broker, tmp_path):
    reg = {"a": "speaker", "b": "tv", "mute": "tv"}
    devs = [SimDevice(mqtt_broker.url, d, t, answer=(d != "mute")) for d, t in reg.items()]
    srv = _server(mqtt_broker, tmp_path, reg, rounds=2, round_timeout=1.5)
    try:
        t0 = time.monotonic()
        final = srv.run()
        wall = time.monotonic() - t0
    finally:
        _close_all(devs)
    assert final.round_id == 2
    assert [r.closed_by for r in srv.reports] == ["deadline", "deadline"]
    assert all(sorted(r.reported) == ["a", "b"] for r in srv.reports)
    assert 3.0 <= wall < 10.0


def _cli_server(broker_url: str, state: Path, init: Path, rounds: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wakefl.tools.cli",
            "server",
            "--broker",
            broker_url,
            "--state",
            str(state),
            "--fleet",
            FLEET,
            "--devices",
            "a:speaker,b:speaker,c:tv",
            "--rounds",
            str(rounds),
            "--round-timeout",
            "60",
            "--init-model",
            str(init),
            "--ack-timeout",
            "2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _collect_lines(proc: subprocess.Popen) -> list[str]:
    """The process's output lines, appended as they come by a reader thread."""
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


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
        _wait(lambda: all(1 in d.acked for d in devs), 30, "round 1")
        _wait(lambda: all(2 in d.acked for d in devs[:2]), 30, "a and b acked in round 2")
        acked_before = {(d.dev, r) for d in devs for r in d.acked}
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = _cli_server(mqtt_broker.url, state, init, rounds=3)
        lines = _collect_lines(proc)
        # c's held update goes out only once the restarted server has read its state, so the
        # resume line counts what was on record before the kill, not a race with c.
        _wait(lambda: any("resumed with" in line for line in lines), 30, "the resume line")
        c.hold.set()
        proc.wait(60)
        out = "".join(lines)
        assert proc.returncode == 0, out
        assert "resumed with 2/3 updates on record" in out
        _wait(lambda: all(d.final is not None for d in devs), 10, "the end announcement")
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
    want = _expected(devs, 3, 3, False, _round_orders(state, 3))
    torch.testing.assert_close(store.load_server_state().global_params, want, rtol=0, atol=1e-6)


def test_broker_restart_run_completes(mqtt_broker, tmp_path):
    reg = {"a": "speaker", "b": "tv"}
    devs = [SimDevice(mqtt_broker.url, d, t) for d, t in reg.items()]
    devs[1].hold_from = 2
    devs[1].hold.clear()
    srv = _server(mqtt_broker, tmp_path, reg, rounds=3, round_timeout=60)
    thread = _start(srv)
    try:
        _wait(lambda: 2 in devs[0].acked, 30, "a's round 2 ack")
        mqtt_broker.restart(kill=True)
        devs[1].hold.set()
        thread.join(60)
        assert not thread.is_alive()
    finally:
        _close_all(devs)
    assert [r.round_id for r in srv.reports] == [1, 2, 3]
    assert all(sorted(r.reported) == ["a", "b"] for r in srv.reports)
    assert srv.link.connects >= 2


def test_hundred_devices_every_update_accounted_for(mqtt_broker, tmp_path):
    reg = {f"d{i:03d}": f"type{i % 5}" for i in range(100)}
    devs = [SimDevice(mqtt_broker.url, d, t, resend_s=5) for d, t in reg.items()]
    srv = _server(mqtt_broker, tmp_path, reg, rounds=2, round_timeout=60)
    try:
        final = srv.run()
    finally:
        _close_all(devs)
    assert final.round_id == 2
    for rep in srv.reports:
        assert len(rep.reported) == 100 and rep.closed_by == "all"
    assert all(set(d.acked) == {1, 2} for d in devs)
    dup = srv.rejections.get("duplicate", 0)
    assert sum(srv.rejections.values()) == dup  # only re-sends, nothing else refused


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


# --- hostile and broken devices (issue: a fleet that survives them) -----------------------


class _Raw:
    """A bare MQTT client that publishes whatever bytes it is given (anonymous broker)."""

    def __init__(self, url: str, client_id: str) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.acks: list[M.Ack] = []
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
        self.c.on_message = lambda c, u, m: self.acks.append(M.decode(m.payload))
        self.c.connect(host, int(port))
        self.c.loop_start()

    def listen_acks(self, dev: str) -> None:
        self.c.subscribe(topics.ack(FLEET, dev), qos=1)
        time.sleep(0.3)

    def send(self, topic: str, payload: bytes) -> None:
        self.c.publish(topic, payload, qos=1).wait_for_publish(5)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def _raw_uplink(down: M.Downlink, dev: str, typ: str, text_fields: str) -> bytes:
    """An uplink frame whose JSON metadata is written by hand (`text_fields` appended)."""
    import json

    from safetensors.torch import save as st_save

    meta = (
        json.dumps(
            {
                "v": M.PROTOCOL_VERSION,
                "kind": "up",
                "fleet": FLEET,
                "run_id": down.run_id,
                "device_id": dev,
                "device_type": typ,
                "round_id": down.round_id,
                "record": {"sigma_sq": 0.1, "has_variance": 1, "local_steps": 1},
            }
        )[:-1]
        + ","
        + text_fields
        + "}"
    )
    body = st_save({"params": torch.zeros(D)}, metadata={"wakefl": meta})
    return frames.seal(body)


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


def test_crafted_uplinks_are_counted_acked_and_never_crash(mqtt_broker, tmp_path, caplog):
    reg = {"a": "speaker", "b": "tv", "evil": "speaker"}
    a, b = SimDevice(mqtt_broker.url, "a", "speaker"), SimDevice(mqtt_broker.url, "b", "tv")
    a.hold.clear()
    srv = _server(mqtt_broker, tmp_path, reg, rounds=1, round_timeout=30, min_clients=2)
    thread = _start(srv)
    evil = _Raw(mqtt_broker.url, "evil")
    evil.listen_acks("evil")
    try:
        _wait(lambda: a._todo is not None, 15, "round 1 downlink")
        down = a._todo
        up_evil = topics.uplink(FLEET, "evil")
        crafted = {
            "nested": _raw_uplink(
                down, "evil", "speaker", '"num_samples":1,"scalars":' + "[" * 100000 + "]" * 100000
            ),
            "digits": _raw_uplink(down, "evil", "speaker", '"num_samples":' + "9" * 5000),
            "int_1e309": _raw_uplink(
                down, "evil", "speaker", '"num_samples":1,"relative_fa":1' + "0" * 309
            ),
            "num_samples_2_63": _raw_uplink(down, "evil", "speaker", f'"num_samples":{2**63}'),
        }
        for payload in crafted.values():
            evil.send(up_evil, payload)
        evil.send(f"wakefl/{FLEET}/up/", b"no device id")
        evil.send(f"wakefl/{FLEET}/hello/", b"no device id")
        _wait(lambda: sum(srv.rejections.values()) >= 6, 20, "every crafted message counted")
        _wait(lambda: len(evil.acks) >= 4, 10, "refusal acks to evil")
        a.hold.set()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        evil.close()
        _close_all([a, b])
    assert srv.rejections["out_of_range"] == 2 and srv.rejections["malformed"] == 4
    assert "internal" not in srv.rejections
    assert sorted(srv.reports[0].reported) == ["a", "b"]  # honest updates still recorded
    # each refusal ack names the message it answers, so only its sender acts on it
    assert sorted(x.answers for x in evil.acks) == sorted(M.message_id(p) for p in crafted.values())
    assert not [r for r in caplog.records if r.exc_info], "a handler raised"


def test_retained_hellos_from_before_the_server_started_are_refused_but_not_counted(
    mqtt_broker, tmp_path, caplog
):
    """An earlier run's retained Hellos reach the server when it subscribes: refused, logged,
    but not counted as this run's rejections; the same Hellos sent live are counted."""
    reg = {"a": "speaker", "b": "tv", "c": "speaker"}
    old = _Raw(mqtt_broker.url, "ghost")
    old.listen_acks("ghost")

    def hello(dev: str, typ: str, online: bool) -> None:
        payload = M.encode(M.Hello(FLEET, dev, typ, 10, online=online))
        old.c.publish(topics.hello(FLEET, dev), payload, qos=1, retain=True).wait_for_publish(5)

    hello("gone", "speaker", False)  # a device no longer in the fleet, offline
    hello("c", "tv", False)  # a device of the fleet that then ran as another type
    hello("ghost", "speaker", True)  # still connected: it is told it is refused
    a, b = SimDevice(mqtt_broker.url, "a", "speaker"), SimDevice(mqtt_broker.url, "b", "tv")
    a.hold.clear()
    srv = _server(mqtt_broker, tmp_path, reg, rounds=1, round_timeout=30, min_clients=2)
    thread = _start(srv)
    try:
        _wait(lambda: a._todo is not None, 15, "round 1 downlink")
        _wait(lambda: len(old.acks) >= 1, 10, "the refusal of ghost's retained hello")
        assert srv.rejections["unknown_device"] == 0 and srv.rejections["wrong_device_type"] == 0
        hello("gone", "speaker", True)  # published retained, delivered live: counted
        hello("c", "tv", True)
        _wait(lambda: sum(srv.rejections.values()) >= 2, 15, "the live hellos' refusals")
        a.hold.set()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        old.close()
        _close_all([a, b])
    assert srv.rejections["unknown_device"] == 1 and srv.rejections["wrong_device_type"] == 1
    assert sum(srv.rejections.values()) == 2, dict(srv.rejections)
    store = StateStore(tmp_path / "server")
    try:
        assert store.rejection_counts() == {"unknown_device": 1, "wrong_device_type": 1}
    finally:
        store.close()
    assert [(x.answers, x.accepted, x.reason.split(":")[0]) for x in old.acks] == [
        ("hello", False, "unknown_device")
    ]
    stale = [r.getMessage() for r in caplog.records if "retained hello from" in r.getMessage()]
    assert sorted(m.split()[3] for m in stale) == ["c", "ghost", "gone"], stale
    assert srv.reports[0].closed_by == "all"


def test_updates_queued_while_server_was_down_are_accepted_after_restart(mqtt_broker, tmp_path):
    reg = {"a": "speaker", "b": "speaker", "c": "tv"}
    # resend_s=300: b's single send is the one queued in the server's broker session
    devs = [SimDevice(mqtt_broker.url, d, t, resend_s=300) for d, t in reg.items()]
    b = devs[1]
    b.hold.clear()
    srv = _server(mqtt_broker, tmp_path, reg, rounds=1, round_timeout=60)
    thread = _start(srv)
    try:
        _wait(lambda: all(1 in d.acked for d in (devs[0], devs[2])), 20, "a and c acked")
        srv.stop_event.set()
        thread.join(20)
        assert not thread.is_alive()
        b.hold.set()  # published while no server is connected: queued by the broker
        _wait(lambda: 1 in b.sent, 5, "b's update sent")
        time.sleep(0.5)
        srv2 = _server(mqtt_broker, tmp_path, reg, rounds=1, round_timeout=60)
        t0 = time.monotonic()
        srv2.run()
        wall = time.monotonic() - t0
    finally:
        _close_all(devs)
    assert "stale_round" not in srv2.rejections, dict(srv2.rejections)
    assert srv2.reports[0].closed_by == "all" and sorted(srv2.reports[0].reported) == [
        "a",
        "b",
        "c",
    ]
    assert 1 in b.acked and wall < 30


class _HostileDevice(SimDevice):
    """Answers each round with an update `scale` times its honest step (or entries of
    `fill`) and claims zero variance."""

    def __init__(self, *a, scale: float = 1.0, fill: float | None = None, **kw):
        self.scale, self.fill = scale, fill
        super().__init__(*a, **kw)

    def update_for(self, down: M.Downlink) -> M.Uplink:
        honest = super().update_for(down)
        if self.fill is not None:
            params = torch.full((D,), self.fill) * torch.tensor([1.0, -1.0]).repeat(D // 2)
        else:
            params = down.global_params + self.scale * (honest.params - down.global_params)
        return M.Uplink(
            FLEET,
            down.run_id,
            self.dev,
            self.typ,
            down.round_id,
            params,
            num_samples=honest.num_samples,
            record={**honest.record, "has_variance": 1.0, "sigma_sq": 0.0},
        )


@pytest.mark.parametrize("attack", [{"fill": 3e38}, {"scale": 1e6}])
def test_one_hostile_update_cannot_move_the_global_model(mqtt_broker, tmp_path, attack):
    honest = {"a": "speaker", "b": "speaker", "c": "tv"}
    reg = {**honest, "evil": "tv"}
    devs = [SimDevice(mqtt_broker.url, d, t) for d, t in honest.items()]
    evil = _HostileDevice(mqtt_broker.url, "evil", "tv", **attack)
    srv = _server(mqtt_broker, tmp_path, reg, rounds=2, round_timeout=20)
    try:
        final = srv.run()
    finally:
        _close_all([*devs, evil])
    assert all(r.screened.get("evil", "").startswith("refuse") for r in srv.reports)
    assert srv.rejections["outlier"] == 2
    # the run as if evil had sent nothing (same registry size, so the same activity rate)
    order = {
        r: [d for d in rows if d != "evil"]
        for r, rows in _round_orders(tmp_path / "server", 2).items()
    }
    want = _expected(devs, 2, len(reg), False, order)
    torch.testing.assert_close(final.global_params, want, rtol=0, atol=1e-6)
    assert float(final.global_params.abs().max()) < 10


class _DecliningDevice(SimDevice):
    def _work(self):
        while not self._stop.is_set():
            time.sleep(0.05)
            with self._lock:
                down, self._todo = self._todo, None
            if down is not None and down.round_id not in self.sent:
                self.sent[down.round_id] = None  # type: ignore[assignment]
                self.client.publish(
                    topics.uplink(FLEET, self.dev),
                    M.encode(
                        M.Decline(
                            FLEET, down.run_id, self.dev, down.round_id, "local data unreadable"
                        )
                    ),
                    qos=1,
                )


def test_declining_device_lets_the_round_close_without_waiting_for_the_deadline(
    mqtt_broker, tmp_path
):
    reg = {"a": "speaker", "b": "tv", "broken": "tv"}
    devs = [
        SimDevice(mqtt_broker.url, "a", "speaker"),
        SimDevice(mqtt_broker.url, "b", "tv"),
        _DecliningDevice(mqtt_broker.url, "broken", "tv"),
    ]
    srv = _server(mqtt_broker, tmp_path, reg, rounds=2, round_timeout=60)
    try:
        t0 = time.monotonic()
        srv.run()
        wall = time.monotonic() - t0
    finally:
        _close_all(devs)
    assert wall < 20
    for rep in srv.reports:
        assert rep.closed_by == "all" and sorted(rep.reported) == ["a", "b"]
        assert rep.declined == {"broken": "local data unreadable"}
    assert not srv.rejections


def test_static_registry_with_an_offline_device_still_runs_rounds(mqtt_broker, tmp_path):
    reg = {"a": "speaker", "b": "tv", "never": "tv"}
    devs = [SimDevice(mqtt_broker.url, d, t) for d, t in reg.items() if d != "never"]
    srv = _server(mqtt_broker, tmp_path, reg, rounds=2, round_timeout=10, start_grace_s=1.0)
    try:
        t0 = time.monotonic()
        final = srv.run()
        wall = time.monotonic() - t0
    finally:
        _close_all(devs)
    assert final.round_id == 2 and wall < 15
    assert all(r.sampled == ["a", "b"] and r.closed_by == "all" for r in srv.reports)
    # round 1 waited out the start grace for "never"; its line tells that wait apart
    first = srv.reports[0]
    assert first.phases_s["wait"] >= 1.0 and "after waiting" in first.time_words()
    assert srv.reports[1].phases_s["wait"] < first.phases_s["wait"]
    assert 0 <= first.phases_s["open"] < first.phases_s["wait"] <= first.wall_s


@pytest.mark.parametrize(
    ("wall", "waited", "says"),
    [
        (62.0, 60.6, "in 1.40 s, after waiting 60.6 s for devices to come online"),
        (1.4, 0.0, "in 1.40 s"),
        (1.4, 0.01, "in 1.40 s"),  # a wait too short to mention
        (12.5, None, "in 12.50 s"),  # a resumed round, or a report without phases
    ],
)
def test_a_rounds_closing_line_tells_the_wait_for_devices_apart(wall, waited, says):
    from wakefl.server.server_config import RoundReport

    phases = {} if waited is None else {"wait": waited, "open": 0.1}
    assert RoundReport(1, ["a"], {}, "", wall, "all", phases).time_words() == says


def test_broker_queue_overflow_is_reported_by_the_server(tmp_path):
    from wakefl.server.broker import ManagedBroker

    with ManagedBroker(tmp_path / "broker", max_queued=5, sys_interval=1) as broker:
        reg = {"a": "speaker"}
        dev = SimDevice(broker.url, "a", "speaker")
        dev.hold.clear()
        srv = _server(broker, tmp_path, reg, rounds=1, round_timeout=30)
        thread = _start(srv)
        host, port = broker.url.removeprefix("mqtt://").split(":")
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 600
        sleeper = paho.Client(
            CallbackAPIVersion.VERSION2, client_id="sleeper", protocol=paho.MQTTv5
        )
        sleeper.connect(host, int(port), clean_start=False, properties=props)
        sleeper.loop_start()
        sleeper.subscribe("bulk/x", qos=1)
        time.sleep(0.5)
        sleeper.disconnect()
        sleeper.loop_stop()
        pub = _Raw(broker.url, "pub")
        try:
            for i in range(50):  # 45 of them overflow the sleeper's queue of 5
                pub.send("bulk/x", str(i).encode())
            _wait(lambda: srv.broker_dropped >= 45, 10, "the server to see the broker's drops")
        finally:
            pub.close()
            dev.hold.set()
            thread.join(30)
            _close_all([dev])


# --- a flood of refused messages must not stall the server -------------------------------


def _count_commits(store: StateStore) -> list[str]:
    commits: list[str] = []
    store._db.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    return commits


def test_refusals_are_counted_in_memory_and_committed_in_batches(tmp_path):
    store = StateStore(tmp_path / "s")
    store.record_update(M.Uplink(FLEET, "r", "evil", "tv", 1, torch.zeros(4), 5), b"y")
    commits = _count_commits(store)
    for i in range(500):
        store.count_rejection("malformed", "evil", 1, f"garbage {i}")
    store.count_rejection("stale_round", None, None, "no device")
    # every refusal is counted at once, in memory ...
    assert store.rejection_counts() == {"malformed": 500, "stale_round": 1}
    store.flush_rejections()
    # ... and written in one transaction (two if the writer thread took a batch meanwhile),
    # not one fsync'd commit per refused message
    assert 1 <= len(commits) <= 2, len(commits)
    store.close()
    store = StateStore(tmp_path / "s")
    try:
        assert store.rejection_counts() == {"malformed": 500, "stale_round": 1}
        assert store.clients()["evil"]["rejected"] == 500
        assert store._db.execute("SELECT COUNT(*) FROM rejection_log").fetchone()[0] == 501
    finally:
        store.close()


def test_rejections_pending_at_close_are_written_and_the_log_is_bounded(tmp_path, monkeypatch):
    from wakefl.server import rejection_log

    monkeypatch.setattr(rejection_log, "MAX_LOG_ROWS_PER_FLUSH", 10)
    monkeypatch.setattr(rejection_log, "REJECTION_FLUSH_S", 60.0)  # only close() writes
    store = StateStore(tmp_path / "s")
    for i in range(25):
        store.count_rejection("garbage" if i % 2 else "malformed", f"ghost{i}", None, "x")
    store.close()
    store = StateStore(tmp_path / "s")
    try:
        assert store.rejection_counts() == {"garbage": 12, "malformed": 13}
        rows = store._db.execute("SELECT reason, device_id, detail FROM rejection_log").fetchall()
        assert len([r for r in rows if r[1] is not None]) == 10  # one row each, up to the cap
        summarised = sum(int(r[2].split()[0]) for r in rows if r[1] is None)
        assert summarised == 15  # the rest in one summary row per reason
    finally:
        store.close()


def test_a_flood_of_refused_messages_neither_commits_nor_acks_per_message(mqtt_broker, tmp_path):
    """One device floods its topic with refused updates during an open round: every one is
    counted, but the server neither commits nor acks per message (refusal acks to one
    device id are rate-limited), and the honest update queued behind the flood is acked."""
    from wakefl.server import aggregation_server as srv_mod

    n = 400
    reg = {"a": "speaker", "b": "tv", "evil": "speaker"}
    a, b = SimDevice(mqtt_broker.url, "a", "speaker"), SimDevice(mqtt_broker.url, "b", "tv")
    a.hold.clear()
    srv = _server(mqtt_broker, tmp_path, reg, rounds=1, round_timeout=60, min_clients=2)
    commits = _count_commits(srv.store)
    thread = _start(srv)
    evil = _Raw(mqtt_broker.url, "evil")
    evil.listen_acks("evil")
    try:
        _wait(lambda: a._todo is not None and 1 in b.acked, 15, "round 1 open, b's update in")
        down = a._todo
        n_commits = len(commits)
        t0 = time.monotonic()
        sent = [
            evil.c.publish(
                topics.uplink(FLEET, "evil"),
                M.encode(
                    M.Uplink(
                        FLEET,
                        down.run_id,
                        "evil",
                        "speaker",
                        1,
                        torch.zeros(D),
                        i,
                        {"sigma_sq": 0.1, "has_variance": 1.0, "local_steps": 1},
                    )
                ),
                qos=1,
            )
            for i in range(n)
        ]  # evil is registered but not sampled: each is refused
        sent[-1].wait_for_publish(30)  # the whole flood is with the broker ...
        a.hold.set()  # ... so a's update comes behind it in the server's queue
        _wait(lambda: 1 in a.acked, 60, "a's update acked behind the flood")
        flood_s = time.monotonic() - t0
        _wait(lambda: srv.rejections["not_sampled"] >= n, 20, "every refusal counted")
        thread.join(30)
        assert not thread.is_alive()
        time.sleep(0.3)  # the last acks in flight
    finally:
        evil.close()
        _close_all([a, b])
    flood_commits = len(commits) - n_commits
    # a's update, the round's close and a few batches of counts: not one commit per refusal
    assert flood_commits <= 5 + flood_s / 0.5, (flood_commits, flood_s)
    assert len(evil.acks) <= srv_mod.REFUSAL_ACK_BURST + srv_mod.REFUSAL_ACKS_PER_S * (flood_s + 2)
    assert srv.acks_withheld == n - len(evil.acks)
    assert sorted(srv.reports[0].reported) == ["a", "b"]
    store = StateStore(tmp_path / "server")
    try:
        assert store.rejection_counts() == {"not_sampled": n}  # every one on disk after close
    finally:
        store.close()


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


@pytest.mark.parametrize(
    ("rate", "registry", "quorum", "want"),
    [
        (0.3, 10, None, 3),
        (0.25, 10, None, 2),
        (0.1, 5, None, 1),
        (0.25, 10, 4, 4),
        (1.0, 3, None, 3),
    ],
)
def test_server_samples_the_paper_count_raised_to_its_quorum(
    tmp_path, rate, registry, quorum, want
):
    # floor(C M), at least 1 (rules.sampled_count), as the simulation and the studies
    # count: 0.3 * 10 is 3.0000000000000004 in floating point, which ceil made 4.
    reg = {f"d{i}": "speaker" for i in range(registry)}
    srv = _server(
        type("B", (), {"url": "mqtt://127.0.0.1:1"})(),
        tmp_path,
        reg,
        activity_rate=rate,
        min_clients=quorum,
    )
    try:
        picked = srv._sample(1, sorted(reg), registry)
        assert len(picked) == want and set(picked) <= set(reg)
        assert len(srv._sample(1, ["d0", "d1"], registry)) == min(want, 2)  # among the online
    finally:
        srv.store.close()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            ["--strategy", "fedavg-w", "--group-by", "device_type"],
            "does not take one of --group-by",
        ),
        (["--strategy-arg", "lrr=0.1"], "does not take one of --strategy-arg lrr"),
        (["--strategy-arg", "lr=abc"], "bad --strategy-arg value"),
        (["--strategy-arg", "lr=[1]"], "bad --strategy-arg value"),
        (["--strategy-arg", "l_max=-3"], "l_max"),
        (["--strategy-arg", "lr=1e999"], "learning rate"),
        (["--strategy-arg", "lr"], "KEY=VALUE"),
        (["--strategy", "nope"], "unknown strategy"),
        (["--strategy", "fedavg-w", "--role", "coordinator"], "Self-FL strategies only"),
        (["--role", "coordinator", "--group-by", "device_type"], "cluster mode"),
    ],
)
def test_the_cli_turns_every_bad_strategy_argument_into_one_line(tmp_path, capsys, extra, says):
    from wakefl.tools.cli import main

    # Refused before any broker is contacted: the URL is never dialled.
    argv = ["server", "--broker", "mqtt://127.0.0.1:1", "--state", str(tmp_path / "s")]
    assert main(argv + ["--rounds", "1", "--devices", "a:x", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert "wakefl: error: " in err and "\n" not in err and "Traceback" not in err
    assert says in err, err


def test_admission_goes_on_while_a_commit_holds_the_disk(mqtt_broker, tmp_path):
    """A batch's commit (its fsync) holds `commit_lock`, not the session lock: while one is
    in progress, other uplinks are still admitted and refused, and the committing update is
    acknowledged only once the commit is through."""
    reg = {"a": "speaker", "b": "tv", "evil": "speaker"}
    a, b = SimDevice(mqtt_broker.url, "a", "speaker"), SimDevice(mqtt_broker.url, "b", "tv")
    a.hold.clear()
    b.hold.clear()
    srv = _server(mqtt_broker, tmp_path, reg, rounds=1, round_timeout=30, min_clients=2)
    thread = _start(srv)
    evil = _Raw(mqtt_broker.url, "evil")
    lock = srv.session.commit_lock
    try:
        _wait(lambda: a._todo is not None and b._todo is not None, 15, "round 1 downlink")
        down = a._todo
        with lock:  # a commit in progress
            a.hold.set()
            _wait(lambda: srv.recorder.flush(0) is False, 10, "a's update at the recorder")
            stranger = M.Uplink(
                FLEET, down.run_id, "evil", "speaker", 1, torch.ones(D), 1,
                {"sigma_sq": 0.1, "has_variance": 1.0, "local_steps": 1},
            )  # fmt: skip
            evil.send(topics.uplink(FLEET, "evil"), M.encode(stranger))
            _wait(lambda: srv.rejections["not_sampled"] == 1, 10, "the refusal, mid-commit")
            time.sleep(0.3)
            assert 1 not in a.acked  # its commit waits for the lock
        _wait(lambda: 1 in a.acked, 10, "a's ack once the commit went through")
        b.hold.set()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        evil.close()
        _close_all([a, b])
    assert sorted(srv.reports[0].reported) == ["a", "b"]
