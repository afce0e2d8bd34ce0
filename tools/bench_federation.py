"""Federation benchmarks (real mosquitto on 127.0.0.1, full-size model, no-op training).

    python -m wakefl.tools.bench_federation [--devices 5 50] [--agg 20 200] [--rounds 3]

Prints: bytes per update (fp32/fp16); per-round orchestration overhead (round wall time
minus the slowest device's compute, which is ~0 here: devices echo the global model);
server aggregation throughput and peak RSS for N recorded updates (one child process per
N, so the peaks do not mix).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from wakefl.sdk import messages as M
from wakefl.sdk import topics
from wakefl.sdk.mqtt_link import MqttLink


def full_model_params() -> tuple[torch.Tensor, dict]:
    from wakefl.models.kws_cnn import KwsCnn, ModelConfig, get_flat_params

    torch.manual_seed(0)
    cfg = ModelConfig()
    return get_flat_params(KwsCnn(cfg)).detach().clone(), cfg.to_dict()


class EchoDevice:
    """Answers each round at once with the global model plus a tiny shift (no training)."""

    def __init__(self, url: str, fleet: str, dev: str, typ: str) -> None:
        self.fleet, self.dev, self.typ = fleet, dev, typ
        self.link = MqttLink(url, dev, will=(topics.hello(fleet, dev),
                                             M.encode(M.Hello(fleet, dev, typ, online=False))))
        self.todo: M.Downlink | None = None
        self.done: set[int] = set()
        self.compute_s: dict[int, float] = {}
        self.cv = threading.Condition()
        self.link.subscribe(topics.downlink(fleet), self._on_down)
        self.link.subscribe(topics.ack(fleet, dev), lambda t, p: None)
        self.link.connect()
        self.link.publish(topics.hello(fleet, dev), M.encode(M.Hello(fleet, dev, typ)), retain=True)
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.stop = False
        self.thread.start()

    def _on_down(self, topic: str, payload: bytes) -> None:
        msg = M.decode(payload)
        with self.cv:
            self.todo = msg
            self.cv.notify()

    def _work(self) -> None:
        while not self.stop:
            with self.cv:
                self.cv.wait_for(lambda: self.stop or (self.todo is not None and self.todo.round_id not in self.done), 0.5)
                down = self.todo
            if self.stop or down is None or down.final or down.round_id in self.done:
                continue
            self.done.add(down.round_id)
            if self.dev not in down.instructions:
                continue
            t0 = time.perf_counter()
            up = M.Uplink(self.fleet, down.run_id, self.dev, self.typ, down.round_id,
                          down.global_params + 1e-3, 0.1, 100, 1,
                          scalars={"has_variance": 1.0})
            payload = M.encode(up)
            self.compute_s[down.round_id] = time.perf_counter() - t0
            self.link.publish(topics.uplink(self.fleet, self.dev), payload)

    def close(self) -> None:
        self.stop = True
        with self.cv:
            self.cv.notify()
        self.thread.join()
        self.link.close()


def bench_rounds(n_devices: int, rounds: int, params: torch.Tensor, model_cfg: dict) -> None:
    from wakefl.sdk.selffl.registry import make_strategy
    from wakefl.server.aggregation_server import AggregationServer, ServerConfig
    from wakefl.server.broker import ManagedBroker

    with tempfile.TemporaryDirectory(prefix="wakefl-bench-", dir="/tmp") as tmp:
        broker = ManagedBroker(Path(tmp) / "broker").start()
        try:
            fleet = "bench"
            reg = {f"dev{i:03d}": f"type{i % 5}" for i in range(n_devices)}
            devices = [EchoDevice(broker.url, fleet, d, t) for d, t in reg.items()]
            cfg = ServerConfig(broker_url=broker.url, state_dir=Path(tmp) / "server",
                               initial_params=params, model_config=model_cfg, fleet=fleet,
                               rounds=rounds, devices=reg, round_timeout=300)
            server = AggregationServer(cfg, make_strategy("selffl"), progress=lambda s: None)
            server.run()
            for d in devices:
                d.close()
        finally:
            broker.stop()
    for rep in server.reports:
        slowest = max(d.compute_s.get(rep.round_id, 0.0) for d in devices)
        print(f"  {n_devices:3d} devices, round {rep.round_id}: wall {rep.wall_s:.2f} s, slowest "
              f"device compute {slowest:.3f} s, orchestration overhead {rep.wall_s - slowest:.2f} s")


def _peak_rss_kb() -> int:
    """VmHWM of this process (ru_maxrss would carry the parent's peak across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak_rss() -> int:
    """Reset the peak to the current RSS (Linux clear_refs 5); returns the current RSS."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return _peak_rss_kb()


def _agg_child(n: int, numel: int) -> None:
    """Record n full-size updates in a fresh store, then aggregate them from disk."""
    from wakefl.sdk.selffl.registry import make_strategy
    from wakefl.server.state_store import StateStore

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="wakefl-agg-", dir="/tmp") as tmp:
        store = StateStore(tmp)
        base = torch.randn(numel)
        for i in range(n):
            up = M.Uplink("b", "r", f"d{i:04d}", f"t{i % 5}", 1, base + 0.01 * i, 0.1 + i * 1e-3, 10, 1,
                          scalars={"has_variance": 1.0})
            store.record_update(up, M.encode(up))
            del up
        strategy = make_strategy("selffl")
        state = strategy.init_server(base)
        rss_before = _reset_peak_rss()
        view = store.updates(1, numel)
        t0 = time.perf_counter()
        new = strategy.aggregate(state, view, 1.0)
        dt = time.perf_counter() - t0
        rss_after = _peak_rss_kb()
        assert torch.isfinite(new.global_params).all()
        store.close()
    gb = 2 * n * numel * 4 / 1e9  # the strategy reads every update twice
    print(json.dumps({"n": n, "seconds": dt, "updates_per_s": n / dt, "GB_per_s": gb / dt,
                      "rss_mb_before": rss_before / 1024, "peak_rss_mb_after": rss_after / 1024}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, nargs="*", default=[5, 50])
    p.add_argument("--agg", type=int, nargs="*", default=[20, 200])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--agg-child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--numel", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.agg_child is not None:
        _agg_child(args.agg_child, args.numel)
        return 0
    params, model_cfg = full_model_params()
    d = params.numel()
    print(f"full-size model: {d} parameters")
    for dt in ("fp32", "fp16"):
        up = M.Uplink("f", "r", "dev", "t", 1, params, 0.1, 100, 10, 0.95, 1.0, {"has_variance": 1.0})
        print(f"bytes per update {dt}: {len(M.encode(up, wire_dtype=dt))}")
    print("per-round orchestration overhead (no-op training):")
    for n in args.devices:
        bench_rounds(n, args.rounds, params, model_cfg)
    print("server aggregation from the disk-backed store (Self-FL, client-level):")
    for n in args.agg:
        out = subprocess.run([sys.executable, "-m", "wakefl.tools.bench_federation", "--agg-child",
                              str(n), "--numel", str(d)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  {n:4d} updates: {r['seconds']:.2f} s, {r['updates_per_s']:.1f} updates/s, "
              f"{r['GB_per_s']:.2f} GB/s read, RSS {r['rss_mb_before']:.0f} MB before, "
              f"peak {r['peak_rss_mb_after']:.0f} MB during aggregation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
