"""A refused device, corrected, joins at once (issue #50, item 1): a refusal answers the one
Hello that asked to join, and one refused attempt is counted once. The real server and the
real device client against a real mosquitto on 127.0.0.1."""

from __future__ import annotations

import contextlib
import threading
import time

from device_sim import ToneDataset

from wakefl.errors import ConfigError, ProtocolError
from wakefl.models.kws_cnn import KwsCnn, ModelConfig, get_flat_params
from wakefl.sdk.device_client import DeviceClient
from wakefl.sdk.selffl.registry import make_strategy
from wakefl.server.aggregation_server import AggregationServer, ServerConfig
from wakefl.server.state_store import StateStore

CFG = ModelConfig(width=0.05)
ARGS = {"lr": 0.05, "batch_size": 4, "l_max": 2, "warmup_steps": 1}
FLEET = "refusals"


def _device(tmp_path, url: str, device_type: str, folder: str) -> DeviceClient:
    return DeviceClient(
        "dev1",
        device_type,
        ToneDataset(8, 1),
        tmp_path / folder,
        validation=ToneDataset(8, 2),
        broker_url=url,
        fleet=FLEET,
        ack_timeout_s=1.0,
    )


def test_a_corrected_device_is_accepted_at_once_and_its_refusal_counted_once(mqtt_broker, tmp_path):
    cfg = ServerConfig(
        broker_url=mqtt_broker.url,
        state_dir=tmp_path / "server",
        initial_params=get_flat_params(KwsCnn(CFG)),
        model_config=CFG.to_dict(),
        fleet=FLEET,
        rounds=1,
        round_timeout=30,
        min_clients=1,
        devices={"dev1": "A"},
        strategy_args=ARGS,
        start_timeout=60,
    )
    said: list[str] = []
    server = AggregationServer(cfg, make_strategy("selffl", **ARGS), progress=said.append)

    def serve() -> None:
        with contextlib.suppress(ConfigError):
            server.run()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        # The device's Hellos must be live, not retained copies read at the server's
        # subscription (those are refused without being counted).
        deadline = time.monotonic() + 30
        while not any("waiting for devices" in line for line in said):
            assert time.monotonic() < deadline, said
            time.sleep(0.05)
        time.sleep(0.5)
        wrong = _device(tmp_path, mqtt_broker.url, "B", "wrong")
        try:
            wrong.run(idle_timeout=30)
            raise AssertionError("a device of the wrong type was not refused")
        except ProtocolError as exc:
            assert "says type 'B', registered as 'A'" in str(exc)
        finally:
            wrong.close()
        # The same device id, corrected, with a fresh state folder: its first start joins.
        right = _device(tmp_path, mqtt_broker.url, "A", "right")
        try:
            summary = right.run(idle_timeout=45)
        finally:
            right.close()
        assert summary.finished and summary.updates_accepted == 1, summary
    finally:
        server.stop_event.set()
        thread.join(30)
    assert not thread.is_alive()
    assert dict(server.rejections) == {"wrong_device_type": 1}
    store = StateStore(tmp_path / "server")
    try:
        assert store.rejection_counts() == {"wrong_device_type": 1}
    finally:
        store.close()
