"""Federation benchmarks (real mosquitto on 127.0.0.1, full-size model, no-op training).

    python -m wakefl.tools.fleet.bench_federation [--devices 5 50] [--agg 20 200] [--rounds 3]
                                            [--warmup 2] [--wire-dtype fp32|fp16]
                                            [--uplink-codec int8-delta --load-gen]

Prints: bytes per update (fp32/fp16); per-round orchestration overhead (round wall time
minus the slowest device's compute). Each simulated device is a separate process whose
uplinks are encoded before the run (no training, no encoding in the round), so a round's
wall time is the server's work (downlink encode, receipt, validation, durable recording,
acks, aggregation, state persistence) plus the broker's transfers; the devices' compute is
reading the downlink's header. Two references measured in the same run put the figure in
context: the broker's single-stream rate (so the least time a round's model transfers can
take through it) and the CPU seconds each party used per round, since on a small machine
the device processes share the cores with the broker and the server. Then: server
aggregation throughput and peak RSS for N recorded updates (one child process per N, so
the peaks do not mix).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from wakefl.protocol import frames, topics
from wakefl.protocol import messages as M
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.tools.fleet.bench_federation_report import (
    packed_up_bytes,
    print_cpu_after_warmup,
    print_cpu_per_update,
    print_floor,
    print_loadgen,
    print_rounds,
    print_update_sizes,
)
from wakefl.tools.fleet.process_stats import (
    CpuAtRoundEnds,
    broker_pid,
    cpu_seconds,
    peak_rss_kb,
    reset_peak_rss,
)

# A Self-FL uplink record (what SelfFL.uplink_schema asks for).
_RECORD = {"sigma_sq": 0.1, "has_variance": 1.0, "local_steps": 1.0}


def full_model_params() -> tuple[torch.Tensor, dict]:
    from wakefl.models.kws_cnn import KwsCnn, ModelConfig, get_flat_params

    torch.manual_seed(0)
    cfg = ModelConfig()
    return get_flat_params(KwsCnn(cfg)).detach().clone(), cfg.to_dict()


def _device_process(
    url: str,
    fleet: str,
    dev: str,
    typ: str,
    run_id: str,
    rounds: int,
    params: torch.Tensor,
    wire_dtype: str,
    ready: Any,
    results: Any,
) -> None:
    """One simulated device in its own process: its uplinks for every round are encoded
    before the run starts, so in a round it only reads the downlink's header (round id,
    sampled devices) and publishes, and the benchmark times the server and the broker."""
    payloads = {
        r: M.encode(
            M.Uplink(fleet, run_id, dev, typ, r, params + 1e-3 * r, 100, _RECORD),
            wire_dtype=wire_dtype,
        )
        for r in range(1, rounds + 1)
    }
    compute_s: dict[int, float] = {}
    done = threading.Event()
    link = MqttLink(
        url, dev, will=(topics.hello(fleet, dev), M.encode(M.Hello(fleet, dev, typ, online=False)))
    )

    def on_down(topic: str, payload: bytes) -> None:
        t0 = time.perf_counter()
        meta = frames.peek(payload)  # the fields alone: the tensors are never read here
        if meta["final"]:
            done.set()
            return
        rid = meta["round_id"]
        if rid in compute_s or dev not in meta["instructions"] or rid not in payloads:
            return
        compute_s[rid] = time.perf_counter() - t0
        # Inside the network thread's handler: queue only (see MqttLink.publish).
        link.publish(topics.uplink(fleet, dev), payloads.pop(rid), wait=False)

    link.subscribe(topics.downlink(fleet), on_down)
    link.subscribe(topics.ack(fleet, dev), lambda t, p: None)
    link.connect()
    link.publish(topics.hello(fleet, dev), M.encode(M.Hello(fleet, dev, typ)), retain=True)
    cpu0 = cpu_seconds()
    ready.release()
    done.wait(600)
    cpu = cpu_seconds() - cpu0
    link.close()
    results.put((dev, compute_s, cpu))


def broker_throughput(url: str, nbytes: int, count: int = 10, timeout: float = 120.0) -> float:
    """Bytes per second that the broker moves from one publisher to one subscriber, for
    `count` QoS 1 messages of `nbytes` (the reference for the round overhead: a round moves
    every uplink and every copy of the downlink through the same broker)."""
    payload = bytes(nbytes)
    got: list[float] = []
    arrived = threading.Event()

    def on_msg(topic: str, data: bytes) -> None:
        got.append(time.perf_counter())
        if len(got) == count:
            arrived.set()

    sub = MqttLink(url, "bench-throughput-sub")
    pub = MqttLink(url, "bench-throughput-pub")
    try:
        sub.subscribe("bench/throughput", on_msg)
        sub.connect()
        pub.connect()
        pub.publish("bench/throughput", payload, timeout=timeout)  # warm the broker's buffers
        end = time.monotonic() + timeout
        while not got and time.monotonic() < end:
            time.sleep(0.01)
        got.clear()
        t0 = time.perf_counter()
        for _ in range(count):
            pub.publish("bench/throughput", payload, timeout=timeout)
        if not arrived.wait(timeout):
            raise RuntimeError(f"only {len(got)}/{count} throughput messages arrived")
        return count * nbytes / (got[-1] - t0)
    finally:
        pub.close()
        sub.close()


def _bench_config(
    broker_url: str,
    tmp: str,
    params: torch.Tensor,
    model_cfg: dict,
    rounds: int,
    reg: dict[str, str],
    wire_dtype: str,
    *,
    fleet: str = "bench",
    round_timeout: float = 300,
    **extra: Any,
):
    """The benchmark server's configuration (state under `tmp`/server)."""
    from wakefl.server.aggregation_server import ServerConfig

    return ServerConfig(
        broker_url=broker_url,
        state_dir=Path(tmp) / "server",
        initial_params=params,
        model_config=model_cfg,
        fleet=fleet,
        rounds=rounds,
        devices=reg,
        round_timeout=round_timeout,
        wire_dtype=wire_dtype,
        **extra,
    )


def _collect_devices(
    results: Any, procs: list, cpu: dict[str, float]
) -> dict[str, dict[int, float]]:
    """Each device process's compute seconds per round; adds their CPU seconds to
    cpu["devices"]."""
    compute: dict[str, dict[int, float]] = {}
    cpu["devices"] = 0.0
    for _ in procs:
        dev, dev_compute, dev_cpu = results.get(timeout=120)
        compute[dev] = dev_compute
        cpu["devices"] += dev_cpu
    return compute


def bench_rounds(
    n_devices: int,
    rounds: int,
    params: torch.Tensor,
    model_cfg: dict,
    wire_dtype: str = "fp32",
    warmup: int = 0,
) -> list[float]:
    """Run `warmup` + `rounds` rounds with `n_devices` device processes; print every round
    and return the overheads of the last `rounds` (the median is taken over those)."""
    rounds += warmup
    from wakefl.sdk.selffl.registry import make_strategy
    from wakefl.server.aggregation_server import AggregationServer
    from wakefl.server.broker import ManagedBroker
    from wakefl.server.state_store import StateStore

    ctx = mp.get_context("fork")  # the children inherit the imported modules and `params`
    with tempfile.TemporaryDirectory(prefix="wakefl-bench-", dir="/tmp") as tmp:
        broker = ManagedBroker(Path(tmp) / "broker").start()
        procs: list[Any] = []
        try:
            up_bytes = len(
                M.encode(
                    M.Uplink("bench", "r", "dev000", "type0", 1, params, 100, _RECORD),
                    wire_dtype=wire_dtype,
                )
            )
            rate = broker_throughput(broker.url, up_bytes)
            fleet = "bench"
            reg = {f"dev{i:03d}": f"type{i % 5}" for i in range(n_devices)}
            store = StateStore(Path(tmp) / "server")
            run_id = store.run_id()  # the server reuses it: the devices pre-encode for this run
            store.close()
            results = _spawn_devices(
                ctx, procs, broker.url, fleet, reg, run_id, rounds, params, wire_dtype
            )
            cfg = _bench_config(broker.url, tmp, params, model_cfg, rounds, reg, wire_dtype)
            server = AggregationServer(cfg, make_strategy("selffl"), progress=lambda s: None)
            pid = broker_pid(broker)
            broker_cpu0, server_cpu0, wall0 = cpu_seconds(pid), cpu_seconds(), time.monotonic()
            server.run()
            cpu = {
                "broker": cpu_seconds(pid) - broker_cpu0,
                "server": cpu_seconds() - server_cpu0,
            }
            wall = time.monotonic() - wall0
            compute = _collect_devices(results, procs, cpu)
            for proc in procs:
                proc.join(30)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            broker.stop()
    print_cpu_per_update(n_devices, server, cpu["server"])
    return print_rounds(
        n_devices, server.reports, compute, cpu, wall, rounds, warmup, up_bytes, rate
    )


def _spawn_devices(
    ctx: Any,
    procs: list,
    broker_url: str,
    fleet: str,
    reg: dict[str, str],
    run_id: str,
    rounds: int,
    params: torch.Tensor,
    wire_dtype: str,
) -> Any:
    """Start one process per device (appended to `procs`) and wait until every one has
    pre-encoded its updates; returns the queue their results come back on."""
    ready, results = ctx.Semaphore(0), ctx.Queue()
    for d, t in reg.items():
        proc = ctx.Process(
            target=_device_process,
            daemon=True,
            args=(broker_url, fleet, d, t, run_id, rounds, params, wire_dtype, ready, results),
        )
        proc.start()
        procs.append(proc)
    for _ in tqdm(procs, desc=f"{len(reg)} devices pre-encoding", leave=False):
        if not ready.acquire(timeout=600):
            raise RuntimeError("a device process did not come up")
    return results


def _agg_child(n: int, numel: int) -> None:
    """Record n full-size updates in a fresh store, then aggregate them from disk."""
    from wakefl.sdk.selffl.registry import make_strategy
    from wakefl.server.state_store import StateStore

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="wakefl-agg-", dir="/tmp") as tmp:
        store = StateStore(tmp)
        base = torch.randn(numel)
        for i in range(n):
            up = M.Uplink(
                "b",
                "r",
                f"d{i:04d}",
                f"t{i % 5}",
                1,
                base + 0.01 * i,
                10,
                {**_RECORD, "sigma_sq": 0.1 + i * 1e-3},
            )
            store.record_update(up, M.encode(up))
            del up
        strategy = make_strategy("selffl")
        state = strategy.init_server(base)
        rss_before = reset_peak_rss()
        view = store.updates(1, numel)
        t0 = time.perf_counter()
        new = strategy.aggregate(state, view, 1.0)
        dt = time.perf_counter() - t0
        rss_after = peak_rss_kb()
        assert torch.isfinite(new.global_params).all()
        store.close()
    gb = 2 * n * numel * 4 / 1e9  # the strategy reads every update twice
    print(
        json.dumps(
            {
                "n": n,
                "seconds": dt,
                "updates_per_s": n / dt,
                "GB_per_s": gb / dt,
                "rss_mb_before": rss_before / 1024,
                "peak_rss_mb_after": rss_after / 1024,
            }
        )
    )


def _start_load_generator(
    broker_url: str, n_devices: int, follower_only: bool = False
) -> subprocess.Popen:
    """tools/fleet/load_fleet.py playing `n_devices` devices, once it says it is ready."""
    gen = subprocess.Popen(
        [sys.executable, "-m", "wakefl.tools.fleet.load_fleet", "--broker", broker_url]
        + ["--fleet", "bench", "--devices", str(n_devices), "--time-limit", "1800"]
        + (["--follower-only"] if follower_only else []),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert gen.stdout is not None
    if gen.stdout.readline().strip() != f"ready {n_devices}":
        if gen.poll() is None:
            gen.kill()
        raise RuntimeError("the load generator did not come up")
    return gen


def _start_workers(
    broker_url: str, cfg: Any, reg: dict[str, str], workers: int
) -> list[subprocess.Popen]:
    """`workers` aggregation workers (`wakefl server --role worker`) on the coordinator's
    state folder, each online (it printed its first line) before the rounds start."""
    fleet_file = cfg.state_dir / "bench-fleet.json"
    fleet_file.write_text(json.dumps({"devices": reg}))
    procs = []
    for i in range(workers):
        cmd = [sys.executable, "-m", "wakefl.tools.cli", "server", "--role", "worker"]
        cmd += ["--worker-id", f"w{i}", "--broker", broker_url, "--state", str(cfg.state_dir)]
        cmd += ["--fleet", cfg.fleet, "--devices", str(fleet_file), "--rounds", str(cfg.rounds)]
        log_file = cfg.state_dir / f"worker-w{i}.log"
        with log_file.open("w") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        procs.append(proc)
        deadline = time.monotonic() + 120
        while "aggregation worker" not in log_file.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker w{i} did not come online: {log_file.read_text()}")
            time.sleep(0.1)
    return procs


def _reap_workers(procs: list[subprocess.Popen], timeout: float = 120.0) -> float:
    """Wait for the workers to end (they do once the run is over); their CPU seconds."""
    total, deadline = 0.0, time.monotonic() + timeout
    for proc in procs:
        while time.monotonic() < deadline:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                total += usage.ru_utime + usage.ru_stime
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"worker {proc.pid} did not end after the run")
    return total


def _loadgen_server(cfg: Any, reg: dict[str, str], workers: int) -> tuple[Any, list]:
    """The server of a load-generator run: one process, or (`workers` > 0) a sharded
    coordinator in this process with its worker processes, online."""
    from wakefl.sdk.selffl.registry import make_strategy
    from wakefl.server.aggregation_server import AggregationServer
    from wakefl.server.sharded_coordinator import ShardedCoordinator

    strategy = make_strategy("selffl")
    if not workers:
        return AggregationServer(cfg, strategy, progress=lambda s: None), []
    server = ShardedCoordinator(cfg, strategy, progress=lambda s: None)
    # The workers wait for the run's first state; the coordinator resumes it.
    server.store.save_initial_state(strategy.init_server(cfg.initial_params.float()))
    return server, _start_workers(cfg.broker_url, cfg, reg, workers)


def bench_rounds_loadgen(
    n_devices: int,
    rounds: int,
    params: torch.Tensor,
    model_cfg: dict,
    wire_dtype: str,
    codec: str,
    warmup: int,
    follower_only: bool = False,
    workers: int = 0,
) -> None:
    """Rounds with `n_devices` played by one load generator (tools/fleet/load_fleet.py): each
    round's wall time against the transport floor (every uplink and downlink copy at the
    broker's single-stream rate; `follower_only`: one downlink copy), each party's CPU
    seconds, and what became of every update."""
    from wakefl.server.broker import ManagedBroker

    rounds += warmup
    up_bytes = packed_up_bytes(params, codec, _RECORD)
    down_bytes = packed_up_bytes(params, wire_dtype, _RECORD)
    with tempfile.TemporaryDirectory(prefix="wakefl-bench-", dir="/tmp") as tmp:
        broker = ManagedBroker(Path(tmp) / "broker").start()
        procs: list[subprocess.Popen] = []  # killed if still running at the end
        try:
            rate_up = broker_throughput(broker.url, up_bytes)
            rate_down = broker_throughput(broker.url, down_bytes)
            gen = _start_load_generator(broker.url, n_devices, follower_only)
            procs.append(gen)
            reg = {f"dev{i:04d}": f"type{i % 5}" for i in range(n_devices)}
            cfg = _bench_config(
                broker.url, tmp, params, model_cfg, rounds, reg, wire_dtype,
                round_timeout=900, uplink_codec=codec,
            )  # fmt: skip
            server, shards = _loadgen_server(cfg, reg, workers)
            procs += shards
            pid = broker_pid(broker)
            broker_cpu0, server_cpu0, wall0 = cpu_seconds(pid), cpu_seconds(), time.monotonic()
            marks = CpuAtRoundEnds(server)
            server.run()
            at_round_ends = marks.stop()
            out, _ = gen.communicate(timeout=600)
            cpu = {
                "broker": cpu_seconds(pid) - broker_cpu0,
                "server": cpu_seconds() - server_cpu0 + _reap_workers(shards),
            }
            wall = time.monotonic() - wall0
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            broker.stop()
    report = json.loads(out.strip().splitlines()[-1])
    cpu["load generator"] = report["cpu_s"]
    down_copies = 1 if follower_only else n_devices
    floor = n_devices * up_bytes / rate_up + down_copies * down_bytes / rate_down
    print_loadgen(n_devices, server, report, cpu, wall, rounds, warmup, floor)
    if not workers:  # a worker's CPU is known only once it exits
        print_cpu_after_warmup(n_devices, server, at_round_ends, warmup)
    up, down = (up_bytes, codec, rate_up), (down_bytes, wire_dtype, rate_down)
    print_floor(n_devices, up, down, floor, down_copies)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, nargs="*", default=[5, 50])
    p.add_argument("--agg", type=int, nargs="*", default=[20, 200])
    p.add_argument("--rounds", type=int, default=3, help="measured rounds")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="rounds run first and reported apart: a fresh broker, server and page "
        "cache pay one-off costs (first touch of ~1 GB of buffers per round)",
    )
    p.add_argument(
        "--wire-dtype",
        choices=sorted(M.WIRE_DTYPES),
        default="fp32",
        help="tensor dtype on the wire for the round benchmark (both directions)",
    )
    p.add_argument(
        "--uplink-codec",
        choices=["fp32", "fp16", "fp16-delta", "int8-delta"],
        default=None,
        help="what the devices send (default: plain in --wire-dtype)",
    )
    p.add_argument(
        "--load-gen",
        action="store_true",
        help="play the devices with one load-generator process (tools/fleet/load_fleet.py) "
        "instead of one process per device",
    )
    p.add_argument(
        "--follower-only",
        action="store_true",
        help="with --load-gen: one connection subscribes to the downlink instead of every "
        "device's (no fan-out; tools/fleet/bench_fanout.py measures it apart)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="with --load-gen: a sharded server, a coordinator (this process) and this many "
        "`wakefl server --role worker` processes sharing the uplinks (0: one process)",
    )
    p.add_argument(
        "--process-defaults",
        action="store_true",
        help="leave malloc and the GIL switch interval as they are, where `wakefl server` "
        "sets them (server/process_settings.py): the reference for what they save",
    )
    p.add_argument("--agg-child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--numel", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _bench_aggregation(counts: list[int], numel: int) -> None:
    """Server aggregation of each count of updates, each in a fresh child process."""
    print("server aggregation from the disk-backed store (Self-FL, client-level):")
    for n in counts:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "wakefl.tools.fleet.bench_federation",
                "--agg-child",
                str(n),
                "--numel",
                str(numel),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"  {n:4d} updates: {r['seconds']:.2f} s, {r['updates_per_s']:.1f} updates/s, "
            f"{r['GB_per_s']:.2f} GB/s read, RSS {r['rss_mb_before']:.0f} MB before, "
            f"peak {r['peak_rss_mb_after']:.0f} MB during aggregation"
        )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(1)
    if not args.process_defaults:
        from wakefl.server.process_settings import apply_server_settings

        # The server runs in this process: set it up as `wakefl server` does.
        print(f"server process settings: {apply_server_settings()}")
    if args.agg_child is not None:
        _agg_child(args.agg_child, args.numel)
        return 0
    params, model_cfg = full_model_params()
    d = params.numel()
    print(f"full-size model: {d} parameters")
    print_update_sizes(params, _RECORD)
    print(
        f"per-round orchestration overhead ({args.wire_dtype} on the wire, no-op training; devices are separate processes "
        "publishing uplinks encoded before the run, so the figure is server + broker):"
    )
    for n in args.devices:
        if args.load_gen:
            codec = args.uplink_codec or args.wire_dtype
            bench_rounds_loadgen(
                n,
                args.rounds,
                params,
                model_cfg,
                args.wire_dtype,
                codec,
                args.warmup,
                args.follower_only,
                args.workers,
            )
        else:
            bench_rounds(n, args.rounds, params, model_cfg, args.wire_dtype, args.warmup)
    _bench_aggregation(args.agg, d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
