"""`wakefl server --broker embedded` is provisioned as the production broker is (issue #50,
item 7): TLS, one password per device and the ACL, made under the state folder; a local
process without an account cannot connect, and a device cannot pose as another or forge
the server's downlink. The real server process, a real mosquitto, the real device client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from device_sim import ToneDataset

from wakefl.errors import ConfigError, ProtocolError
from wakefl.protocol import topics
from wakefl.sdk.device_client import DeviceClient
from wakefl.sdk.mqtt_link import MqttLink, PublishError
from wakefl.server.embedded_fleet import provision_embedded

FLEET = "embedded"
WINDOW = 16000


def _server(state: Path) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "wakefl.tools.cli", "server", "--broker", "embedded"]
        + ["--state", str(state), "--fleet", FLEET, "--devices", "d1:A,d2:B"]
        + ["--random-weights", "--width", "0.05", "--rounds", "1", "--min-clients", "1"]
        + ["--round-timeout", "60", "--start-timeout", "120"]
        + ["--strategy-arg", "l_max=2", "--strategy-arg", "batch_size=4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        lines.extend(proc.stdout)

    threading.Thread(target=read, daemon=True).start()
    return proc, lines


def _wait(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_the_embedded_broker_admits_each_device_as_itself_only(tmp_path):
    state = tmp_path / "state"
    proc, lines = _server(state)
    try:
        assert _wait(lambda: any("embedded broker:" in ln for ln in lines), 90), "".join(lines)
        d1 = json.loads((state / "broker" / "devices" / "d1.json").read_text())
        d2 = json.loads((state / "broker" / "devices" / "d2.json").read_text())
        assert (state / "broker" / "devices" / "d1.json").stat().st_mode & 0o777 == 0o600
        assert d1["password"] not in " ".join(proc.args)  # handed over by file, not by ps
        port = int(d1["broker"].rsplit(":", 1)[1].split("?")[0])
        # No account, no connection: neither plain nor TLS without a password.
        with pytest.raises(ProtocolError):
            MqttLink(f"mqtt://127.0.0.1:{port}", "intruder", clean_start=True).connect(3)
        with pytest.raises(ProtocolError):
            MqttLink(
                f"mqtts://127.0.0.1:{port}?ca={d1['ca_file']}", "intruder", clean_start=True
            ).connect(5)
        # d2, with its own password, can neither pose as d1 nor forge the server's downlink.
        thief = MqttLink(d2["broker"], "d2", clean_start=True).connect(10)
        try:
            for topic in (topics.uplink(FLEET, "d1"), topics.downlink(FLEET)):
                with pytest.raises(PublishError) as info:
                    thief.publish(topic, b"forged", retain=topic.endswith("/down"))
                assert info.value.code == 0x87
        finally:
            thief.close()
        # d1 joins with the credentials the server made for it and takes part in the run.
        client = DeviceClient(
            "d1",
            "A",
            ToneDataset(8, 1, samples=WINDOW),
            tmp_path / "d1",
            validation=ToneDataset(8, 2, samples=WINDOW),
            broker_url=d1["broker"],
            fleet=FLEET,
            ack_timeout_s=2.0,
        )
        try:
            summary = client.run(idle_timeout=90)
        finally:
            client.close()
        assert summary.finished and summary.updates_accepted == 1, summary
        assert proc.wait(60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_accounts_are_made_once_and_the_port_kept(tmp_path):
    folder = tmp_path / "broker"
    first = provision_embedded(folder, {"d1": "A"}, FLEET)
    before = first.device_files["d1"].read_text()
    again = provision_embedded(folder, {"d1": "A", "d2": "B"}, FLEET)
    assert again.device_files["d1"].read_text() == before  # d1's config stays valid
    assert again.broker.port == first.broker.port and again.server_url == first.server_url
    assert sorted(again.device_files) == ["d1", "d2"]
    # What the broker runs is rendered from the shipped template each time, whatever
    # another run left in the folder.
    (folder / "mosquitto.conf").write_text("listener 1883\nallow_anonymous true\n")
    conf = provision_embedded(folder, {"d1": "A"}, FLEET).broker.conf_path.read_text()
    assert "allow_anonymous false" in conf and "allow_anonymous true" not in conf
    assert f"acl_file {folder.resolve()}/acl" in conf
    with pytest.raises(ConfigError, match="its own account"):
        provision_embedded(tmp_path / "none", {}, FLEET)
    with pytest.raises(ConfigError, match="not 'other'"):
        provision_embedded(folder, {"d1": "A"}, "other")


def test_the_anonymous_embedded_broker_is_a_named_choice(capsys):
    from wakefl.tools.cli import main

    with pytest.raises(SystemExit):
        main(["server", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "'embedded-anonymous'" in text and "provisioned as production is" in text


def test_an_embedded_broker_without_accounts_is_asked_for_by_name_and_said(tmp_path):
    base = [sys.executable, "-m", "wakefl.tools.cli", "server", "--random-weights"]
    base += ["--width", "0.05", "--rounds", "1", "--start-timeout", "1"]
    refused = subprocess.run(
        [*base, "--broker", "embedded", "--state", str(tmp_path / "a")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "its own account" in refused.stderr, refused.stderr
    chosen = subprocess.run(
        [*base, "--broker", "embedded-anonymous", "--state", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "ANONYMOUS (chosen)" in chosen.stdout, chosen.stdout + chosen.stderr
    assert (tmp_path / "b" / "broker-anonymous" / "mosquitto.conf").is_file()
