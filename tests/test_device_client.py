"""The device client against a real mosquitto on 127.0.0.1, with the server's side of the
protocol played by the test (so each rule can be provoked: a lost ack, a crash between
training and the ack, a round the device is not sampled for, the end of the run)."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from wakefl.models.kws_cnn import KwsCnn, ModelConfig, get_flat_params
from wakefl.protocol import messages, topics
from wakefl.protocol.round_settings import RoundSettings
from wakefl.sdk.device_client import DeviceClient
from wakefl.sdk.device_state import DeviceStateStore
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.server.broker import ManagedBroker

WIDTH = 0.05
CFG = ModelConfig(width=WIDTH)
ARGS = {"lr": 0.05, "batch_size": 4, "l_max": 3, "warmup_steps": 2}


class ToneDataset(Dataset):
    """Wake word = a 440 Hz tone in noise, other = noise: a learnable local task."""

    def __init__(self, n: int, seed: int) -> None:
        g = np.random.default_rng(seed)
        t = np.arange(CFG.window_samples) / CFG.sample_rate
        self.labels = np.array([i % 2 for i in range(n)], dtype=np.int64)
        self.waves = [
            (0.05 * g.standard_normal(t.size) + 0.3 * lab * np.sin(2 * np.pi * 440 * t)).astype(
                np.float32
            )
            for lab in self.labels
        ]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return torch.from_numpy(self.waves[i]), int(self.labels[i])


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with ManagedBroker(tmp_path_factory.mktemp("broker")) as b:
        yield b


class FakeServer:
    """The server's half of docs/PROTOCOL.md, scripted by the test."""

    def __init__(self, url: str, fleet: str) -> None:
        self.fleet = fleet
        self.uplinks: queue.Queue[messages.Uplink] = queue.Queue()
        self.declines: queue.Queue[messages.Decline] = queue.Queue()
        self.last_id: dict[str, str] = {}  # device -> message_id of its latest uplink
        self.hellos: queue.Queue[messages.Hello] = queue.Queue()
        self.link = MqttLink(url, f"server-{fleet}", clean_start=True).connect()
        self.link.subscribe(topics.uplink_filter(fleet), self._up)
        self.link.subscribe(topics.hello_filter(fleet), self._hello)
        # A fixed start: with 4 validation negatives, a random start may false-accept none
        # of them while the trained model accepts one, and relative FA is then unbounded
        # (None) by design, which the round-trip test does not expect.
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.initial = get_flat_params(KwsCnn(CFG))

    def _up(self, topic, payload):
        msg = messages.decode(payload)
        self.last_id[msg.device_id] = messages.message_id(payload)
        (self.declines if isinstance(msg, messages.Decline) else self.uplinks).put(msg)

    def _hello(self, topic, payload):
        if payload:  # an empty retained message clears the topic
            self.hellos.put(messages.decode_as(payload, messages.Hello))

    def downlink(
        self,
        round_id: int,
        sampled: list[str],
        final: bool = False,
        deadline_s: float = 60.0,
        run_id: str = "run1",
        args: dict | None = None,
    ) -> None:
        msg = messages.Downlink(
            fleet=self.fleet,
            run_id=run_id,
            round_id=round_id,
            global_params=self.initial,
            model_config=CFG.to_dict(),
            instructions={d: {"sigma0_sq": 0.0, "others_precision": 0.0} for d in sampled},
            settings=RoundSettings(
                strategy="selffl", strategy_args=args or ARGS, ack_timeout_s=1.0, wire_dtype="fp32"
            ),
            deadline=time.time() + deadline_s,
            final=final,
        )
        self.link.publish(topics.downlink(self.fleet), messages.encode(msg), retain=True)

    def ack(
        self,
        device: str,
        round_id: int,
        accepted: bool = True,
        reason: str = "",
        answers: str | None = None,
    ) -> None:
        """Ack the device's latest uplink (or the message id `answers`)."""
        answers = self.last_id.get(device, "") if answers is None else answers
        self.link.publish(
            topics.ack(self.fleet, device),
            messages.encode(
                messages.Ack(
                    fleet=self.fleet,
                    device_id=device,
                    round_id=round_id,
                    accepted=accepted,
                    reason=reason,
                    answers=answers,
                )
            ),
        )

    def next_uplink(self, timeout: float = 30.0) -> messages.Uplink:
        return self.uplinks.get(timeout=timeout)

    def close(self) -> None:
        # Clear the retained downlink so the next test's fleet starts clean.
        self.link.publish(topics.downlink(self.fleet), b"", retain=True)
        self.link.close()


def _start(client: DeviceClient, **kw):
    out: dict = {}

    def target():
        try:
            out["summary"] = client.run(**kw)
        except BaseException as exc:  # surfaced by the test
            out["error"] = exc

    th = threading.Thread(target=target, daemon=True)
    th.start()
    return th, out


def _client(tmp_path, broker, fleet, device="dev1", **kw) -> DeviceClient:
    return DeviceClient(
        device,
        "A",
        ToneDataset(8, 1),
        tmp_path / device,
        validation=ToneDataset(8, 2),
        broker_url=broker.url,
        fleet=fleet,
        ack_timeout_s=1.0,
        **kw,
    )


def test_round_trip_resend_and_run_end(tmp_path, broker):
    server = FakeServer(broker.url, "f1")
    # The broker still holds the end of an earlier run: a new device does not leave on it.
    server.downlink(7, [], final=True, run_id="run0")
    lines: list[str] = []
    client = _client(tmp_path, broker, "f1", progress=lines.append)
    th, out = _start(client)
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
        assert _wait(lambda: DeviceStateStore(tmp_path / "dev1").load().last_acked_round == 1)

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
    first = _client(tmp_path, broker, "f2", max_sends=1)
    th, out = _start(first)
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

        second = _client(tmp_path, broker, "f2")
        th2, out2 = _start(second)
        # The retained downlink of the open round arrives again: the saved update goes out.
        again = server.next_uplink()
        assert again.round_id == 1 and torch.equal(again.params, up.params)
        server.ack("dev1", 1)
        assert _wait(lambda: DeviceStateStore(tmp_path / "dev1").load().pending is None)
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
    client = _client(tmp_path, broker, "f3")
    from wakefl.errors import ConfigError

    with pytest.raises(ConfigError, match="in use"):
        _client(tmp_path, broker, "f3")
    th, out = _start(client)
    try:
        server.downlink(1, ["dev1"])
        server.next_uplink()
        server.ack("dev1", 1, accepted=False, reason="stale_round")
        assert _wait(lambda: DeviceStateStore(tmp_path / "dev1").load().pending is None)
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
    client = _client(tmp_path, broker, "f5")
    th, out = _start(client)
    try:
        server.downlink(1, ["dev1"])
        first = server.next_uplink()
        server.ack("dev1", 1)
        assert _wait(lambda: DeviceStateStore(tmp_path / "dev1").load().last_acked_round == 1)
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
    client = _client(tmp_path, broker, "f6", max_sends=3)
    th, out = _start(client)
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
        assert _wait(lambda: DeviceStateStore(tmp_path / "dev1").load().last_acked_round == 1)
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
    first = _client(tmp_path, broker, "f7", max_sends=2)
    th, out = _start(first)
    try:
        server.downlink(1, ["dev1"])
        up = server.next_uplink()
        server.next_uplink(timeout=10)
        assert _wait(lambda: DeviceStateStore(tmp_path / "dev1").load().pending.attempts == 2)
        first.stop()
        th.join(20)
        first.close()
        server.link.publish(topics.downlink("f7"), b"", retain=True)  # no retained downlink
        second = _client(tmp_path, broker, "f7", max_sends=4)
        th2, out2 = _start(second)
        again = server.next_uplink(timeout=15)
        assert again.round_id == 1 and torch.equal(again.params, up.params)
        assert _wait(lambda: DeviceStateStore(tmp_path / "dev1").load().pending.attempts >= 3)
        server.ack("dev1", 1)
        assert _wait(lambda: DeviceStateStore(tmp_path / "dev1").load().pending is None)
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
    client = _client(tmp_path, broker, "f4")
    th, out = _start(client)
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
        _wait(lambda: bool(got), 5)
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
    client = _client(tmp_path, broker, fleet)
    th, out = _start(client)
    try:
        assert _wait(lambda: server.hellos.get(timeout=1).online), "no online Hello"
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


def _wait(pred, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if pred():
                return True
        except Exception:
            pass
        time.sleep(0.05)
    return False


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


def test_truncated_wav_in_local_data_is_refused_with_a_clear_error(tmp_path):
    import soundfile as sf

    from wakefl.errors import AudioError
    from wakefl.sdk.dataset import WakeWordDataset
    from wakefl.sdk.manifest import ManifestRow, write_manifest

    (tmp_path / "clips").mkdir()
    rows = []
    for i in range(2):
        sf.write(
            tmp_path / "clips" / f"c{i}.wav",
            np.full(24000, 0.1, np.float32),
            16000,
            subtype="PCM_16",
        )
        rows.append(
            ManifestRow(f"clips/c{i}.wav", i % 2, "A", "normal", "s1", "train", 1.5, "clip")
        )
    manifest = write_manifest(rows, tmp_path / "manifest.csv")
    assert len(WakeWordDataset(manifest, "A", "train")) == 2
    whole = (tmp_path / "clips" / "c1.wav").read_bytes()
    (tmp_path / "clips" / "c1.wav").write_bytes(whole[:100])  # a copy cut short
    with pytest.raises(AudioError, match="truncated WAV"):
        WakeWordDataset(manifest, "A", "train")


class FlippedTones(ToneDataset):
    """The tone task with every label flipped: a sabotaged device's training data."""

    def __getitem__(self, i: int):
        wave, label = super().__getitem__(i)
        return wave, 1 - label

    @property
    def flipped_labels(self):
        return 1 - self.labels


def _tone_model(seed: int = 0) -> torch.Tensor:
    """A warm start that has learnt the tone task (the shipped model's stand-in)."""
    torch.manual_seed(seed)
    model = KwsCnn(CFG)
    ds = ToneDataset(32, 11)
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    y = torch.as_tensor(ds.labels)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(30):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return get_flat_params(model).detach().clone()


def test_sabotaged_personal_model_is_never_served_and_the_uplink_says_so(tmp_path, broker):
    from wakefl.protocol.records import check_record
    from wakefl.sdk.selffl.selffl_strategy import SelfFL
    from wakefl.sdk.served_model_gate import with_gate_schema

    server = FakeServer(broker.url, "f8")
    server.initial = _tone_model()
    client = DeviceClient(
        "dev1",
        "A",
        FlippedTones(32, 1),  # trained on label-flipped clips
        tmp_path / "dev1",
        validation=ToneDataset(40, 2),
        broker_url=broker.url,
        fleet="f8",
        ack_timeout_s=1.0,
    )
    # long enough local training, at a rate that learns the flipped labels: a rate so high
    # that the model collapses to near-constant scores can keep the ranking (and so be no
    # worse at matched FR), which is not the sabotage this test is about
    args = {**ARGS, "lr": 0.1, "warmup_steps": 32, "l_max": 32, "max_local_epochs": None}
    th, out = _start(client)
    try:
        for rid in (1, 2):
            server.downlink(rid, ["dev1"], args=args)
            up = server.next_uplink()
            server.ack("dev1", rid)
            # the personalized model is worse on the device's own clips (None: unbounded,
            # the baseline makes no false accept there) ...
            worse = [x is None or x > 1.0 for x in (up.relative_fa, up.relative_fr)]
            assert any(worse), (up.relative_fa, up.relative_fr)
            # ... and the uplink carries the gate's decision: kept, personalized not admissible
            assert up.record["gate_switched"] == 0.0 and up.record["gate_choice"] == 0.0
            assert up.record["gate_personalized_admissible"] == 0.0
            assert up.record["gate_served_relative_fa"] == 1.0  # still the baseline
            # a server running Self-FL with the gate's scalars merged in accepts the record
            check_record(up.record, with_gate_schema(SelfFL.uplink_schema), "uplink")
            assert _wait(
                lambda rid=rid: DeviceStateStore(tmp_path / "dev1").load().last_acked_round == rid
            )
        server.downlink(2, [], final=True)
        th.join(30)
        summary = out["summary"]
        assert summary.finished and summary.served["model"] == "baseline"
        assert summary.gate["switched"] is False and "personalized" in summary.gate["reason"]
        state = DeviceStateStore(tmp_path / "dev1").load()
        assert state.served_name == "baseline" and torch.equal(state.served_params, server.initial)
        assert not torch.equal(state.personal_params, server.initial)
        # what the device exports for detection is the served model, not the sabotaged one
        assert torch.equal(client.served_params(), server.initial)
        onnx_path = client.export_onnx(tmp_path / "served.onnx")
        from wakefl.edge_runtime import OnnxScorer

        waves = np.stack([ToneDataset(4, 5)[i][0].numpy() for i in range(4)])
        with torch.no_grad():
            expected = client.served_model().predict_proba(torch.from_numpy(waves)).numpy()
        np.testing.assert_allclose(OnnxScorer(str(onnx_path)).score(waves), expected, atol=1e-4)
    finally:
        client.stop()
        th.join(10)
        client.close()
        server.close()


@pytest.mark.parametrize("broken", ["corrupt", "permission"])
def test_unreadable_state_declines_the_first_sampled_round_then_fails(
    tmp_path, broker, monkeypatch, broken
):
    from wakefl.errors import ConfigError
    from wakefl.sdk import device_state

    folder = tmp_path / "dev1"
    folder.mkdir()
    if broken == "corrupt":
        (folder / "state.json").write_text('{"format": 2, "generat')
        want = ConfigError
    else:

        def denied(directory):
            raise PermissionError(13, "Permission denied", str(directory / ".lock"))

        monkeypatch.setattr(device_state, "lock_folder", denied)
        want = PermissionError
    server = FakeServer(broker.url, f"f9{broken}")
    client = _client(tmp_path, broker, f"f9{broken}")  # starts: the error is kept
    th, out = _start(client)
    try:
        assert server.hellos.get(timeout=20).online  # it joined the fleet
        server.downlink(1, ["other"])  # not sampled: nothing to say yet
        with pytest.raises(queue.Empty):
            server.declines.get(timeout=2)
        assert th.is_alive()
        server.downlink(2, ["dev1"])
        decline = server.declines.get(timeout=20)
        assert (decline.device_id, decline.round_id, decline.run_id) == ("dev1", 2, "run1")
        assert decline.reason.startswith("state unreadable: ")
        th.join(20)
        assert not th.is_alive() and isinstance(out.get("error"), want)
        with pytest.raises(queue.Empty):
            server.uplinks.get(timeout=0.5)
        if broken == "corrupt":  # never written over: the folder is left for inspection
            assert (folder / "state.json").read_text() == '{"format": 2, "generat'
    finally:
        client.stop()
        th.join(10)
        client.close()
        server.close()


@pytest.mark.parametrize(
    ("registry", "reason"),
    [({"dev1": "B"}, "wrong_device_type"), ({"other": "A"}, "unknown_device")],
)
def test_a_device_the_server_refuses_says_why_and_stops(tmp_path, broker, registry, reason):
    """The real server refuses the Hello of a device with the wrong type, or one not in its
    fleet, and acks the refusal: the device ends its run naming the reason instead of
    waiting, round after round, for a round that never samples it."""
    import contextlib

    from wakefl.errors import ConfigError, ProtocolError
    from wakefl.sdk.selffl.registry import make_strategy
    from wakefl.server.aggregation_server import AggregationServer, ServerConfig

    fleet = f"refuse-{reason.replace('_', '-')}"
    cfg = ServerConfig(
        broker_url=broker.url,
        state_dir=tmp_path / "server",
        initial_params=get_flat_params(KwsCnn(CFG)),
        model_config=CFG.to_dict(),
        fleet=fleet,
        rounds=1,
        round_timeout=30,
        devices=registry,
        strategy_args=ARGS,
        start_timeout=15,  # then the server gives up waiting for its fleet and returns
    )
    server = AggregationServer(cfg, make_strategy("selffl", **ARGS), progress=lambda s: None)

    def serve() -> None:
        with contextlib.suppress(ConfigError):  # no device of its fleet ever came online
            server.run()

    sth = threading.Thread(target=serve, daemon=True)
    sth.start()
    client = _client(tmp_path, broker, fleet)
    th, out = _start(client)
    try:
        th.join(60)
        assert not th.is_alive()
        err = out.get("error")
        assert isinstance(err, ProtocolError), out
        assert f"the server refuses device dev1: {reason}" in str(err)
    finally:
        client.stop()
        th.join(10)
        client.close()
        sth.join(30)
        cleaner = MqttLink(broker.url, "cleaner", clean_start=True).connect()
        cleaner.publish(topics.hello(fleet, "dev1"), b"", retain=True)
        cleaner.close()
