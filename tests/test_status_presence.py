"""`wakefl status` says a device is online only when it was heard from recently (issue #50,
item 4): a device and a server that both exited leave "online" on record, since the
device's offline Hello found no server to read it. The real server against a real
mosquitto on 127.0.0.1."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from wakefl.errors import ConfigError
from wakefl.protocol import messages, topics
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.sdk.selffl.registry import make_strategy
from wakefl.server.aggregation_server import AggregationServer, ServerConfig
from wakefl.tools.cli import main
from wakefl.tools.fleet.status import age_text, format_status, is_online, read_status

FLEET = "presence"


@pytest.mark.parametrize(
    ("said_online", "last_seen", "now", "within", "online"),
    [
        (True, 100.0, 150.0, 60.0, True),
        (True, 100.0, 160.0, 60.0, True),
        (True, 100.0, 161.0, 60.0, False),  # heard from too long ago
        (False, 100.0, 101.0, 60.0, False),  # its will or clean-exit Hello came
        (True, None, 101.0, 60.0, False),  # never heard from
    ],
)
def test_online_is_a_recent_online_hello(said_online, last_seen, now, within, online):
    assert is_online(said_online, last_seen, now, within) is online


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "never"), (0.4, "0 s"), (119, "119 s"), (600, "10 min"), (7300, "2 h"), (2e5, "2 d")],
)
def test_ages_read_as_a_person_would_say_them(seconds, text):
    assert age_text(seconds) == text


def _hello(link: MqttLink, online: bool) -> None:
    payload = messages.encode(messages.Hello(FLEET, "d1", "A", 10, online=online))
    link.publish(topics.hello(FLEET, "d1"), payload, retain=True)


def test_a_device_gone_with_its_server_is_not_shown_online(mqtt_broker, tmp_path, capsys):
    cfg = ServerConfig(
        broker_url=mqtt_broker.url,
        state_dir=tmp_path / "server",
        initial_params=torch.zeros(8),
        fleet=FLEET,
        rounds=1,
        devices={"d1": "A", "d2": "A"},
        min_clients=2,
        start_timeout=3,  # d2 never comes: the server gives up and exits
    )
    server = AggregationServer(cfg, make_strategy("selffl"), progress=lambda s: None)
    device = MqttLink(mqtt_broker.url, "d1", clean_start=True).connect(10)
    try:
        thread = threading.Thread(target=lambda: _serve(server), daemon=True)
        thread.start()
        deadline = time.monotonic() + 15
        while "d1" not in _online(tmp_path / "server"):
            assert time.monotonic() < deadline, "the server never saw d1 online"
            _hello(device, True)
            time.sleep(0.3)
        thread.join(30)
        assert not thread.is_alive()
        _hello(device, False)  # the device leaves after its server: nobody reads this
    finally:
        device.close()
    time.sleep(1.2)
    st = read_status(tmp_path / "server", online_within_s=1.0)
    d1 = next(d for d in st["devices"] if d["device"] == "d1")
    assert d1["online"] is False and d1["seen_s_ago"] >= 1.0, d1
    text = format_status(st)
    row = next(line for line in text.splitlines() if line.startswith("d1 "))
    assert row.split()[2:5] == ["no", *age_text(d1["seen_s_ago"]).split()], row
    assert "within the last 1 s" in text
    assert main(["status", "--state", str(tmp_path / "server")]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("d1 "))
    assert row.split()[2] == "yes", row  # within the default 600 s it still counts


def _serve(server: AggregationServer) -> None:
    with contextlib.suppress(ConfigError):
        server.run()


def _online(state) -> list[str]:
    from wakefl.server.state_store import StateStore

    if not (state / "server.sqlite").is_file():
        return []
    store = StateStore(state)
    try:
        return store.online_devices()
    finally:
        store.close()
