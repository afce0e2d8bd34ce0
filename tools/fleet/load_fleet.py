"""Load generator: one process that stands in for many devices of a fleet (benchmarks only,
not the SDK).

    python -m wakefl.tools.fleet.load_fleet --broker mqtt://127.0.0.1:PORT --fleet F \\
        --devices 1000 [--types 5] [--credentials creds.json] [--ca ca.crt] \\
        [--window 64] [--time-limit 900] [--report out.json] [--follower-only]

Each device id gets its own MQTT v5 connection (its own username and password when
`--credentials` maps ids to passwords, so a broker's ACL applies to it as to a real device),
publishes its retained `Hello` with an offline will, follows the retained downlink and,
when sampled, publishes a distinct and valid update for the round in the codec the
downlink announces, waits for the `Ack` that answers those bytes and re-sends after the
announced `ack_timeout_s` (at most `--max-sends` times), like a device (docs/PROTOCOL.md).

What makes one process enough: a small asyncio MQTT client (no thread per connection) that
skips a downlink's tensor bytes on every connection but one (the follower, which decodes
the global model); updates that differ only in their last block, so the checksum's
SHA-256 state over the common prefix (the base's digest and the common codes) is computed
once per round and copied per device; and at most `--window` updates awaiting their ack at once (the payloads of the
others are built when their turn comes), which bounds the memory of this process and of
the broker's queue to the server.

With `--follower-only`, only the follower subscribes to the downlink and every sampled
device acts on the follower's copy: the broker then fans a downlink out once instead of
once per connection (mosquitto holds a full outgoing copy per subscriber, docs/SCALE.md),
so the run measures everything but the fan-out, which tools/fleet/bench_fanout.py measures apart.

It prints `ready <n>` once every device is connected and subscribed, and at the end (the
final downlink, or `--time-limit`) one JSON line: per round, the devices sampled, updates
sent, accepted, refused by reason, and unanswered, plus the CPU seconds it used. Only
127.0.0.1 (or a host given in --broker) is contacted; every loop is bounded in count and
time.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import ssl
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wakefl.protocol import frames, topics
from wakefl.protocol import messages as M
from wakefl.protocol import update_codec as C
from wakefl.sdk.mqtt_link import parse_broker_url
from wakefl.server.process_settings import keep_freed_heap

HEAD_BYTES = 1 << 20  # a downlink's JSON header (instructions for every sampled device) fits
SMALL_PACKET = 1 << 16
KEEPALIVE_S = 600
_RECORD = {"sigma_sq": 0.1, "has_variance": 1.0, "local_steps": 10.0}


# ----------------------------------------------------------------------------- MQTT v5


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _str(s: str) -> bytes:
    b = s.encode()
    return len(b).to_bytes(2, "big") + b


def _bin(b: bytes) -> bytes:
    return len(b).to_bytes(2, "big") + b


def _packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + _varint(len(body)) + body


def connect_packet(
    client_id: str, username: str | None, password: str | None, will: tuple[str, bytes]
) -> bytes:
    flags = 0x02 | 0x04 | 0x08 | 0x20  # clean start, will (QoS 1, retained)
    payload = _str(client_id) + b"\x00" + _str(will[0]) + _bin(will[1])
    if username is not None:
        flags |= 0x80
        payload += _str(username)
    if password is not None:
        flags |= 0x40
        payload += _bin(password.encode())
    head = _str("MQTT") + bytes([5, flags]) + KEEPALIVE_S.to_bytes(2, "big") + b"\x00"
    return _packet(0x10, head + payload)


class MqttConn(asyncio.Protocol):
    """One MQTT v5 connection: CONNECT, SUBSCRIBE, QoS 1 PUBLISH both ways. An incoming
    publish larger than SMALL_PACKET is streamed: only its first HEAD_BYTES are kept unless
    `keep_full`, so a thousand connections receiving one downlink hold no copy of it."""

    def __init__(self, on_message: Any, keep_full: bool = False) -> None:
        self.on_message, self.keep_full = on_message, keep_full
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._large: dict[str, Any] | None = None  # the publish being streamed
        self._pid = 0
        self._waiting: dict[int, asyncio.Future] = {}
        self.connack: asyncio.Future = asyncio.get_running_loop().create_future()
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in [self.connack, self.closed, *self._waiting.values()]:
            if not fut.done():
                fut.set_exception(ConnectionError(f"connection lost: {exc}"))
                fut.exception()  # retrieved: no "never retrieved" warning at exit

    def _next_pid(self) -> int:
        self._pid = self._pid % 65535 + 1
        return self._pid

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def subscribe(self, filters: list[str]) -> asyncio.Future:
        pid = self._next_pid()
        body = pid.to_bytes(2, "big") + b"\x00" + b"".join(_str(f) + b"\x01" for f in filters)
        fut = self._waiting[pid] = asyncio.get_running_loop().create_future()
        self.send(_packet(0x82, body))
        return fut

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> asyncio.Future:
        """QoS 1; the future resolves to the PUBACK's reason code (0: accepted)."""
        pid = self._next_pid()
        head = _str(topic) + pid.to_bytes(2, "big") + b"\x00"
        fut = self._waiting[pid] = asyncio.get_running_loop().create_future()
        self.send(bytes([0x32 | int(retain)]) + _varint(len(head) + len(payload)) + head)
        self.send(payload)
        return fut

    # -------------------------------------------------------------- receiving
    def data_received(self, data: bytes) -> None:
        self._buf += data
        while self._step():
            pass

    def _fixed_header(self) -> tuple[int, int, int] | None:
        """(first byte, remaining length, header size) once the buffer holds them."""
        mult, length = 1, 0
        for i in range(1, min(len(self._buf), 5)):
            length += (self._buf[i] & 0x7F) * mult
            mult *= 128
            if not self._buf[i] & 0x80:
                return self._buf[0], length, i + 1
        return None

    def _step(self) -> bool:
        if self._large is not None:
            return self._stream()
        fixed = self._fixed_header()
        if fixed is None:
            return False
        first, length, hsize = fixed
        if length > SMALL_PACKET and first >> 4 == 3:
            del self._buf[:hsize]
            self._large = {"first": first, "left": length, "head": bytearray(), "chunks": []}
            return True
        if len(self._buf) < hsize + length:
            return False
        body = bytes(self._buf[hsize : hsize + length])
        del self._buf[: hsize + length]
        self._handle(first, body)
        return True

    def _stream(self) -> bool:
        large = self._large
        assert large is not None
        take = min(len(self._buf), large["left"])
        if take == 0:
            return False
        chunk = bytes(self._buf[:take])
        del self._buf[:take]
        large["left"] -= take
        if len(large["head"]) < HEAD_BYTES:
            large["head"] += chunk[: HEAD_BYTES - len(large["head"])]
        if self.keep_full:
            large["chunks"].append(chunk)
        if large["left"] == 0:
            self._large = None
            body = b"".join(large["chunks"]) if self.keep_full else bytes(large["head"])
            self._handle(large["first"], body, complete=self.keep_full)
        return True

    def _handle(self, first: int, body: bytes, complete: bool = True) -> None:
        kind = first >> 4
        if kind == 2:  # CONNACK: flags, reason code
            if not self.connack.done():
                if len(body) >= 2 and body[1] == 0:
                    self.connack.set_result(True)
                else:
                    self.connack.set_exception(ConnectionError(f"refused: {body[1:2].hex()}"))
        elif kind in (4, 9):  # PUBACK / SUBACK: packet id, reason code(s)
            pid = int.from_bytes(body[:2], "big")
            code = 0 if len(body) < 3 else body[2] if kind == 4 else body[-1]
            fut = self._waiting.pop(pid, None)
            if fut is not None and not fut.done():
                fut.set_result(code if code >= 0x80 or kind == 4 else 0)
        elif kind == 3:
            self._handle_publish(first, body, complete)

    def _handle_publish(self, first: int, body: bytes, complete: bool) -> None:
        tlen = int.from_bytes(body[:2], "big")
        topic = body[2 : 2 + tlen].decode()
        at = 2 + tlen
        if (first >> 1) & 3:
            self.send(b"\x40\x02" + body[at : at + 2])  # PUBACK
            at += 2
        plen, mult, i = 0, 1, at
        while True:
            plen += (body[i] & 0x7F) * mult
            mult *= 128
            i += 1
            if not body[i - 1] & 0x80:
                break
        self.on_message(topic, body[i + plen :], complete)


# ----------------------------------------------------------------------------- the fleet


@dataclass
class Device:
    device_id: str
    device_type: str
    conn: MqttConn | None = None
    seen_round: int = 0
    sent: dict[int, str] = field(default_factory=dict)  # round -> message id in flight
    sends: Counter = field(default_factory=Counter)


@dataclass
class RoundTally:
    sampled: int = 0
    sent: int = 0
    accepted: int = 0
    refused: Counter = field(default_factory=Counter)
    resends: int = 0
    build_s: float = 0.0
    opened_at: float = 0.0
    last_ack_at: float = 0.0


class UpdateFactory:
    """Distinct, valid updates for one round: every device's int8 codes are the common
    codes except in the last block, which is its own; the checksum's SHA-256 state over
    the common prefix (`update_codec.packed_checksum`: the base's digest, the codec's
    header and the common codes) is computed once per round and copied per device."""

    def __init__(self, numel: int, seed: int = 0, magnitude: float = 1e-3) -> None:
        rng = np.random.default_rng(seed)
        self.numel = numel
        self.block = C.BLOCK
        self.nb = -(-numel // C.BLOCK)
        self.q0 = rng.integers(-127, 128, numel, dtype=np.int8)
        self.s0 = np.full(self.nb, magnitude / 127, dtype=np.float32)
        self.tail_at = (self.nb - 1) * C.BLOCK  # the devices' own block
        self._round: tuple[int, Any] | None = None

    def start_round(self, round_id: int, base: torch.Tensor) -> None:
        h = hashlib.sha256(C.base_facts(base).digest)
        h.update(f"int8-delta:{self.numel}:{self.block}".encode("ascii"))
        h.update(self.q0[: self.tail_at].data.cast("B"))
        self._round = (round_id, h)

    def packed(self, index: int, round_id: int) -> C.Packed:
        assert self._round is not None and self._round[0] == round_id
        prefix = self._round[1]
        rng = np.random.default_rng([index, round_id])
        n_tail = self.numel - self.tail_at
        tail_q = rng.integers(-127, 128, n_tail, dtype=np.int8)
        tail_s = np.float32(self.s0[-1] * (1.0 + 0.01 * (index % 97)))
        q = self.q0.copy()
        q[self.tail_at :] = tail_q
        scale = self.s0.copy()
        scale[-1] = tail_s
        h = prefix.copy()
        h.update(tail_q.data.cast("B"))
        h.update(np.ascontiguousarray(scale, dtype="<f4").data.cast("B"))
        tensors = {"q": torch.from_numpy(q), "scale": torch.from_numpy(scale)}
        return C.Packed("int8-delta", self.numel, self.block, tensors, h.hexdigest())


class LoadFleet:
    """The devices, their connections and the round bookkeeping (one event loop)."""

    def __init__(self, args: argparse.Namespace, creds: dict[str, str]) -> None:
        self.args = args
        self.url = parse_broker_url(args.broker)
        self.fleet = args.fleet
        self.creds = creds
        self.devices = [
            Device(f"{args.prefix}{i:04d}", f"type{i % args.types}") for i in range(args.devices)
        ]
        self.index = {d.device_id: i for i, d in enumerate(self.devices)}
        self.tally: dict[int, RoundTally] = defaultdict(RoundTally)
        self.down: M.Downlink | None = None
        self.factory: UpdateFactory | None = None
        self.window = asyncio.Semaphore(args.window)
        self.finished = asyncio.Event()
        self.acks: dict[tuple[str, int], asyncio.Future] = {}
        self.errors: Counter = Counter()
        # Deliveries still sending or awaiting their ack (strong references: the loop keeps
        # only weak ones to tasks).
        self.deliveries: set[asyncio.Task] = set()

    # -------------------------------------------------------------- connections
    async def _open(self, dev: Device, follower: bool) -> None:
        loop = asyncio.get_running_loop()
        ctx = None
        if self.url.tls:
            ctx = ssl.create_default_context(cafile=self.url.ca_file)
        conn_holder: dict[str, MqttConn] = {}

        def factory() -> MqttConn:
            conn_holder["c"] = MqttConn(
                lambda t, p, full: self._on_message(dev, t, p, full), keep_full=follower
            )
            return conn_holder["c"]

        await loop.create_connection(factory, self.url.host, self.url.port, ssl=ctx)
        conn = dev.conn = conn_holder["c"]
        will = M.encode(M.Hello(self.fleet, dev.device_id, dev.device_type, online=False))
        password = self.creds.get(dev.device_id)
        user = dev.device_id if password is not None else None
        conn.send(
            connect_packet(
                dev.device_id, user, password, (topics.hello(self.fleet, dev.device_id), will)
            )
        )
        await asyncio.wait_for(conn.connack, 30)
        # --follower-only: the broker fans the downlink out to one connection instead of
        # every one (docs/SCALE.md: mosquitto holds one outgoing copy per subscriber).
        filters = [topics.ack(self.fleet, dev.device_id)]
        if follower or not self.args.follower_only:
            filters.insert(0, topics.downlink(self.fleet))
        await asyncio.wait_for(conn.subscribe(filters), 30)
        hello = M.encode(M.Hello(self.fleet, dev.device_id, dev.device_type, 100))
        await asyncio.wait_for(
            conn.publish(topics.hello(self.fleet, dev.device_id), hello, retain=True), 30
        )

    async def connect_all(self) -> None:
        sem = asyncio.Semaphore(50)  # connect in waves: the broker's accept queue is finite

        async def one(i: int, dev: Device) -> None:
            async with sem:
                await self._open(dev, follower=i == 0)

        await asyncio.gather(*(one(i, d) for i, d in enumerate(self.devices)))

    # -------------------------------------------------------------- receiving
    def _on_message(self, dev: Device, topic: str, payload: bytes, complete: bool) -> None:
        try:
            if topic.endswith("/down"):
                self._on_downlink(dev, payload, complete)
            elif "/ack/" in topic:
                ack = M.decode_as(payload, M.Ack)
                fut = self.acks.get((dev.device_id, ack.round_id))
                if fut is not None and not fut.done() and ack.answers == dev.sent.get(ack.round_id):
                    fut.set_result(ack)
        except M.MessageRejected as exc:
            self.errors[f"undecodable {topic.rsplit('/', 1)[-1]}: {exc.reason}"] += 1

    def _on_downlink(self, dev: Device, payload: bytes, complete: bool) -> None:
        if complete:  # the follower: the whole downlink, decoded like a device does
            down = M.decode_as(payload, M.Downlink)
            if down.final:
                self.finished.set()
                return
            if self.down is None or down.round_id > self.down.round_id:
                self.down = down
                self._start_round(down)
        head = _peek(payload)
        if head is not None and not head.get("final"):
            dev.seen_round = max(dev.seen_round, int(head["round_id"]))

    def _start_round(self, down: M.Downlink) -> None:
        if self.factory is None:
            self.factory = UpdateFactory(down.global_params.numel(), seed=self.args.seed)
        self.factory.start_round(down.round_id, down.global_params)
        tally = self.tally[down.round_id]
        tally.sampled = len(down.instructions)
        tally.opened_at = time.time()
        for d in down.instructions:
            if d in self.index:
                task = asyncio.get_running_loop().create_task(
                    self._deliver(self.devices[self.index[d]], down)
                )
                self.deliveries.add(task)
                task.add_done_callback(self.deliveries.discard)

    # -------------------------------------------------------------- sending
    def _payload(self, dev: Device, down: M.Downlink) -> bytes:
        codec = down.settings.uplink_codec
        i = self.index[dev.device_id]
        record = {**_RECORD, "sigma_sq": 0.1 + 1e-4 * i}
        up = M.Uplink(
            self.fleet,
            down.run_id,
            dev.device_id,
            dev.device_type,
            down.round_id,
            down.global_params,
            100,
            record,
        )
        assert self.factory is not None
        if codec == "int8-delta":
            return M.encode(_with_packed(up, self.factory.packed(i, down.round_id)))
        params = down.global_params.clone()
        params[-C.BLOCK :] += 1e-3 * (1 + (i + down.round_id) % 101)
        wire = codec if codec in M.WIRE_DTYPES else "fp32"
        return M.encode(
            _with_params(up, params),
            wire_dtype=wire,
            uplink_codec=codec if codec in C.DELTA_CODECS else "",
            base=down.global_params,
        )

    async def _deliver(self, dev: Device, down: M.Downlink) -> None:
        rid, tally = down.round_id, self.tally[down.round_id]
        deadline = min(down.deadline, time.time() + self.args.time_limit)
        ack_timeout = down.settings.ack_timeout_s
        async with self.window:
            while (  # this device's own copy (with --follower-only: the follower's)
                not self.args.follower_only and dev.seen_round < rid and time.time() < deadline
            ):
                await asyncio.sleep(0.01)
            if self._superseded(rid):
                return
            t0 = time.perf_counter()
            payload = self._payload(dev, down)
            tally.build_s += time.perf_counter() - t0
            dev.sent[rid] = M.message_id(payload)
            fut = self.acks[(dev.device_id, rid)] = asyncio.get_running_loop().create_future()
            while dev.sends[rid] < self.args.max_sends and not self._superseded(rid):
                dev.sends[rid] += 1
                tally.sent += dev.sends[rid] == 1
                tally.resends += dev.sends[rid] > 1
                assert dev.conn is not None
                code = await dev.conn.publish(topics.uplink(self.fleet, dev.device_id), payload)
                if code >= 0x80:
                    tally.refused[f"broker_0x{code:02x}"] += 1
                    return
                try:
                    ack = await asyncio.wait_for(asyncio.shield(fut), ack_timeout)
                except TimeoutError:
                    continue
                tally.last_ack_at = time.time()
                if ack.accepted:
                    tally.accepted += 1
                else:
                    tally.refused[ack.reason] += 1
                return

    def _superseded(self, rid: int) -> bool:
        return self.finished.is_set() or (self.down is not None and self.down.round_id > rid)

    # -------------------------------------------------------------- report
    def report(self, cpu_s: float, wall_s: float) -> dict[str, Any]:
        rounds = {}
        for rid, t in sorted(self.tally.items()):
            unanswered = t.sampled - t.accepted - sum(t.refused.values())
            rounds[rid] = {
                "sampled": t.sampled,
                "sent": t.sent,
                "resends": t.resends,
                "accepted": t.accepted,
                "refused": dict(t.refused),
                "unanswered": unanswered,
                "build_s": round(t.build_s, 3),
                "last_ack_after_s": round(t.last_ack_at - t.opened_at, 3)
                if t.last_ack_at
                else None,
            }
        return {
            "devices": len(self.devices),
            "rounds": rounds,
            "finished": self.finished.is_set(),
            "errors": dict(self.errors),
            "cpu_s": round(cpu_s, 3),
            "wall_s": round(wall_s, 3),
        }


def _with_packed(up: M.Uplink, packed: C.Packed) -> M.Uplink:
    from dataclasses import replace

    return replace(up, params=torch.empty(0), packed=packed)


def _with_params(up: M.Uplink, params: torch.Tensor) -> M.Uplink:
    from dataclasses import replace

    return replace(up, params=params)


# How long the report waits, after the final downlink, for acks still in flight.
ACK_GRACE_S = 10.0


def _peek(payload: bytes) -> dict[str, Any] | None:
    """A downlink's JSON fields from the head of its frame (tensor bytes never read)."""
    try:
        return frames.peek(payload)
    except frames.FrameError:
        return None


async def run(args: argparse.Namespace, creds: dict[str, str]) -> dict[str, Any]:
    fleet = LoadFleet(args, creds)
    cpu0, wall0 = _cpu(), time.monotonic()
    await asyncio.wait_for(fleet.connect_all(), args.time_limit)
    print(f"ready {len(fleet.devices)}", flush=True)
    try:
        await asyncio.wait_for(fleet.finished.wait(), args.time_limit)
    except TimeoutError:
        fleet.errors["time limit reached before the final downlink"] += 1
    if fleet.deliveries:
        # The server acks each update before it closes the round, but the final downlink
        # reaches the follower's connection independently of the acks on the others': let
        # the acks in flight land before counting them (bounded by ACK_GRACE_S).
        await asyncio.wait(set(fleet.deliveries), timeout=ACK_GRACE_S)
    for dev in fleet.devices:
        if dev.conn is not None and dev.conn.transport is not None:
            dev.conn.send(b"\xe0\x00")  # DISCONNECT
            dev.conn.transport.close()
    return fleet.report(_cpu() - cpu0, time.monotonic() - wall0)


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--broker", required=True, help="mqtt://127.0.0.1:PORT or mqtts://...?ca=")
    p.add_argument("--fleet", default=topics.DEFAULT_FLEET)
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--prefix", default="dev")
    p.add_argument("--types", type=int, default=5)
    p.add_argument("--credentials", type=Path, help="JSON {device_id: password}")
    p.add_argument("--window", type=int, default=64, help="updates awaiting their ack at once")
    p.add_argument("--max-sends", type=int, default=3)
    p.add_argument("--time-limit", type=float, default=900.0, help="seconds, whole run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--follower-only",
        action="store_true",
        help="only the follower connection subscribes to the downlink; the others act on "
        "its copy (uplinks, hellos and acks unchanged): measures all but the fan-out",
    )
    p.add_argument("--report", type=Path, help="also write the JSON report here")
    args = p.parse_args(argv)
    if not 1 <= args.devices <= 10000:
        p.error("--devices must be in [1, 10000]")
    torch.set_num_threads(1)
    keep_freed_heap()  # it publishes an update-sized payload per device and round
    creds = json.loads(args.credentials.read_text()) if args.credentials else {}
    report = asyncio.run(run(args, creds))
    text = json.dumps(report, sort_keys=True)
    if args.report:
        args.report.write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
