"""Sharded aggregation benchmark (real mosquitto on 127.0.0.1): a round's aggregation time
with one process and with a coordinator and 0, 1, 2 or 4 aggregation workers, and the
peak memory of each process, on the same recorded updates.

    python -m wakefl.tools.fleet.bench_sharded [--updates 40] [--workers 0 1 2 4] [--numel N]

For each number of updates, one state folder is prepared (in a child process): a round
opened for that many devices with every update recorded (int8-delta, as the fleet sends
them; a full-size model by default). Each configuration runs on a fresh copy: the server
resumes the round, finds every sampled device answered and aggregates at once, so the
time measured is the aggregation (screening and Self-FL's passes over the recorded
files), not the collection. The single process and the coordinator run in a child process
each; the workers are `wakefl server --role worker` processes, started and online before
the coordinator. Peak RSS is each process's VmHWM. Prints one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from wakefl.protocol import messages as M
from wakefl.server.process_settings import apply_server_settings

FLEET = "bench"
_RECORD = {"sigma_sq": 0.1, "has_variance": 1.0, "local_steps": 1.0}


def _vm_hwm_mb(pid: int | str = "self") -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _devices(n: int) -> dict[str, str]:
    return {f"d{i:04d}": f"t{i % 5}" for i in range(n)}


def _initial(numel: int | None) -> torch.Tensor:
    if numel is None:
        from wakefl.tools.fleet.bench_federation import full_model_params

        return full_model_params()[0]
    return torch.randn(numel, generator=torch.Generator().manual_seed(0))


def prepare(state: Path, n: int, numel: int | None) -> None:
    """A state folder with round 1 open and `n` int8-delta updates on record."""
    from wakefl.sdk.selffl.registry import make_strategy
    from wakefl.server.state_store import StateStore

    params = _initial(numel)
    store = StateStore(state)
    store.save_initial_state(make_strategy("selffl").init_server(params))
    devices = _devices(n)
    store.open_round(1, sorted(devices), time.time() + 3600)
    run_id = store.run_id()
    g = torch.Generator().manual_seed(1)
    for i, (dev, typ) in enumerate(sorted(devices.items())):
        up = M.Uplink(
            FLEET,
            run_id,
            dev,
            typ,
            1,
            params + 0.01 * torch.randn(params.numel(), generator=g),
            10,
            {**_RECORD, "sigma_sq": 0.1 + i * 1e-3},
        )
        store.record_update(up, M.encode(up, uplink_codec="int8-delta", base=params))
    store.close()
    (state / "fleet.json").write_text(json.dumps({"devices": devices}))
    torch.save(params, state / "initial.pt")


def serve(state: Path, role: str, url: str) -> None:
    """Resume the prepared round as one process or as the coordinator; print its figures."""
    from wakefl.sdk.selffl.registry import make_strategy
    from wakefl.server.aggregation_server import AggregationServer, ServerConfig
    from wakefl.server.sharded_coordinator import ShardedCoordinator

    cfg = ServerConfig(
        broker_url=url,
        state_dir=state,
        initial_params=torch.load(state / "initial.pt"),
        fleet=FLEET,
        rounds=1,
        round_timeout=600,
        devices=json.loads((state / "fleet.json").read_text())["devices"],
    )
    cls = ShardedCoordinator if role == "coordinator" else AggregationServer
    server = cls(cfg, make_strategy("selffl"), progress=lambda s: None)
    server.run()
    rep = server.reports[0]
    extra = {}
    if isinstance(server, ShardedCoordinator):
        extra = {"passes_local": server.passes_local, "passes_reassigned": server.passes_reassigned}
    print(
        json.dumps(
            {
                "updates": len(rep.reported),
                "aggregate_s": rep.phases_s["aggregate"],
                "peak_rss_mb": _vm_hwm_mb(),
                **extra,
            }
        )
    )


def _start_worker(url: str, state: Path, wid: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "wakefl.tools.cli", "server", "--role", "worker"]
    cmd += ["--worker-id", wid, "--broker", url, "--state", str(state), "--fleet", FLEET]
    cmd += ["--devices", str(state / "fleet.json"), "--rounds", "1"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # online once it printed its first line
        if line.startswith("aggregation worker"):
            return proc
    raise RuntimeError(f"worker {wid} exited before it was online")


def _watch_peaks(procs: list[subprocess.Popen], peaks: dict[int, float], stop: threading.Event):
    while not stop.is_set():
        for p in procs:
            peaks[p.pid] = max(peaks.get(p.pid, 0.0), _vm_hwm_mb(p.pid))
        time.sleep(0.1)


def run_config(template: Path, role: str, workers: int, url: str) -> dict:
    """One configuration on a fresh copy of the prepared state folder."""
    with tempfile.TemporaryDirectory(prefix="wakefl-shard-", dir="/tmp") as tmp:
        state = Path(tmp) / "state"
        shutil.copytree(template, state)
        procs = [_start_worker(url, state, f"w{i}") for i in range(workers)]
        peaks: dict[int, float] = {}
        stop = threading.Event()
        watcher = threading.Thread(target=_watch_peaks, args=(procs, peaks, stop), daemon=True)
        watcher.start()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "wakefl.tools.fleet.bench_sharded",
                "--serve",
                role,
                url,
                str(state),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        for p in procs:
            p.wait(120)
        stop.set()
        watcher.join()
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(role=role, workers=workers, worker_peak_rss_mb=[peaks[p.pid] for p in procs])
    return result


def _bench_count(template: Path, n: int, args: argparse.Namespace, url: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "wakefl.tools.fleet.bench_sharded",
        "--prepare",
        str(template),
        str(n),
    ]
    cmd += ["--numel", str(args.numel)] if args.numel else []
    subprocess.run(cmd, check=True)
    configs = [] if args.no_single else [("single", 0)]
    configs += [("coordinator", k) for k in args.workers]
    for role, k in configs:
        print(json.dumps(run_config(template, role, k, url)), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--updates", type=int, nargs="*", default=[40])
    p.add_argument("--workers", type=int, nargs="*", default=[0, 1, 2, 4])
    p.add_argument("--numel", type=int, default=None, help="parameters (default: full model)")
    p.add_argument("--no-single", action="store_true", help="skip the single-process run")
    p.add_argument("--serve", nargs=3, default=None, help=argparse.SUPPRESS)
    p.add_argument("--prepare", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    apply_server_settings()  # as `wakefl server` does, in every role this benchmark runs
    if args.serve:
        serve(Path(args.serve[2]), args.serve[0], args.serve[1])
        return 0
    if args.prepare:
        prepare(Path(args.prepare[0]), int(args.prepare[1]), args.numel)
        return 0
    from wakefl.server.broker import ManagedBroker

    with tempfile.TemporaryDirectory(prefix="wakefl-shard-", dir="/tmp") as tmp:
        broker = ManagedBroker(Path(tmp) / "broker").start()
        try:
            for n in args.updates:
                _bench_count(Path(tmp) / f"prepared-{n}", n, args, broker.url)
        finally:
            broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
