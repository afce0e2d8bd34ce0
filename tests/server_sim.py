"""Lightweight simulated devices for the server's tests, written on top of paho directly
(small vectors, no training), and the helpers those tests share: a server on a real
mosquitto, waiting bounded in time, the in-process strategy's model on the same updates."""

from __future__ import annotations

import subprocess
import threading
import time
import zlib
from pathlib import Path

import paho.mqtt.client as paho
import torch
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from wakefl.protocol import messages as M
from wakefl.protocol import topics
from wakefl.sdk.selffl.registry import make_strategy
from wakefl.sdk.selffl.strategy import ClientResult
from wakefl.server.aggregation_server import AggregationServer, ServerConfig
from wakefl.server.state_store import StateStore

FLEET = "t"
D = 48


class SimDevice:
    """A device that answers each round it is sampled for with a deterministic update,
    waits for the ack and re-sends on timeout. While `hold` is clear it does not answer
    rounds >= `hold_from`."""

    def __init__(self, url: str, dev: str, typ: str, *, answer: bool = True, resend_s: float = 2.0):
        self.dev, self.typ, self.answer, self.resend_s = dev, typ, answer, resend_s
        self.hold = threading.Event()
        self.hold.set()
        self.hold_from = 1
        self.sent: dict[int, M.Uplink] = {}  # round -> the update it sent
        self.acked: dict[int, M.Ack] = {}
        self.final: M.Downlink | None = None
        self._lock = threading.Lock()
        self._todo: M.Downlink | None = None
        host, port = url.removeprefix("mqtt://").split(":")
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=dev, protocol=paho.MQTTv5)
        c.will_set(
            topics.hello(FLEET, dev),
            M.encode(M.Hello(FLEET, dev, typ, 10, online=False)),
            qos=1,
            retain=True,
        )
        c.on_connect = self._on_connect
        c.on_message = self._on_message
        c.reconnect_delay_set(0.2, 1)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        c.connect(host, int(port), keepalive=60, clean_start=False, properties=props)
        self.client = c
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._work, daemon=True)
        c.loop_start()
        self._worker.start()

    def _on_connect(self, client, userdata, flags, rc, props):
        client.subscribe([(topics.downlink(FLEET), 1), (topics.ack(FLEET, self.dev), 1)])
        client.publish(
            topics.hello(FLEET, self.dev),
            M.encode(M.Hello(FLEET, self.dev, self.typ, 10)),
            qos=1,
            retain=True,
        )

    def _on_message(self, client, userdata, msg):
        m = M.decode(msg.payload)
        with self._lock:
            if isinstance(m, M.Ack) and m.accepted:
                self.acked[m.round_id] = m
            elif isinstance(m, M.Downlink):
                if m.final:
                    self.final = m
                elif self.dev in m.instructions and m.round_id not in self.acked:
                    self._todo = m

    def update_for(self, down: M.Downlink) -> M.Uplink:
        seed = zlib.crc32(f"{self.dev}:{down.round_id}".encode())
        g = torch.Generator().manual_seed(seed)
        idx = zlib.crc32(self.dev.encode()) % 5
        params = down.global_params + 0.3 * (idx - 2) + 0.05 * torch.randn(D, generator=g)
        sigma = 0.1 + 0.05 * idx
        return M.Uplink(
            FLEET,
            down.run_id,
            self.dev,
            self.typ,
            down.round_id,
            params,
            num_samples=10 + idx,
            record={"has_variance": 1.0, "sigma_sq": sigma, "local_steps": 5 + idx},
        )

    def _work(self):
        last_sent = 0.0
        while not self._stop.is_set():
            time.sleep(0.02)
            if not self.answer:
                continue
            with self._lock:
                down = self._todo
                if down is None or down.round_id in self.acked:
                    continue
                if down.round_id >= self.hold_from and not self.hold.is_set():
                    continue
                up = self.sent.get(down.round_id)
            if up is None:
                up = self.sent[down.round_id] = self.update_for(down)
            elif time.monotonic() - last_sent < self.resend_s:
                continue
            self.client.publish(topics.uplink(FLEET, self.dev), M.encode(up), qos=1)
            last_sent = time.monotonic()

    def close(self):
        close_all([self])


def close_all(devices: list[SimDevice]) -> None:
    # Disconnect every client first: paho's loop thread then ends at once instead of
    # sleeping out its select timeout in loop_stop.
    for d in devices:
        d._stop.set()
    for d in devices:
        d._worker.join()
        d.client.disconnect()
    for d in devices:
        d.client.loop_stop()


def wait_for(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def make_server(broker, tmp_path, devices: dict[str, str], **kw) -> AggregationServer:
    strategy_args = kw.pop("strategy_args", {})
    cfg = ServerConfig(
        broker_url=broker.url,
        state_dir=tmp_path / "server",
        initial_params=torch.zeros(D),
        fleet=FLEET,
        devices=devices,
        strategy_args=strategy_args,
        **kw,
    )
    return AggregationServer(cfg, make_strategy("selffl", **strategy_args), progress=lambda s: None)


def start(server: AggregationServer) -> threading.Thread:
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    return t


def expected_global(
    devices: list[SimDevice],
    rounds: int,
    registry_size: int,
    cluster: bool,
    order: dict[int, list[str]],
) -> torch.Tensor:
    """The in-process strategy on the very updates the devices sent, in the server's order."""
    strat = make_strategy("selffl", cluster_by_group=cluster)
    state = strat.init_server(torch.zeros(D))
    by_id = {d.dev: d for d in devices}
    for r in range(1, rounds + 1):
        results = []
        for dev in order[r]:
            up = by_id[dev].sent[r]
            results.append(
                ClientResult(dev, r, up.params, up.num_samples, dict(up.record), {}, up.device_type)
            )
        state = strat.aggregate(state, results, len(results) / registry_size)
    return state.global_params


def round_orders(state_dir: Path, rounds: int) -> dict[int, list[str]]:
    store = StateStore(state_dir)
    try:
        return {r: [row["device_id"] for row in store.update_rows(r)] for r in range(1, rounds + 1)}
    finally:
        store.close()


class RawClient:
    """A bare MQTT client that publishes whatever bytes it is given (anonymous broker)."""

    def __init__(self, url: str, client_id: str) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.acks: list[M.Ack] = []
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
        self.c.on_message = lambda c, u, m: self.acks.append(M.decode(m.payload))
        self.c.connect(host, int(port))
        self.c.loop_start()

    def listen_acks(self, dev: str) -> None:
        self.c.subscribe(topics.ack(FLEET, dev), qos=1)
        time.sleep(0.3)

    def send(self, topic: str, payload: bytes) -> None:
        self.c.publish(topic, payload, qos=1).wait_for_publish(5)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def collect_lines(proc: subprocess.Popen) -> list[str]:
    """The process's output lines, appended as they come by a reader thread."""
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    return lines
