"""The broker's downlink fan-out, measured apart from the rounds (benchmarks only).

    python -m wakefl.tools.fleet.bench_fanout [--bytes 5844856] [--subscribers 10 100 300 1000]
                                        [--repeats 2] [--min-available-gb 4]

For each K: a fresh managed mosquitto on 127.0.0.1, K subscriber connections (one asyncio
process, tools/fleet/load_fleet.py's MQTT client, payloads streamed and discarded), and one
publisher that sends a QoS 1 message of `--bytes` (default: the fp16 downlink of the
full-size model) to their topic, `--repeats` times. Prints per K and message: the time
until every subscriber holds the whole message, the copies' aggregate rate, the broker's
resident memory before and at its peak (sampled every 20 ms; the growth divided by the
message size says how many outgoing copies it held at once), and the CPU seconds of the
broker and of the subscribers' process. This is the part of a round that
`bench_federation --load-gen --follower-only` leaves out.

Memory guard: if the machine's available memory falls under `--min-available-gb` while a
message fans out, that K is stopped, reported as aborted with the figures so far, and no
larger K is tried.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from wakefl.server.broker import ManagedBroker
from wakefl.tools.fleet.load_fleet import MqttConn, connect_packet
from wakefl.tools.fleet.process_stats import cpu_seconds

TOPIC = "bench/fanout"
FP16_DOWNLINK_BYTES = 5_844_856  # full-size model, fp16 (docs/SCALE.md)


def _status_kb(path: str, key: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return 0


class MemorySampler(threading.Thread):
    """Every 20 ms: the broker's RSS (peak kept) and the machine's available memory
    (lowest kept); sets `aborted` and `stop` once available memory is under the floor.
    A thread, so that it keeps sampling while the event loop is busy receiving."""

    def __init__(self, pid: int, min_available_kb: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.pid, self.min_available_kb, self.stop = pid, min_available_kb, stop
        self.peak_rss_kb = _status_kb(f"/proc/{pid}/status", "VmRSS:")
        self.low_available_kb = _status_kb("/proc/meminfo", "MemAvailable:")
        self.aborted = False

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak_rss_kb = max(
                self.peak_rss_kb, _status_kb(f"/proc/{self.pid}/status", "VmRSS:")
            )
            available = _status_kb("/proc/meminfo", "MemAvailable:")
            self.low_available_kb = min(self.low_available_kb, available)
            if available < self.min_available_kb:
                self.aborted = True
                self.stop.set()
            time.sleep(0.02)


async def _open(port: int, name: str, on_message: Any, subscribe: bool) -> MqttConn:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(lambda: MqttConn(on_message), "127.0.0.1", port)
    conn.send(connect_packet(name, None, None, (f"{TOPIC}/will/{name}", b"")))
    await asyncio.wait_for(conn.connack, 30)
    if subscribe:
        await asyncio.wait_for(conn.subscribe([TOPIC]), 30)
    return conn


async def _one_message(
    pub: MqttConn, payload: bytes, received: list[int], k: int, sampler: MemorySampler
) -> float:
    """Publish once; seconds until all `k` subscribers hold it (or until the guard stops
    it, or 600 s: then the figure is the time waited)."""
    t0 = time.perf_counter()
    await asyncio.wait_for(pub.publish(TOPIC, payload), 600)
    while received[0] < k and not sampler.stop.is_set() and time.perf_counter() - t0 < 600:
        await asyncio.sleep(0.005)
    return time.perf_counter() - t0


async def fan_out(port: int, pid: int, k: int, args: argparse.Namespace) -> list[dict]:
    """K subscribers on the broker at `port` (process `pid`); one row per message sent."""
    received = [0]

    def on_message(topic: str, payload: bytes, complete: bool) -> None:
        received[0] += 1

    sem = asyncio.Semaphore(50)  # connect in waves: the broker's accept queue is finite

    async def sub(i: int) -> MqttConn:
        async with sem:
            return await _open(port, f"fan{i:05d}", on_message, subscribe=True)

    subs = await asyncio.gather(*(sub(i) for i in range(k)))
    pub = await _open(port, "fan-publisher", lambda *a: None, subscribe=False)
    payload = os.urandom(args.bytes)
    rows = []
    for _ in range(args.repeats):
        received[0] = 0
        stop = threading.Event()
        sampler = MemorySampler(pid, int(args.min_available_gb * 1024 * 1024), stop)
        rss0, cpu_b, cpu_s = sampler.peak_rss_kb, cpu_seconds(pid), cpu_seconds()
        sampler.start()
        seconds = await _one_message(pub, payload, received, k, sampler)
        stop.set()
        sampler.join()
        rows.append(
            {
                "subscribers": k,
                "bytes": args.bytes,
                "received": received[0],
                "seconds": round(seconds, 3),
                "aggregate_MB_s": round(received[0] * args.bytes / seconds / 1e6, 1),
                "broker_rss_mb_before": round(rss0 / 1024),
                "broker_rss_mb_peak": round(sampler.peak_rss_kb / 1024),
                "copies_held_at_peak": round((sampler.peak_rss_kb - rss0) * 1024 / args.bytes, 1),
                "broker_cpu_s": round(cpu_seconds(pid) - cpu_b, 2),
                "subscribers_cpu_s": round(cpu_seconds() - cpu_s, 2),
                "lowest_available_gb": round(sampler.low_available_kb / 1024**2, 1),
                "aborted": sampler.aborted,
            }
        )
        if sampler.aborted:
            break
    for conn in [*subs, pub]:
        if conn.transport is not None:
            conn.send(b"\xe0\x00")  # DISCONNECT
            conn.transport.close()
    return rows


def bench(k: int, args: argparse.Namespace) -> list[dict]:
    """One K on a fresh broker (so that its memory starts from the same baseline)."""
    with (
        tempfile.TemporaryDirectory(prefix="wakefl-fanout-", dir="/tmp") as tmp,
        ManagedBroker(Path(tmp) / "broker") as broker,
    ):
        assert broker.proc is not None
        return asyncio.run(fan_out(broker.port, broker.proc.pid, k, args))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bytes", type=int, default=FP16_DOWNLINK_BYTES, help="message size")
    p.add_argument("--subscribers", type=int, nargs="+", default=[10, 100, 300, 1000])
    p.add_argument("--repeats", type=int, default=2, help="messages per K (one at a time)")
    p.add_argument("--min-available-gb", type=float, default=4.0)
    args = p.parse_args(argv)
    for k in args.subscribers:
        rows = bench(k, args)
        for row in rows:
            print(json.dumps(row), flush=True)
        if any(r["aborted"] for r in rows):
            print(f"stopped at {k} subscribers: available memory under the floor", flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
