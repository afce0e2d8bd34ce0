"""The bridged topology of docs/SCALE.md with three real mosquittos on 127.0.0.1: two edges
bridged to a core, configured by tools/fleet/provision_bridge.py (TLS, passwords, ACLs). The
aggregation server runs on the core, devices on the edges: rounds complete through the
bridges, the retained downlink reaches both edges, each ack reaches only its device, and
the edges' ACLs still pin every device to its own topics."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from wakefl.errors import ProtocolError
from wakefl.protocol import messages as M
from wakefl.protocol import topics
from wakefl.sdk.mqtt_link import MqttLink, PublishError, wait_until
from wakefl.sdk.selffl.registry import make_strategy
from wakefl.server.aggregation_server import AggregationServer, ServerConfig
from wakefl.server.broker import ManagedBroker, free_ports
from wakefl.tools.fleet.provision_bridge import Edge, provision_bridged

pytestmark = pytest.mark.slow  # three brokers and a CA per broker

FLEET = "bridged"
D = 48
EDGES = {
    "eu1": {"a1": "speaker", "a2": "tv", "a-spy": "speaker"},
    "us1": {"b1": "speaker", "b2": "tv"},
}
SERVED = {"a1": "speaker", "a2": "tv", "b1": "speaker", "b2": "tv"}  # a-spy is not served


@contextlib.contextmanager
def bridged_topology() -> Iterator[dict[str, Any]]:
    """Core and two edges running; yields provision_bridged's description of them."""
    # As root, mosquitto switches to its own user, which must reach these folders (not
    # pytest's 0700 tmp_path).
    state = Path(tempfile.mkdtemp(prefix="wakefl-bridge-"))
    state.chmod(0o711)
    # Distinct ports: a port handed out twice started one broker on another's port.
    core_port, *edge_ports = free_ports(1 + len(EDGES))
    edges = [
        Edge(name, port, devices)
        for (name, devices), port in zip(EDGES.items(), edge_ports, strict=True)
    ]
    out = provision_bridged(state, FLEET, core_port, edges)
    brokers = []
    try:
        for name, info in [("core", out["core"]), *out["edges"].items()]:
            conf = info["dir"] / "mosquitto.conf"
            brokers.append(ManagedBroker(state / f"run-{name}", port=info["port"], conf_file=conf))
            brokers[-1].start()
        yield out
    finally:
        for broker in reversed(brokers):
            broker.stop()
        shutil.rmtree(state, ignore_errors=True)


def _url(topo: dict[str, Any], dev: str) -> str:
    edge = next(e for e, devices in EDGES.items() if dev in devices)
    return topo["edges"][edge]["device_urls"][dev]


class EdgeDevice:
    """A device on an edge: answers each round it is sampled for with a small update and
    records every ack it receives."""

    def __init__(self, url: str, dev: str, typ: str) -> None:
        self.dev, self.typ = dev, typ
        self.sent: dict[int, str] = {}  # round -> message id of the update sent
        self.acks: list[tuple[str, M.Ack]] = []
        self.final: M.Downlink | None = None
        offline = M.encode(M.Hello(FLEET, dev, typ, online=False))
        self.link = MqttLink(url, dev, will=(topics.hello(FLEET, dev), offline))
        self.link.subscribe(topics.downlink(FLEET), self._on_down)
        self.link.subscribe(
            topics.ack(FLEET, dev), lambda t, p: self.acks.append((t, M.decode_as(p, M.Ack)))
        )
        self.link.connect(15)
        hello = M.encode(M.Hello(FLEET, dev, typ, 10))
        self.link.publish(topics.hello(FLEET, dev), hello, retain=True)

    def _on_down(self, topic: str, payload: bytes) -> None:
        down = M.decode_as(payload, M.Downlink)
        if down.final:
            self.final = down
            return
        if self.dev not in down.instructions or down.round_id in self.sent:
            return
        shift = 0.1 * (1 + sorted(SERVED).index(self.dev))
        up = M.Uplink(
            FLEET,
            down.run_id,
            self.dev,
            self.typ,
            down.round_id,
            down.global_params + shift,
            10,
            {"has_variance": 1.0, "sigma_sq": 0.1 + shift, "local_steps": 5.0},
        )
        payload = M.encode(up)
        self.sent[down.round_id] = M.message_id(payload)
        self.link.publish(topics.uplink(FLEET, self.dev), payload, wait=False)


def _server(topo: dict[str, Any], state: Path, rounds: int) -> AggregationServer:
    cfg = ServerConfig(
        broker_url=topo["core"]["server_url"],
        state_dir=state,
        initial_params=torch.zeros(D),
        fleet=FLEET,
        rounds=rounds,
        devices=dict(SERVED),
        round_timeout=30,
        start_timeout=30,
    )
    return AggregationServer(cfg, make_strategy("selffl"), progress=lambda s: None)


def _spy(topo: dict[str, Any]) -> tuple[MqttLink, list[tuple[str, bytes]]]:
    """a-spy, a provisioned device on eu1, subscribed to the whole fleet tree."""
    seen: list[tuple[str, bytes]] = []
    link = MqttLink(_url(topo, "a-spy"), "a-spy")
    link.subscribe(f"wakefl/{FLEET}/#", lambda t, p: seen.append((t, p)))
    return link.connect(15), seen


def test_rounds_run_through_two_bridged_edges(tmp_path):
    """Two rounds of the real server on the core with devices on two edges: every update
    reaches the server through its edge, every device receives the downlink and only its
    own acks, a device on either edge connecting later receives the retained final model."""
    with bridged_topology() as topo:
        spy, seen = _spy(topo)
        devices = [EdgeDevice(_url(topo, d), d, t) for d, t in SERVED.items()]
        try:
            server = _server(topo, tmp_path / "server", rounds=2)
            final = server.run()
            assert wait_until(lambda: all(d.final for d in devices), 15)
            late = {}
            for dev in ("a2", "b2"):  # reconnect with a clean session: retained copy only
                devices[list(SERVED).index(dev)].link.close()
                got: list[bytes] = []
                link = MqttLink(_url(topo, dev), dev, clean_start=True)
                link.subscribe(topics.downlink(FLEET), lambda t, p, got=got: got.append(p))
                link.connect(15)
                assert wait_until(lambda got=got: bool(got), 10), f"{dev}: no retained downlink"
                late[dev] = M.decode_as(got[0], M.Downlink)
                link.close()
        finally:
            for d in devices:
                d.link.close()
            spy.close()
    assert [r.closed_by for r in server.reports] == ["all", "all"]
    assert all(sorted(r.reported) == sorted(SERVED) for r in server.reports)
    assert not server.rejections
    for d in devices:
        assert d.final is not None and d.final.round_id == final.round_id == 2
        torch.testing.assert_close(d.final.global_params, final.global_params)
        # exactly one accepted ack per round, on its own topic, answering its own update
        assert [t for t, _ in d.acks] == [topics.ack(FLEET, d.dev)] * 2
        assert {a.round_id: a.answers for _, a in d.acks} == d.sent
        assert all(a.accepted for _, a in d.acks)
    for dev, down in late.items():
        assert down.final and down.round_id == 2, dev
    # The spy subscribed to everything and read only the downlinks: no ack, no uplink, no
    # hello of another device crossed its edge's ACL.
    assert seen and {t for t, _ in seen} == {topics.downlink(FLEET)}


def test_edge_and_core_acls_hold():
    """On an edge a device can publish only as itself and read only the downlink and its
    own acks; anonymous clients, wrong passwords and device passwords on the core are
    refused; a bridge account on the core cannot write the downlink or an ack."""
    with bridged_topology() as topo:
        server = MqttLink(topo["core"]["server_url"], "wakefl-server").connect(15)
        up_seen: list[str] = []
        server.subscribe(topics.uplink_filter(FLEET), lambda t, p: up_seen.append(t))
        spy, seen = _spy(topo)
        b1 = MqttLink(_url(topo, "b1"), "b1").connect(15)
        try:
            time.sleep(1.0)  # the bridges' subscriptions on the core
            for topic in (
                topics.uplink(FLEET, "a1"),  # same edge
                topics.uplink(FLEET, "b1"),  # the other edge
                topics.hello(FLEET, "a1"),
                topics.downlink(FLEET),
                topics.ack(FLEET, "a1"),
            ):
                with pytest.raises(PublishError) as info:
                    spy.publish(topic, b"forged")
                assert info.value.code == 0x87, topic
            spy.publish(topics.uplink(FLEET, "a-spy"), b"own")
            b1.publish(topics.uplink(FLEET, "b1"), b"own")
            server.publish(topics.ack(FLEET, "b1"), b"ack-b1")
            server.publish(topics.ack(FLEET, "a1"), b"ack-a1")
            assert wait_until(lambda: len(up_seen) == 2, 10)
            _refused_connections(topo)
            _bridge_cannot_write_downlink(topo)
        finally:
            for link in (b1, spy, server):
                link.close()
    assert sorted(up_seen) == [topics.uplink(FLEET, "a-spy"), topics.uplink(FLEET, "b1")]
    assert seen == []  # a1's ack crossed the bridge to eu1 but not a-spy's ACL


def _refused_connections(topo: dict[str, Any]) -> None:
    core_ca = topo["core"]["dir"] / "ca.crt"
    eu1 = topo["edges"]["eu1"]
    eu1_ca = eu1["dir"] / "ca.crt"
    a1_password = eu1["device_urls"]["a1"].split(":")[2].split("@")[0]
    for url in (
        f"mqtts://127.0.0.1:{eu1['port']}?ca={eu1_ca}",  # anonymous on an edge
        f"mqtts://127.0.0.1:{topo['core']['port']}?ca={core_ca}",  # anonymous on the core
        f"mqtts://a1:wrong@127.0.0.1:{eu1['port']}?ca={eu1_ca}",
        f"mqtts://a1:{a1_password}@127.0.0.1:{topo['core']['port']}?ca={core_ca}",
    ):
        with pytest.raises(ProtocolError):
            MqttLink(url, "intruder").connect(3)


def _bridge_cannot_write_downlink(topo: dict[str, Any]) -> None:
    """Run last: the bridge's own credentials on the core take over its session."""
    password = topo["core"]["bridges"]["us1"]
    core = topo["core"]
    url = f"mqtts://bridge-us1:{password}@127.0.0.1:{core['port']}?ca={core['dir'] / 'ca.crt'}"
    bridge = MqttLink(url, "bridge-us1", clean_start=True).connect(10)
    try:
        for topic in (topics.downlink(FLEET), topics.ack(FLEET, "b1")):
            with pytest.raises(PublishError) as info:
                bridge.publish(topic, b"forged")
            assert info.value.code == 0x87, topic
    finally:
        bridge.close()


def test_generated_configs_carry_the_bridge_and_private_files(tmp_path):
    """What the generator writes, read back: the bridge block, ACL blocks, file modes."""
    out = provision_bridged(
        tmp_path, FLEET, 18883, [Edge("eu1", 18884, {"a1": "speaker"}), Edge("us1", 18885)]
    )
    core_acl = (out["core"]["dir"] / "acl").read_text()
    assert "user bridge-eu1\ntopic write wakefl/bridged/up/#\n" in core_acl
    assert "topic read wakefl/bridged/ack/#" in core_acl and "user a1" not in core_acl
    edge = out["edges"]["eu1"]["dir"]
    conf = (edge / "mosquitto.conf").read_text()
    assert "connection bridge-eu1\naddress 127.0.0.1:18883\n" in conf
    assert "topic wakefl/bridged/down in 1" in conf and "allow_anonymous false" in conf
    acl = (edge / "acl").read_text()
    assert "topic write wakefl/bridged/up/a1" in acl and "wakefl-server" not in acl
    for private in (edge / "mosquitto.conf", edge / "passwd", out["core"]["dir"] / "passwd"):
        assert private.stat().st_mode & 0o777 == 0o600, private
