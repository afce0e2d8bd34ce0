"""Compressed updates end to end against a real mosquitto: a fleet on int8 deltas
aggregates exactly the updates the devices meant to send, an update packed against another
base is refused as `checksum`, and the load generator's devices are all accounted for."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch

from wakefl.protocol import messages as M
from wakefl.protocol import topics
from wakefl.protocol import update_codec as C
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.sdk.selffl.registry import make_strategy
from wakefl.sdk.selffl.strategy import ClientResult
from wakefl.server.aggregation_server import AggregationServer, ServerConfig

FLEET = "z"
D = 3000


class PackedDevice:
    """Answers every round it is sampled for with an update packed by `codec` against the
    downlink's global model (or, with `wrong_base`, against a perturbed copy of it)."""

    def __init__(self, url: str, dev: str, typ: str, codec: str, wrong_base: bool = False):
        self.dev, self.typ, self.codec, self.wrong_base = dev, typ, codec, wrong_base
        self.meant: dict[int, torch.Tensor] = {}  # round -> what the server should rebuild
        self.sent: dict[int, M.Uplink] = {}
        self.acks: list[M.Ack] = []
        self.final: M.Downlink | None = None
        self.link = MqttLink(url, dev)
        self.link.subscribe(topics.downlink(FLEET), self._on_down)
        self.link.subscribe(topics.ack(FLEET, dev), self._on_ack)
        self.link.connect()
        hello = M.encode(M.Hello(FLEET, dev, typ, 10))
        self.link.publish(topics.hello(FLEET, dev), hello, retain=True)

    def _on_ack(self, topic: str, payload: bytes) -> None:
        self.acks.append(M.decode_as(payload, M.Ack))

    def _on_down(self, topic: str, payload: bytes) -> None:
        down = M.decode_as(payload, M.Downlink)
        if down.final:
            self.final = down
            return
        if self.dev not in down.instructions or down.round_id in self.sent:
            return
        g = torch.Generator().manual_seed(zlib.crc32(f"{self.dev}:{down.round_id}".encode()))
        params = down.global_params + 0.05 * torch.randn(D, generator=g)
        idx = zlib.crc32(self.dev.encode()) % 5
        up = M.Uplink(
            FLEET,
            down.run_id,
            self.dev,
            self.typ,
            down.round_id,
            params,
            num_samples=10 + idx,
            record={"has_variance": 1.0, "sigma_sq": 0.1 + 0.05 * idx, "local_steps": 5},
        )
        base = down.global_params.clone()
        if self.wrong_base:
            base[0] += 0.5
        self.sent[down.round_id] = up
        self.meant[down.round_id] = C.decode(C.encode(params, base, self.codec), base)
        frame = M.encode(up, uplink_codec=self.codec, base=base)
        self.link.publish(topics.uplink(FLEET, self.dev), frame, wait=False)

    def close(self) -> None:
        self.link.close()


def _server(broker, tmp_path, reg: dict[str, str], **kw) -> AggregationServer:
    cfg = ServerConfig(
        broker_url=broker.url,
        state_dir=tmp_path / "server",
        initial_params=torch.zeros(D),
        fleet=FLEET,
        devices=reg,
        **kw,
    )
    return AggregationServer(cfg, make_strategy("selffl"), progress=lambda s: None)


def _wait(pred, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and not pred():
        time.sleep(0.05)
    assert pred()


@pytest.mark.parametrize("wire_dtype", ["fp32", "fp16"])
def test_int8_delta_round_aggregates_exactly_what_the_devices_meant(
    mqtt_broker, tmp_path, wire_dtype
):
    reg = {"a": "speaker", "b": "speaker", "c": "tv"}
    devs = [PackedDevice(mqtt_broker.url, d, t, "int8-delta") for d, t in reg.items()]
    srv = _server(
        mqtt_broker,
        tmp_path,
        reg,
        rounds=2,
        round_timeout=30,
        uplink_codec="int8-delta",
        wire_dtype=wire_dtype,
    )
    try:
        final = srv.run()
        _wait(lambda: all(d.final is not None for d in devs), 10)
    finally:
        for d in devs:
            d.close()
    assert [r.closed_by for r in srv.reports] == ["all", "all"] and not srv.rejections
    # the in-process strategy on the decoded updates, in the server's order
    strat = make_strategy("selffl")
    state = strat.init_server(torch.zeros(D))
    by_id = {d.dev: d for d in devs}
    for r in (1, 2):
        order = sorted(srv.reports[r - 1].reported)
        results = [
            ClientResult(
                dev,
                r,
                by_id[dev].meant[r],
                by_id[dev].sent[r].num_samples,
                dict(by_id[dev].sent[r].record),
                {},
                reg[dev],
            )
            for dev in order
        ]
        state = strat.aggregate(state, results, len(results) / len(reg))
    torch.testing.assert_close(final.global_params, state.global_params, rtol=0, atol=1e-6)
    assert all(a.accepted for d in devs for a in d.acks)


def test_update_packed_against_another_base_is_refused_as_checksum(mqtt_broker, tmp_path):
    reg = {"a": "speaker", "bad": "speaker"}
    good = PackedDevice(mqtt_broker.url, "a", "speaker", "int8-delta")
    bad = PackedDevice(mqtt_broker.url, "bad", "speaker", "int8-delta", wrong_base=True)
    srv = _server(mqtt_broker, tmp_path, reg, rounds=1, round_timeout=4, uplink_codec="int8-delta")
    try:
        srv.run()
    finally:
        good.close()
        bad.close()
    assert srv.rejections["checksum"] == 1
    assert [a.reason for a in bad.acks] == ["checksum"] and not bad.acks[0].accepted
    assert srv.reports[0].reported.keys() == {"a"}


@pytest.mark.parametrize("follower_only", [False, True])
def test_load_generator_accounts_for_every_update(mqtt_broker, tmp_path, follower_only):
    """Every device's update is sent, acked and counted, whether each connection follows
    the downlink or only the follower does (--follower-only: no fan-out)."""
    n, rounds = 20, 2
    reg = {f"dev{i:04d}": f"type{i % 5}" for i in range(n)}
    gen = subprocess.Popen(
        [sys.executable, "-m", "wakefl.tools.fleet.load_fleet", "--broker", mqtt_broker.url]
        + ["--fleet", FLEET, "--devices", str(n), "--time-limit", "120"]
        + (["--follower-only"] if follower_only else []),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert gen.stdout is not None
        assert gen.stdout.readline().strip() == f"ready {n}"
        srv = _server(
            mqtt_broker,
            tmp_path,
            reg,
            rounds=rounds,
            round_timeout=60,
            uplink_codec="int8-delta",
            wire_dtype="fp16",
        )
        threading.Thread(target=srv.run, daemon=True).start()
        out, _ = gen.communicate(timeout=120)
    finally:
        if gen.poll() is None:
            gen.kill()
    report = json.loads(out.strip().splitlines()[-1])
    assert report["finished"] and not report["errors"]
    for r in range(1, rounds + 1):
        row = report["rounds"][str(r)]
        assert row == {**row, "sampled": n, "sent": n, "accepted": n, "unanswered": 0}
    assert [len(rep.reported) for rep in srv.reports] == [n] * rounds
    assert not srv.rejections
