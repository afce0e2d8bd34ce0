"""A sharded server (one coordinator, aggregation workers on a shared subscription) against
a real mosquitto on 127.0.0.1, with the simulated devices of server_sim.py: the model it
computes is the single-process one on the same updates, and a worker killed mid-round
loses no acknowledged update."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest
import torch
from paho.mqtt.enums import CallbackAPIVersion
from server_sim import FLEET, SimDevice, close_all, expected_global, round_orders, wait_for

from wakefl.protocol import messages as M
from wakefl.protocol import topics
from wakefl.sdk.selffl.registry import make_strategy
from wakefl.server.aggregation_server import ServerConfig
from wakefl.server.aggregation_worker import AggregationWorker
from wakefl.server.sharded_coordinator import ShardedCoordinator
from wakefl.server.state_store import StateStore

REG = {"a": "speaker", "b": "speaker", "c": "tv", "d": "tv"}
RECORD = {"sigma_sq": 0.1, "has_variance": 1.0, "local_steps": 5.0}
D = 48


def _config(broker, state: Path, **kw) -> ServerConfig:
    return ServerConfig(
        broker_url=broker.url,
        state_dir=state,
        initial_params=torch.zeros(D),
        fleet=FLEET,
        devices=REG,
        **kw,
    )


def _ghost_worker(url: str, wid: str) -> paho.Client:
    """A worker that announces itself online and never answers a pass."""
    host, port = url.removeprefix("mqtt://").split(":")
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"ghost-{wid}", protocol=paho.MQTTv5)
    c.connect(host, int(port))
    c.loop_start()
    info = c.publish(
        topics.agg_worker(FLEET, wid), json.dumps({"online": True}), qos=1, retain=True
    )
    info.wait_for_publish(5)
    return c


def _start_workers(
    broker, state: Path, rounds: int, ids: tuple[str, ...] = ("w1", "w2")
) -> tuple[list[AggregationWorker], list[threading.Thread]]:
    """In-process aggregation workers, each running in its own thread; the list fills as
    each worker is built."""
    workers: list[AggregationWorker] = []

    def start_worker(wid: str) -> None:
        w = AggregationWorker(
            _config(broker, state, rounds=rounds),
            make_strategy("selffl"),
            wid,
            progress=lambda s: None,
        )
        workers.append(w)
        w.run()

    threads = [threading.Thread(target=start_worker, args=(w,), daemon=True) for w in ids]
    for t in threads:
        t.start()
    return workers, threads


def test_sharded_rounds_equal_the_single_process_model(mqtt_broker, tmp_path):
    state = tmp_path / "server"
    coord = ShardedCoordinator(
        _config(mqtt_broker, state, rounds=3, round_timeout=30),
        make_strategy("selffl"),
        progress=lambda s: None,
        task_timeout_s=2.0,
    )
    ghost = _ghost_worker(mqtt_broker.url, "ghost")

    result: list = []
    runner = threading.Thread(target=lambda: result.append(coord.run()), daemon=True)
    runner.start()
    workers, threads = _start_workers(mqtt_broker, state, rounds=3)
    devs = [SimDevice(mqtt_broker.url, d, t) for d, t in REG.items()]
    for d in devs:
        d.hold.clear()  # not before the hostile messages below were refused
    try:
        wait_for(
            lambda: len(workers) == 2 and all(w.link.connected for w in workers), 30, "workers"
        )
        # The workers refuse as one process does: garbage from a registered device (acked as
        # a refusal), an update from an unregistered one.
        stranger = M.Uplink(FLEET, "r", "zz", "tv", 1, torch.zeros(D), 5, dict(RECORD))
        hostile = [
            (topics.uplink(FLEET, "a"), b"garbage"),
            (topics.uplink(FLEET, "zz"), M.encode(stranger)),
        ]
        wait_for(lambda: _refused(ghost, hostile, state) >= {"malformed", "unknown_device"}, 20, "")
        for d in devs:
            d.hold.set()
        runner.join(60)
        wait_for(lambda: all(d.final is not None for d in devs), 10, "the end announcement")
        for t in threads:
            t.join(10)
    finally:
        close_all(devs)
        ghost.loop_stop()
        ghost.disconnect()
        coord.stop_event.set()
        for w in workers:
            w.stop_event.set()
    final = result[0]
    assert final.round_id == 3
    assert [r.closed_by for r in coord.reports] == ["all"] * 3
    assert sum(w.recorded for w in workers) == 3 * len(REG)
    assert coord.passes_reassigned >= 1  # the ghost's passes went to a live worker
    assert set(coord.rejections) == {"malformed", "unknown_device"}  # the workers' counts
    want = expected_global(devs, 3, len(REG), False, round_orders(state, 3))
    torch.testing.assert_close(final.global_params, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(devs[0].final.global_params, want, rtol=0, atol=1e-6)


def _refused(client: paho.Client, messages: list[tuple[str, bytes]], state: Path) -> set[str]:
    """Publish `messages` (again) and return the refusal reasons on record."""
    for topic, payload in messages:
        client.publish(topic, payload, qos=1)
    time.sleep(0.7)  # the store commits refusals in batches
    store = StateStore(state)
    try:
        return set(store.rejection_counts())
    finally:
        store.close()


def _cli_worker(url: str, state: Path, wid: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wakefl.tools.cli",
            "server",
            "--role",
            "worker",
            "--worker-id",
            wid,
            "--broker",
            url,
            "--state",
            str(state),
            "--fleet",
            FLEET,
            "--devices",
            ",".join(f"{d}:{t}" for d, t in REG.items()),
            "--rounds",
            "3",
        ],
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _writers(state: Path, round_id: int) -> dict[str, str]:
    """device -> the worker that recorded its update of `round_id` (from the file name)."""
    store = StateStore(state)
    try:
        return {r["device_id"]: r["path"].split(".")[-2] for r in store.update_rows(round_id)}
    finally:
        store.close()


def test_worker_sigkill_mid_round_loses_no_acknowledged_update(mqtt_broker, tmp_path):
    state = tmp_path / "server"
    coord = ShardedCoordinator(
        _config(mqtt_broker, state, rounds=3, round_timeout=60),
        make_strategy("selffl"),
        progress=lambda s: None,
    )
    result: list = []
    runner = threading.Thread(target=lambda: result.append(coord.run()), daemon=True)
    runner.start()
    procs = {w: _cli_worker(mqtt_broker.url, state, w) for w in ("w1", "w2")}
    devs = [SimDevice(mqtt_broker.url, d, t) for d, t in REG.items()]
    late = devs[-1]
    late.hold_from = 2
    late.hold.clear()
    try:
        wait_for(lambda: all(1 in d.acked for d in devs), 60, "round 1")
        wait_for(lambda: all(2 in d.acked for d in devs[:-1]), 30, "round 2 but one device")
        acked_before = {(d.dev, r) for d in devs for r in d.acked}
        writers = _writers(state, 2)
        victim = max(procs, key=lambda w: list(writers.values()).count(w))
        assert victim in writers.values()
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(10)
        late.hold.set()  # its uplink goes to the survivor (or is re-sent to it)
        runner.join(90)
        wait_for(lambda: all(d.final is not None for d in devs), 10, "the end announcement")
        survivor = next(w for w in procs if w != victim)
        out, _ = procs[survivor].communicate(timeout=30)
        assert procs[survivor].returncode == 0, out
    finally:
        close_all(devs)
        coord.stop_event.set()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    final = result[0]
    assert final.round_id == 3
    assert [len(r.reported) for r in coord.reports] == [len(REG)] * 3
    assert {d for d, w in writers.items() if w == victim} <= set(coord.reports[1].reported)
    recorded = {(r, d) for r in (1, 2, 3) for d in _writers(state, r)}
    assert {(r, d) for d, r in acked_before} <= recorded
    assert coord.passes_local == 0
    want = expected_global(devs, 3, len(REG), False, round_orders(state, 3))
    torch.testing.assert_close(final.global_params, want, rtol=0, atol=1e-6)


def test_worker_account_reads_uplinks_through_the_shared_subscription_and_devices_not_agg(
    tmp_path,
):
    from wakefl.sdk.mqtt_link import MqttLink, PublishError
    from wakefl.server.broker import ManagedBroker, free_port
    from wakefl.server.provisioning import provision, provision_worker

    fleet, port = "secure", free_port()
    shared = Path(tempfile.mkdtemp(prefix="wakefl-prov-"))
    shared.chmod(0o711)  # reachable by the `mosquitto` user (see test_broker_security.py)
    prov = shared / "prov"
    dev = provision(prov, "dev-a", "speaker", fleet=fleet, port=port)
    w1 = provision_worker(prov, "w1", fleet=fleet, port=port)
    assert "user wakefl-agg-w1" in (prov / "acl").read_text()
    broker = ManagedBroker(tmp_path / "run", port=port, conf_file=prov / "mosquitto.conf").start()
    links: list[MqttLink] = []
    try:
        worker = MqttLink(w1["broker"], "any-id", clean_start=True, session_expiry=0)
        got: list[str] = []
        worker.subscribe(
            topics.shared_uplink_filter(fleet, "wakefl-agg"), lambda t, p: got.append(t)
        )
        device = MqttLink(dev["broker"], "dev-a")
        agg_seen: list[str] = []
        device.subscribe(f"wakefl/{fleet}/agg/#", lambda t, p: agg_seen.append(t))
        links += [worker.connect(10), device.connect(10)]
        device.publish(topics.uplink(fleet, "dev-a"), b"update")
        wait_for(lambda: got == [topics.uplink(fleet, "dev-a")], 10, "the uplink at the worker")
        worker.publish(topics.ack(fleet, "dev-a"), b"ack")
        worker.publish(topics.agg_result(fleet), b"partial")
        for topic in (topics.agg_result(fleet), topics.agg_worker(fleet, "w1")):
            with pytest.raises(PublishError) as err:
                device.publish(topic, b"forged")
            assert err.value.code == 0x87
        assert not agg_seen
    finally:
        for link in links:
            link.close()
        broker.stop()
        shutil.rmtree(shared, ignore_errors=True)


def _cli_coordinator(url: str, state: Path, init: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "wakefl.tools.cli", "server", "--role", "coordinator"]
    cmd += ["--broker", url, "--state", str(state), "--fleet", FLEET, "--init-model", str(init)]
    cmd += ["--devices", ",".join(f"{d}:{t}" for d, t in REG.items()), "--rounds", "2"]
    cmd += ["--round-timeout", "60", "--ack-timeout", "2"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _round_status(state: Path, round_id: int) -> str | None:
    store = StateStore(state)
    try:
        rec = store.round(round_id)
        return None if rec is None else rec.status
    finally:
        store.close()


def test_coordinator_sigkill_while_merging_resumes_the_sealed_round(mqtt_broker, tmp_path):
    from safetensors.torch import save_file

    state, init = tmp_path / "server", tmp_path / "init.safetensors"
    save_file({"params": torch.zeros(D)}, str(init))
    # A worker that never answers holds the coordinator in its first pass (60 s timeout):
    # the round is sealed, not aggregated, when the coordinator is killed.
    ghost = _ghost_worker(mqtt_broker.url, "ghost")
    proc = _cli_coordinator(mqtt_broker.url, state, init)

    workers, threads = _start_workers(mqtt_broker, state, rounds=2)
    devs = [SimDevice(mqtt_broker.url, d, t) for d, t in REG.items()]
    try:
        wait_for(lambda: _round_status(state, 1) == "sealed", 60, "round 1 sealed")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        ghost.publish(topics.agg_worker(FLEET, "ghost"), b"", qos=1, retain=True).wait_for_publish(
            5
        )
        proc = _cli_coordinator(mqtt_broker.url, state, init)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out
        assert "round 1/2: resumed with 4/4 updates on record" in out
        wait_for(lambda: all(d.final is not None for d in devs), 10, "the end announcement")
        for t in threads:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        close_all(devs)
        ghost.loop_stop()
        ghost.disconnect()
        for w in workers:
            w.stop_event.set()
    store = StateStore(state)
    try:
        final = store.load_server_state()
    finally:
        store.close()
    assert final.round_id == 2
    want = expected_global(devs, 2, len(REG), False, round_orders(state, 2))
    torch.testing.assert_close(final.global_params, want, rtol=0, atol=1e-6)
