"""Peak memory (RSS) of a device across many federated rounds at the default model size.

The device keeps one personal model, the running-variance mean (one parameter vector) and
a few scalars, whatever the number of rounds, so its resident memory must stay flat. This
runs a real managed mosquitto, the real aggregation server (in this process) and one
`DeviceClient` in a child process over 50 rounds with 1-step local training (the memory
of training itself does not grow with rounds either, and this keeps the run short), and
prints the device's RSS and peak RSS as the rounds go by.

    .venv/bin/python tools/bench/device_memory.py [--rounds 50] [--width 1.0]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_STRATEGY_ARGS = {"lr": 0.01, "batch_size": 2, "l_max": 1, "warmup_steps": 1}


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"{field} not in /proc/self/status")


def _device_process(url: str, state_dir: str, width: float, out: mp.Queue) -> None:
    import numpy as np
    import torch
    from torch.utils.data import Dataset

    from wakefl.models.kws_cnn import ModelConfig
    from wakefl.sdk.device_client import DeviceClient

    torch.set_num_threads(1)
    window = ModelConfig(width=width).window_samples

    class Tones(Dataset):
        def __init__(self, n: int, seed: int) -> None:
            g = np.random.default_rng(seed)
            t = np.arange(window) / 16000.0
            self.labels = np.array([i % 2 for i in range(n)], dtype=np.int64)
            self.waves = [
                (0.05 * g.standard_normal(window) + 0.3 * y * np.sin(2 * np.pi * 440 * t)).astype(
                    np.float32
                )
                for y in self.labels
            ]

        def __len__(self) -> int:
            return len(self.labels)

        def __getitem__(self, i: int):
            return torch.from_numpy(self.waves[i]), int(self.labels[i])

    samples: list[tuple[int, float, float]] = []

    def progress(line: str) -> None:
        if ": round " in line:
            rid = int(line.split(": round ")[1].split(":")[0])
            samples.append((rid, _status_mb("VmRSS"), _status_mb("VmHWM")))
            out.put(("round", samples[-1]))

    client = DeviceClient(
        "bench-dev",
        "A",
        Tones(16, 1),
        state_dir,
        validation=Tones(16, 2),
        broker_url=url,
        ack_timeout_s=30,
        progress=progress,
    )
    try:
        summary = client.run()
    finally:
        client.close()
    out.put(("done", summary.updates_accepted))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument(
        "--width", type=float, default=1.0, help="model width (default 1.0, the default size)"
    )
    args = ap.parse_args(argv)

    import torch

    from wakefl.models.kws_cnn import KwsCnn, ModelConfig, get_flat_params
    from wakefl.sdk.selffl.registry import make_strategy
    from wakefl.server.aggregation_server import AggregationServer, ServerConfig
    from wakefl.server.broker import ManagedBroker

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="wakefl-bench-mem-"))
    broker = ManagedBroker(tempfile.mkdtemp(prefix="wakefl-bench-broker-")).start()
    try:
        cfg = ModelConfig(width=args.width)
        params = get_flat_params(KwsCnn(cfg))
        print(
            f"model width {args.width}: {params.numel():,} parameters "
            f"({params.numel() * 4 / 1e6:.1f} MB as fp32); {args.rounds} rounds, 1 local step"
        )
        server = AggregationServer(
            ServerConfig(
                broker_url=broker.url,
                state_dir=work / "server",
                initial_params=params,
                model_config=cfg.to_dict(),
                rounds=args.rounds,
                round_timeout=300,
                devices={"bench-dev": "A"},
                strategy_args=_STRATEGY_ARGS,
                ack_timeout_s=30,
            ),
            make_strategy("selffl", **_STRATEGY_ARGS),
            progress=lambda line: None,
        )
        threading.Thread(target=server.run, daemon=True).start()

        ctx = mp.get_context("spawn")
        q: mp.Queue = ctx.Queue()
        child = ctx.Process(
            target=_device_process, args=(broker.url, str(work / "device"), args.width, q)
        )
        t0 = time.perf_counter()
        child.start()
        rows, accepted = _watch_device(q)
        child.join(60)
        wall = time.perf_counter() - t0
    finally:
        broker.stop()
        shutil.rmtree(broker.state_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    return _verdict(rows, wall, accepted)


def _watch_device(q: Any) -> tuple[list[tuple[int, float, float]], Any]:
    """The device process's (round, RSS, peak RSS) rows, printed as they come, until it
    reports how many updates were accepted."""
    rows: list[tuple[int, float, float]] = []
    print(f"{'round':>5} {'RSS MB':>8} {'peak RSS MB':>12}")
    while True:
        kind, value = q.get(timeout=600)
        if kind == "done":
            return rows, value
        rows.append(value)
        rid, rss, peak = value
        if rid <= 3 or rid % 5 == 0:
            print(f"{rid:>5} {rss:>8.1f} {peak:>12.1f}", flush=True)


def _verdict(rows: list[tuple[int, float, float]], wall: float, accepted: Any) -> int:
    if len(rows) < 10:
        print(f"only {len(rows)} rounds completed", file=sys.stderr)
        return 1
    ref = rows[4]  # after a few rounds: imports, first allocations and caches are done
    last = rows[-1]
    growth = last[2] - ref[2]
    print(f"{len(rows)} rounds in {wall:.0f} s, {accepted} updates accepted")
    print(
        f"peak RSS after round {ref[0]}: {ref[2]:.1f} MB; after round {last[0]}: "
        f"{last[2]:.1f} MB; growth {growth:+.1f} MB "
        f"({(last[2] - ref[2]) / ref[2] * 100:+.1f}%)"
    )
    print(f"RSS after round {ref[0]}: {ref[1]:.1f} MB; after round {last[0]}: {last[1]:.1f} MB")
    flat = growth <= max(16.0, 0.05 * ref[2])
    print("flat" if flat else "GROWING: the device's memory depends on the number of rounds")
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
