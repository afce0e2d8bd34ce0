"""What the MQTT link tells the broker and the operator when it connects (issue #50, items 6
and 8), against a real mosquitto on 127.0.0.1: a refused connection says how long it
waited, and the server's CONNECT caps what the broker may deliver to it."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from wakefl.errors import ConfigError, ProtocolError
from wakefl.protocol import topics
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.sdk.selffl.registry import make_strategy
from wakefl.server.aggregation_server import AggregationServer, ServerConfig
from wakefl.server.broker import ManagedBroker, free_port
from wakefl.server.broker_pki import run_tool

FLEET = "limits"


def test_a_refused_connection_says_it_gave_up_at_once(tmp_path):
    passwd = tmp_path / "passwd"
    run_tool(["mosquitto_passwd", "-b", "-c", str(passwd), "dev", "right"])
    port = free_port()
    listener = f"listener {port} 127.0.0.1\nallow_anonymous false\npassword_file {passwd}\n"
    with ManagedBroker(tmp_path / "broker", port, listener_conf=listener):
        t0 = time.monotonic()
        with pytest.raises(ProtocolError) as info:
            MqttLink(f"mqtt://dev:wrong@127.0.0.1:{port}", "dev").connect(30)
        waited = time.monotonic() - t0
    text = str(info.value)
    assert waited < 10, text
    assert "within 30" not in text and "30 s" not in text, text
    assert "gave up after" in text and "check the password" in text, text


def _server(url: str, tmp_path, max_bytes: int) -> AggregationServer:
    cfg = ServerConfig(
        broker_url=url,
        state_dir=tmp_path / "server",
        initial_params=torch.zeros(16),
        fleet=FLEET,
        rounds=1,
        devices={"dev1": "A"},
        max_bytes=max_bytes,
        start_timeout=60,
    )
    return AggregationServer(cfg, make_strategy("selffl"), progress=lambda s: None)


def test_the_broker_never_delivers_the_server_a_message_over_its_limit(tmp_path):
    """A broker without max_packet_size takes an uplink far over the protocol's limit; the
    server's CONNECT announced its maximum packet size, so the broker drops it instead of
    handing it over (the server would read it whole before refusing it)."""
    limit = 1 << 20
    # The largest packet MQTT can carry: the broker itself sets no limit of its own.
    with ManagedBroker(tmp_path / "broker", max_packet=268_435_455) as broker:
        server = _server(broker.url, tmp_path, limit)

        def serve() -> None:
            with contextlib.suppress(ConfigError):  # dev1 never comes online
                server.run()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        sender = MqttLink(broker.url, "sender", clean_start=True, max_payload=64 << 20)
        sender.connect(10)
        try:
            deadline = time.monotonic() + 15
            while server.link is None or not server.link.connected:
                assert time.monotonic() < deadline, "the server did not connect"
                time.sleep(0.05)
            time.sleep(0.3)  # its subscriptions are in place
            up = topics.uplink(FLEET, "dev1")
            sender.publish(up, b"\x00" * (8 * limit))  # the broker itself takes it
            sender.publish(up, b"\x00" * 1000)  # after it, in order: a small malformed one
            deadline = time.monotonic() + 15
            while sum(server.rejections.values()) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
        finally:
            sender.close()
            server.stop_event.set()
            thread.join(30)
    assert not thread.is_alive()
    # Only the small message reached the server: the oversized one was never delivered.
    assert sum(server.rejections.values()) == 1, dict(server.rejections)


def test_a_link_with_a_limit_beyond_mqtts_own_announces_mqtts_largest(mqtt_broker):
    link = MqttLink(mqtt_broker.url, "big", clean_start=True, max_payload=512 << 20).connect(10)
    link.close()


def test_a_broker_refuses_a_port_another_process_holds(tmp_path) -> None:
    """Readiness is "the port accepts": on a port already taken, the broker would fail to
    bind while its clients talked to the other process. It refuses to start instead, and
    ports handed out together are distinct."""
    import socket

    from wakefl.server.broker import free_ports

    ports = free_ports(16)
    assert len(set(ports)) == 16
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        broker = ManagedBroker(tmp_path / "run", port=taken)
        with pytest.raises(ConfigError, match=f"127.0.0.1:{taken} is already taken"):
            broker.start()
        assert not broker.running
    # Once the port is free again the same broker starts and serves.
    broker.start()
    try:
        assert broker.running
    finally:
        broker.stop()
