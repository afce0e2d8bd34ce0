"""The shipped broker config (TLS, passwords, ACL) with a test CA made by openssl: a device
can neither publish as another device nor read another device's traffic."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from wakefl.errors import ProtocolError
from wakefl.protocol import topics
from wakefl.sdk.mqtt_link import MqttLink, PublishError, parse_broker_url
from wakefl.server.broker import ManagedBroker, free_port
from wakefl.server.provisioning import provision

FLEET = "secure"


@pytest.fixture
def secure_broker(tmp_path):
    port = free_port()
    # The shipped config runs as the `mosquitto` user when started as root: the
    # provisioning directory must be reachable by it, which pytest's 0700 tmp_path is not.
    shared = Path(tempfile.mkdtemp(prefix="wakefl-prov-"))
    shared.chmod(0o711)
    prov = shared / "prov"
    a = provision(prov, "dev-a", "speaker", fleet=FLEET, port=port)
    b = provision(prov, "dev-b", "tv", fleet=FLEET, port=port)
    server = json.loads((prov / "server.json").read_text())
    broker = ManagedBroker(tmp_path / "run", port=port, conf_file=prov / "mosquitto.conf").start()
    try:
        yield a, b, server, prov
    finally:
        broker.stop()
        shutil.rmtree(shared, ignore_errors=True)


def _collector(link: MqttLink, topic: str) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    link.subscribe(topic, lambda t, p: got.append((t, p)))
    return got


def test_acl_pins_each_device_to_its_own_topics(secure_broker):
    a_cfg, b_cfg, srv_cfg, prov = secure_broker
    assert "topic write wakefl/secure/up/dev-a" in (prov / "acl").read_text()
    srv = MqttLink(srv_cfg["broker"], "wakefl-server-secure").connect(10)
    a = MqttLink(a_cfg["broker"], "dev-a").connect(10)
    b = MqttLink(b_cfg["broker"], "dev-b").connect(10)
    try:
        srv_up = _collector(srv, topics.uplink_filter(FLEET))
        a_sees = _collector(a, "wakefl/secure/#")  # a tries to read everything
        b_acks = _collector(b, topics.ack(FLEET, "dev-b"))
        b_down = _collector(b, topics.downlink(FLEET))
        time.sleep(0.5)
        # allowed: a on its own uplink; the server on b's ack and the downlink
        a.publish(topics.uplink(FLEET, "dev-a"), b"from-a")
        srv.publish(topics.ack(FLEET, "dev-b"), b"ack-for-b")
        srv.publish(topics.downlink(FLEET), b"down")
        # denied: a posing as b on b's uplink, a writing the downlink or b's ack
        for topic in (
            topics.uplink(FLEET, "dev-b"),
            topics.downlink(FLEET),
            topics.ack(FLEET, "dev-b"),
            topics.hello(FLEET, "dev-b"),
        ):
            with pytest.raises(PublishError) as info:
                a.publish(topic, b"forged")
            assert info.value.code == 0x87
        b.publish(topics.uplink(FLEET, "dev-b"), b"from-b")
        time.sleep(1.0)
    finally:
        for link in (a, b, srv):
            link.close()
    assert sorted(srv_up) == [
        ("wakefl/secure/up/dev-a", b"from-a"),
        ("wakefl/secure/up/dev-b", b"from-b"),
    ]
    assert b_acks == [("wakefl/secure/ack/dev-b", b"ack-for-b")]
    assert b_down == [("wakefl/secure/down", b"down")]
    # a read only the downlink: neither b's ack nor b's (nor its own) uplink
    assert [t for t, _ in a_sees] == ["wakefl/secure/down"]


def test_wrong_password_plain_tcp_and_unknown_ca_are_refused(secure_broker, tmp_path):
    a_cfg, _, _, prov = secure_broker
    url = parse_broker_url(a_cfg["broker"])
    bad_pw = f"mqtts://dev-a:wrong@{url.host}:{url.port}?ca={url.ca_file}"
    # Refused credentials and an untrusted certificate end the wait at once, with the cause
    # (a wait of 400 s would run into the test's timeout).
    with pytest.raises(ProtocolError, match="refused the connection.*check the password"):
        MqttLink(bad_pw, "dev-a").connect(400)
    no_ca = f"mqtts://dev-a:{a_cfg['password']}@{url.host}:{url.port}"
    with pytest.raises(ProtocolError, match=r"not trusted.*\?ca=ca.crt"):
        MqttLink(no_ca, "dev-a").connect(400)
    with pytest.raises(ProtocolError):  # no TLS on a TLS-only listener
        MqttLink(f"mqtt://dev-a:{a_cfg['password']}@{url.host}:{url.port}", "dev-a").connect(3)
    other_ca = tmp_path / "other"
    other_ca.mkdir()
    from wakefl.server.broker_pki import ensure_ca

    ensure_ca(other_ca, "127.0.0.1")
    with pytest.raises(ProtocolError, match="not trusted"):  # a certificate it did not sign
        MqttLink(
            f"mqtts://dev-a:{a_cfg['password']}@{url.host}:{url.port}?ca={other_ca / 'ca.crt'}",
            "dev-a",
        ).connect(3)


def test_stolen_device_password_cannot_take_over_another_client_id(secure_broker):
    """The broker binds the client id to the username (use_username_as_clientid): dev-a's
    credentials used with the server's or dev-b's client id only ever reach dev-a's own
    session, so the real server and dev-b stay connected."""
    a_cfg, b_cfg, srv_cfg, prov = secure_broker
    assert "use_username_as_clientid true" in (prov / "mosquitto.conf").read_text()
    srv = MqttLink(srv_cfg["broker"], "wakefl-server-secure").connect(10)
    b = MqttLink(b_cfg["broker"], "dev-b").connect(10)
    try:
        for victim in ("wakefl-server-secure", "wakefl-server", "dev-b") * 3:
            thief = MqttLink(a_cfg["broker"], victim, clean_start=True).connect(10)
            time.sleep(0.2)
            thief.close()
        time.sleep(0.5)
        assert srv.connected and b.connected
        assert srv.connects == 1 and b.connects == 1  # never kicked off, never reconnected
    finally:
        for link in (b, srv):
            link.close()


def test_password_file_is_private(secure_broker):
    _, _, _, prov = secure_broker
    assert (prov / "passwd").stat().st_mode & 0o777 == 0o600


def test_embedded_broker_with_passwords_binds_client_ids(tmp_path):
    broker = ManagedBroker(tmp_path / "b", extra_conf=f"password_file {tmp_path / 'passwd'}\n")
    broker._write_conf()
    assert "use_username_as_clientid true" in broker.conf_path.read_text()
    anon = ManagedBroker(tmp_path / "anon")
    anon._write_conf()
    assert "use_username_as_clientid" not in anon.conf_path.read_text()
