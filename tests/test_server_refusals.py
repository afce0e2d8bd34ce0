"""Hostile and broken devices against the server on a real mosquitto: every kind of refusal
is counted and acked while the round completes, crafted payloads never crash it, a flood of
refused messages neither commits nor acks per message, and admission goes on during a commit."""

from __future__ import annotations

import pickle
import time

import paho.mqtt.client as paho
import torch
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from server_sim import (
    FLEET,
    D,
    RawClient,
    SimDevice,
    close_all,
    expected_global,
    make_server,
    round_orders,
    start,
    wait_for,
)

from wakefl.protocol import messages as M
from wakefl.protocol import topics
from wakefl.server.state_store import StateStore
from wakefl.tools.fleet.bench_hostile_fleet import raw_uplink, with_flipped_bit, with_nan_entry


def _raw_uplink(down: M.Downlink, dev: str, typ: str, text_fields: str) -> bytes:
    """An uplink frame whose JSON fields are written by hand (`text_fields` appended)."""
    return raw_uplink((FLEET, down.run_id, down.round_id), (dev, typ), torch.zeros(D), text_fields)


def test_every_rejection_kind_counted_while_round_completes(mqtt_broker, tmp_path):
    reg = {"a": "speaker", "b": "tv", "evil": "speaker"}
    a, b = SimDevice(mqtt_broker.url, "a", "speaker"), SimDevice(mqtt_broker.url, "b", "tv")
    a.hold.clear()
    b.hold.clear()
    srv = make_server(
        mqtt_broker, tmp_path, reg, rounds=1, round_timeout=30, min_clients=2, max_bytes=64 * 1024
    )
    thread = start(srv)
    evil = RawClient(mqtt_broker.url, "evil")
    try:
        wait_for(lambda: a._todo is not None, 15, "round 1 downlink")
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

        hostile = {
            "malformed": (topics.uplink(FLEET, "evil"), b"garbage" * 10),
            "bad_hash": (topics.uplink(FLEET, "evil"), with_flipped_bit(M.encode(up()))),
            "oversized": (topics.uplink(FLEET, "evil"), M.encode(up(params=torch.ones(20000)))),
            "version": (topics.uplink(FLEET, "evil"), M.encode(up(version=9))),
            "pickle": (topics.uplink(FLEET, "evil"), pickle.dumps([1, 2])),
            "shape": (topics.uplink(FLEET, "evil"), M.encode(up(params=torch.ones(D + 1)))),
            "non_finite": (topics.uplink(FLEET, "evil"), with_nan_entry(M.encode(up()))),
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
        wait_for(lambda: sum(srv.rejections.values()) >= len(hostile) + 1, 15, "rejections counted")
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
    want = expected_global([a, b], 1, len(reg), False, round_orders(tmp_path / "server", 1))
    store = StateStore(tmp_path / "server")
    torch.testing.assert_close(store.load_server_state().global_params, want, rtol=0, atol=1e-6)
    assert store.rejection_counts()["shape"] == 1


def test_crafted_uplinks_are_counted_acked_and_never_crash(mqtt_broker, tmp_path, caplog):
    reg = {"a": "speaker", "b": "tv", "evil": "speaker"}
    a, b = SimDevice(mqtt_broker.url, "a", "speaker"), SimDevice(mqtt_broker.url, "b", "tv")
    a.hold.clear()
    srv = make_server(mqtt_broker, tmp_path, reg, rounds=1, round_timeout=30, min_clients=2)
    thread = start(srv)
    evil = RawClient(mqtt_broker.url, "evil")
    evil.listen_acks("evil")
    try:
        wait_for(lambda: a._todo is not None, 15, "round 1 downlink")
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
        wait_for(lambda: sum(srv.rejections.values()) >= 6, 20, "every crafted message counted")
        wait_for(lambda: len(evil.acks) >= 4, 10, "refusal acks to evil")
        a.hold.set()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        evil.close()
        close_all([a, b])
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
    old = RawClient(mqtt_broker.url, "ghost")
    old.listen_acks("ghost")

    def hello(dev: str, typ: str, online: bool) -> None:
        payload = M.encode(M.Hello(FLEET, dev, typ, 10, online=online))
        old.c.publish(topics.hello(FLEET, dev), payload, qos=1, retain=True).wait_for_publish(5)

    hello("gone", "speaker", False)  # a device no longer in the fleet, offline
    hello("c", "tv", False)  # a device of the fleet that then ran as another type
    hello("ghost", "speaker", True)  # still connected: it is told it is refused
    a, b = SimDevice(mqtt_broker.url, "a", "speaker"), SimDevice(mqtt_broker.url, "b", "tv")
    a.hold.clear()
    srv = make_server(mqtt_broker, tmp_path, reg, rounds=1, round_timeout=30, min_clients=2)
    thread = start(srv)
    try:
        wait_for(lambda: a._todo is not None, 15, "round 1 downlink")
        wait_for(lambda: len(old.acks) >= 1, 10, "the refusal of ghost's retained hello")
        assert srv.rejections["unknown_device"] == 0 and srv.rejections["wrong_device_type"] == 0
        hello("gone", "speaker", True)  # published retained, delivered live: counted
        hello("c", "tv", True)
        wait_for(lambda: sum(srv.rejections.values()) >= 2, 15, "the live hellos' refusals")
        a.hold.set()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        old.close()
        close_all([a, b])
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


def test_broker_queue_overflow_is_reported_by_the_server(tmp_path):
    from wakefl.server.broker import ManagedBroker

    with ManagedBroker(tmp_path / "broker", max_queued=5, sys_interval=1) as broker:
        reg = {"a": "speaker"}
        dev = SimDevice(broker.url, "a", "speaker")
        dev.hold.clear()
        srv = make_server(broker, tmp_path, reg, rounds=1, round_timeout=30)
        thread = start(srv)
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
        pub = RawClient(broker.url, "pub")
        try:
            for i in range(50):  # 45 of them overflow the sleeper's queue of 5
                pub.send("bulk/x", str(i).encode())
            wait_for(lambda: srv.broker_dropped >= 45, 10, "the server to see the broker's drops")
        finally:
            pub.close()
            dev.hold.set()
            thread.join(30)
            close_all([dev])


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
    srv = make_server(mqtt_broker, tmp_path, reg, rounds=1, round_timeout=60, min_clients=2)
    commits = _count_commits(srv.store)
    thread = start(srv)
    evil = RawClient(mqtt_broker.url, "evil")
    evil.listen_acks("evil")
    try:
        wait_for(lambda: a._todo is not None and 1 in b.acked, 15, "round 1 open, b's update in")
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
        wait_for(lambda: 1 in a.acked, 60, "a's update acked behind the flood")
        flood_s = time.monotonic() - t0
        wait_for(lambda: srv.rejections["not_sampled"] >= n, 20, "every refusal counted")
        thread.join(30)
        assert not thread.is_alive()
        time.sleep(0.3)  # the last acks in flight
    finally:
        evil.close()
        close_all([a, b])
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


def test_admission_goes_on_while_a_commit_holds_the_disk(mqtt_broker, tmp_path):
    """A batch's commit (its fsync) holds `commit_lock`, not the session lock: while one is
    in progress, other uplinks are still admitted and refused, and the committing update is
    acknowledged only once the commit is through."""
    reg = {"a": "speaker", "b": "tv", "evil": "speaker"}
    a, b = SimDevice(mqtt_broker.url, "a", "speaker"), SimDevice(mqtt_broker.url, "b", "tv")
    a.hold.clear()
    b.hold.clear()
    srv = make_server(mqtt_broker, tmp_path, reg, rounds=1, round_timeout=30, min_clients=2)
    thread = start(srv)
    evil = RawClient(mqtt_broker.url, "evil")
    lock = srv.session.commit_lock
    try:
        wait_for(lambda: a._todo is not None and b._todo is not None, 15, "round 1 downlink")
        down = a._todo
        with lock:  # a commit in progress
            a.hold.set()
            wait_for(lambda: srv.recorder.flush(0) is False, 10, "a's update at the recorder")
            stranger = M.Uplink(
                FLEET, down.run_id, "evil", "speaker", 1, torch.ones(D), 1,
                {"sigma_sq": 0.1, "has_variance": 1.0, "local_steps": 1},
            )  # fmt: skip
            evil.send(topics.uplink(FLEET, "evil"), M.encode(stranger))
            wait_for(lambda: srv.rejections["not_sampled"] == 1, 10, "the refusal, mid-commit")
            time.sleep(0.3)
            assert 1 not in a.acked  # its commit waits for the lock
        wait_for(lambda: 1 in a.acked, 10, "a's ack once the commit went through")
        b.hold.set()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        evil.close()
        close_all([a, b])
    assert sorted(srv.reports[0].reported) == ["a", "b"]
