"""The device client against a real mosquitto on 127.0.0.1, with the server's side of the
protocol played by the test (so each rule can be provoked: a lost ack, a crash between
training and the ack, a round the device is not sampled for, the end of the run)."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import torch
from device_sim import ARGS, FakeServer, ToneDataset, make_client, start_run, wait_until

from wakefl.models.kws_cnn import get_flat_params
from wakefl.protocol import messages, topics
from wakefl.sdk.device_state import DeviceStateStore
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.server.broker import ManagedBroker


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with ManagedBroker(tmp_path_factory.mktemp("broker")) as b:
        yield b


def test_round_trip_resend_and_run_end(tmp_path, broker):
    server = FakeServer(broker.url, "f1")
    # The broker still holds the end of an earlier run: a new device does not leave on it.
    server.downlink(7, [], final=True, run_id="run0")
    lines: list[str] = []
    client = make_client(tmp_path, broker, "f1", progress=lines.append)
    th, out = start_run(client)
    try:
        hello = server.hellos.get(timeout=20)
        assert (hello.device_id, hello.device_type, hello.num_samples, hello.online) == (
            "dev1",
            "A",
            8,
            True,
        )

        server.downlink(1, ["dev1"])
        up = server.next_uplink()
        assert (up.device_id, up.device_type, up.round_id, up.run_id) == ("dev1", "A", 1, "run1")
        assert up.params.numel() == server.initial.numel()
        assert up.record["local_steps"] == ARGS["warmup_steps"]  # t_m < 2: warm-up steps
        assert not torch.equal(up.params, server.initial)  # it trained
        assert up.num_samples == 8 and up.relative_fr is not None and up.relative_fa is not None
        # No ack: the same update comes again after the ack timeout.
        again = server.next_uplink(timeout=10)
        assert again.round_id == 1 and torch.equal(again.params, up.params)
        server.ack("dev1", 1)
        assert wait_until(lambda: DeviceStateStore(tmp_path / "dev1").load().last_acked_round == 1)

        # Round 2 does not sample dev1: no uplink.
        server.downlink(2, ["other"])
        with pytest.raises(queue.Empty):
            server.next_uplink(timeout=2)
        # A redelivered round-1 downlink does not make it train again.
        server.downlink(1, ["dev1"])
        with pytest.raises(queue.Empty):
            server.next_uplink(timeout=2)

        server.downlink(3, ["dev1"])
        up3 = server.next_uplink()
        assert up3.round_id == 3
        server.ack("dev1", 3, accepted=True, reason="duplicate")
        server.downlink(3, [], final=True)
        th.join(30)
        assert not th.is_alive() and "error" not in out
        summary = out["summary"]
        assert summary.finished and summary.updates_accepted == 2 and summary.rounds_trained == 2
        state = DeviceStateStore(tmp_path / "dev1").load()
        assert state.finished and state.participations == 2 and state.pending is None
        assert state.client.scalars["t_m"] == 2.0
        assert torch.equal(state.personal_params, up3.params)
        assert torch.equal(state.baseline_params, server.initial)
        assert state.last_acked_round == 3
        # each round's line says why it ran that many local steps (Eqn 16's inputs, the cap)
        rounds = {rid: [x for x in lines if f": round {rid}: " in x] for rid in (1, 3)}
        assert any(
            "2 local steps, " in x
            and "(local steps: warm-up until it has a variance of its own (warmup_steps=2, "
            "cap l_max=3)) in "
            in x
            for x in rounds[1]
        ), lines
        assert any(
            "3 local steps, " in x
            and "(local steps: the cap l_max=3: no precision S_-m of other devices yet for "
            "Eqn 16) in "
            in x
            for x in rounds[3]
        ), lines
    finally:
        client.stop()
        th.join(10)
        client.close()
        server.close()


def test_restart_resends_saved_update_without_training_again(tmp_path, broker):
    server = FakeServer(broker.url, "f2")
    first = make_client(tmp_path, broker, "f2", max_sends=1)
    th, out = start_run(first)
    try:
        server.downlink(1, ["dev1"])
        up = server.next_uplink()
        # The device gives up (max_sends=1, no ack); the process "dies" now.
        first.stop()
        th.join(20)
        first.close()
        saved = DeviceStateStore(tmp_path / "dev1").load()
        assert saved.pending is not None and saved.pending.round_id == 1
        assert saved.participations == 1

        second = make_client(tmp_path, broker, "f2")
        th2, out2 = start_run(second)
        # The retained downlink of the open round arrives again: the saved update goes out.
        again = server.next_uplink()
        assert again.round_id == 1 and torch.equal(again.params, up.params)
        server.ack("dev1", 1)
        assert wait_until(lambda: DeviceStateStore(tmp_path / "dev1").load().pending is None)
        assert DeviceStateStore(tmp_path / "dev1").load().participations == 1  # trained once
        server.downlink(1, [], final=True)
        th2.join(20)
        assert out2["summary"].finished
        second.close()
    finally:
        first.stop()
        server.close()


def test_refused_update_is_dropped_and_state_folder_is_locked(tmp_path, broker):
    server = FakeServer(broker.url, "f3")
    client = make_client(tmp_path, broker, "f3")
    from wakefl.errors import ConfigError

    with pytest.raises(ConfigError, match="in use"):
        make_client(tmp_path, broker, "f3")
    th, out = start_run(client)
    try:
        server.downlink(1, ["dev1"])
        server.next_uplink()
        server.ack("dev1", 1, accepted=False, reason="stale_round")
        assert wait_until(lambda: DeviceStateStore(tmp_path / "dev1").load().pending is None)
        assert DeviceStateStore(tmp_path / "dev1").load().last_acked_round == 0
        # The same round announced again: trained once already, so nothing is sent.
        server.downlink(1, ["dev1"])
        with pytest.raises(queue.Empty):
            server.next_uplink(timeout=2)
        assert DeviceStateStore(tmp_path / "dev1").load().participations == 1
        server.downlink(1, [], final=True)
        th.join(20)
        assert out["summary"].updates_accepted == 0
    finally:
        client.stop()
        th.join(10)
        client.close()
        server.close()


def test_diverging_training_is_refused_and_the_state_kept(tmp_path, broker):
    server = FakeServer(broker.url, "f5")
    client = make_client(tmp_path, broker, "f5")
    th, out = start_run(client)
    try:
        server.downlink(1, ["dev1"])
        first = server.next_uplink()
        server.ack("dev1", 1)
        assert wait_until(lambda: DeviceStateStore(tmp_path / "dev1").load().last_acked_round == 1)
        # A learning rate that overflows the parameters to Inf.
        server.downlink(2, ["dev1"], args={**ARGS, "lr": 1e38})
        with pytest.raises(queue.Empty):
            server.next_uplink(timeout=3)
        state = DeviceStateStore(tmp_path / "dev1").load()
        assert state.participations == 1 and state.pending is None
        assert torch.equal(state.personal_params, first.params)
        assert bool(torch.isfinite(state.client.tensors["rv_mean"]).all())
        # the server is told it need not wait for this device's update
        decline = server.declines.get(timeout=10)
        assert (decline.device_id, decline.round_id, decline.run_id) == ("dev1", 2, "run1")
        assert "training refused" in decline.reason
        server.downlink(2, ["dev1"], args={**ARGS, "lr": 1e38})  # redelivered: no second decline
        with pytest.raises(queue.Empty):
            server.declines.get(timeout=2)
        server.downlink(2, [], final=True)
        th.join(20)
        assert out["summary"].finished
        assert any("training refused" in o.note for o in out["summary"].outcomes)
    finally:
        client.stop()
        th.join(10)
        client.close()
        server.close()


def test_acks_for_other_messages_are_ignored(tmp_path, broker):
    """Garbage (or a forged update) on up/D draws a refusal ack for D's round: D must not
    drop its own valid update on it, only on an ack that answers its own bytes."""
    server = FakeServer(broker.url, "f6")
    client = make_client(tmp_path, broker, "f6", max_sends=3)
    th, out = start_run(client)
    try:
        server.downlink(1, ["dev1"])
        up = server.next_uplink()
        mine = server.last_id["dev1"]
        server.ack(
            "dev1", 1, accepted=False, reason="malformed", answers=messages.message_id(b"garbage")
        )
        server.ack("dev1", 1, accepted=False, reason="stale_round", answers="")
        again = server.next_uplink(timeout=10)  # still pending: re-sent after the ack timeout
        assert torch.equal(again.params, up.params) and server.last_id["dev1"] == mine
        assert DeviceStateStore(tmp_path / "dev1").load().pending is not None
        server.ack("dev1", 1, answers=mine)
        assert wait_until(lambda: DeviceStateStore(tmp_path / "dev1").load().last_acked_round == 1)
        server.downlink(1, [], final=True)
        th.join(20)
        assert out["summary"].updates_accepted == 1
    finally:
        client.stop()
        th.join(10)
        client.close()
        server.close()


def test_restart_resends_at_once_and_counts_attempts(tmp_path, broker):
    """A restarted device re-sends its unacknowledged update without waiting for a
    downlink (here the broker holds none), and the sends are counted across restarts."""
    server = FakeServer(broker.url, "f7")
    first = make_client(tmp_path, broker, "f7", max_sends=2)
    th, out = start_run(first)
    try:
        server.downlink(1, ["dev1"])
        up = server.next_uplink()
        server.next_uplink(timeout=10)
        assert wait_until(lambda: DeviceStateStore(tmp_path / "dev1").load().pending.attempts == 2)
        first.stop()
        th.join(20)
        first.close()
        server.link.publish(topics.downlink("f7"), b"", retain=True)  # no retained downlink
        second = make_client(tmp_path, broker, "f7", max_sends=4)
        th2, out2 = start_run(second)
        again = server.next_uplink(timeout=15)
        assert again.round_id == 1 and torch.equal(again.params, up.params)
        assert wait_until(lambda: DeviceStateStore(tmp_path / "dev1").load().pending.attempts >= 3)
        server.ack("dev1", 1)
        assert wait_until(lambda: DeviceStateStore(tmp_path / "dev1").load().pending is None)
        assert DeviceStateStore(tmp_path / "dev1").load().participations == 1
        second.stop()
        th2.join(20)
        assert out2["summary"].updates_accepted == 1
        second.close()
    finally:
        first.stop()
        server.close()


def test_export_personal_model_and_onnx_for_the_edge_runtime(tmp_path, broker):
    from wakefl.edge_runtime import OnnxScorer
    from wakefl.models.kws_cnn import load_model

    server = FakeServer(broker.url, "f4")
    client = make_client(tmp_path, broker, "f4")
    th, out = start_run(client)
    try:
        server.downlink(1, ["dev1"])
        up = server.next_uplink()
        server.ack("dev1", 1)
        server.downlink(1, [], final=True)
        th.join(30)
        assert out["summary"].finished
        ckpt = client.export_personal_model(tmp_path / "personal.safetensors")
        assert torch.equal(get_flat_params(load_model(ckpt)), up.params)
        onnx_path = client.export_onnx(tmp_path / "personal.onnx")
        scorer = OnnxScorer(str(onnx_path))
        waves = np.stack([ToneDataset(4, 5)[i][0].numpy() for i in range(4)])
        with torch.no_grad():
            expected = client.served_model().predict_proba(torch.from_numpy(waves)).numpy()
        np.testing.assert_allclose(scorer.score(waves), expected, atol=1e-4)
    finally:
        client.stop()
        th.join(10)
        client.close()
        server.close()


def _retained_hello(url: str, fleet: str, device: str) -> messages.Hello | None:
    """What a server subscribing now reads for the device: the broker's retained Hello."""
    got: list[messages.Hello] = []
    link = MqttLink(url, f"late-{fleet}", clean_start=True, session_expiry=0).connect()
    try:
        link.subscribe(
            topics.hello(fleet, device),
            lambda t, p: got.append(messages.decode_as(p, messages.Hello)),
        )
        wait_until(lambda: bool(got), 5)
        return got[-1] if got else None
    finally:
        link.close()


def test_a_server_subscribing_again_reads_the_device_online_not_its_older_will(tmp_path, broker):
    """A broker that shuts down sends every device's will (offline, retained). After the
    restart a device's Hello can arrive before the server has subscribed again, and the
    new subscription then delivers what the broker retains: it must be that Hello."""
    fleet = "f11"
    server = FakeServer(broker.url, fleet)
    will = messages.Hello(fleet, "dev1", "A", 8, online=False)
    server.link.publish(topics.hello(fleet, "dev1"), messages.encode(will), retain=True)
    client = make_client(tmp_path, broker, fleet)
    th, out = start_run(client)
    try:
        assert wait_until(lambda: server.hellos.get(timeout=1).online), "no online Hello"
        late = _retained_hello(broker.url, fleet, "dev1")
        assert late is not None and late.online and late.num_samples == 8
        client.stop()
        th.join(20)
        client.close()  # leaving says so, retained too
        gone = _retained_hello(broker.url, fleet, "dev1")
        assert gone is not None and not gone.online
    finally:
        client.stop()
        server.link.publish(topics.hello(fleet, "dev1"), b"", retain=True)
        server.close()


def test_embedding_example_runs(tiny_corpus, tmp_path):
    """tools/examples/device_app.py (the README's "Embedding the SDK") runs end to end from
    the shipped model, keeps the model it exports, and detects at that model's threshold."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from wakefl.edge_runtime import OnnxScorer
    from wakefl.models.kws_cnn.pretrained import pretrained_card

    script = Path(__file__).resolve().parents[1] / "tools" / "examples" / "device_app.py"
    out = tmp_path / "kept" / "served.onnx"
    argv = [sys.executable, str(script), "--type", "B", "--model", "small", "--rounds", "1"]
    res = subprocess.run(
        [*argv, "--data", str(tiny_corpus), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "took part in 1 round(s); 1 update(s) accepted" in res.stdout, res.stdout
    assert f"served model exported: {out}" in res.stdout and "streamed" in res.stdout
    assert "serving the " in res.stdout and "than served" not in res.stdout, res.stdout
    threshold = pretrained_card("small")["threshold"]
    assert OnnxScorer(out).shipped_threshold == threshold  # kept, with the shipped threshold
    assert f"detecting at threshold {threshold:.4f}" in res.stdout, res.stdout
    # Its default corpus is the demo's; without it, one line says what to do.
    env = {**os.environ, "WAKEFL_CACHE": str(tmp_path / "empty-cache")}
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode != 0 and "scripts/demo.sh" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
