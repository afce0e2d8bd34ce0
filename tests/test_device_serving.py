"""The device's served model and its state folder under faults: corrupt local audio, a
sabotaged personal model the gate never serves, an unreadable state folder, a refusal by
the server; against a real mosquitto on 127.0.0.1 with the server's half played by the
test (device_sim.py)."""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
import torch
from device_sim import ARGS, CFG, FakeServer, ToneDataset, make_client, start_run, wait_until

from wakefl.models.kws_cnn import KwsCnn, get_flat_params
from wakefl.protocol import topics
from wakefl.sdk.device_client import DeviceClient
from wakefl.sdk.device_state import DeviceStateStore
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.server.broker import ManagedBroker


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with ManagedBroker(tmp_path_factory.mktemp("broker")) as b:
        yield b


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
    th, out = start_run(client)
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
            assert wait_until(
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
    client = make_client(tmp_path, broker, f"f9{broken}")  # starts: the error is kept
    th, out = start_run(client)
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
    client = make_client(tmp_path, broker, fleet)
    th, out = start_run(client)
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
