"""Memory of `RunningVariance` over many updates of a large parameter vector.

Prints resident set size and tracemalloc-visible Python allocations after updates
1, 2, 5, 10, 50, 100 and 200 for a flat float32 vector (default 3M entries): the figures
must stay flat, since only the running mean and two scalars are kept.

    .venv/bin/python -m wakefl.tools.fleet.bench_running_variance [--dim 3000000] [--updates 200]
"""

from __future__ import annotations

import argparse
import resource
import time
import tracemalloc


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=3_000_000)
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    from wakefl.sdk.selffl.running_variance import RunningVariance

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(args.seed)
    base = torch.randn(args.dim, generator=gen)
    x = torch.empty(args.dim)
    rv = RunningVariance()
    marks = {1, 2, 5, 10, 50, 100, args.updates}
    tracemalloc.start()
    start = time.perf_counter()
    print(f"dim={args.dim} float32 ({args.dim * 4 / 2**20:.1f} MiB per vector)")
    print(
        f"{'update':>7}{'RSS MiB':>10}{'tracemalloc cur MiB':>21}{'peak MiB':>10}{'variance':>14}"
    )
    for t in range(1, args.updates + 1):
        torch.randn(args.dim, generator=gen, out=x)
        x.mul_(0.01).add_(base)  # a drifting "personal model"
        value = rv.update(x)
        if t in marks:
            cur, peak = tracemalloc.get_traced_memory()
            print(
                f"{t:>7}{_rss_mib():>10.1f}{cur / 2**20:>21.3f}{peak / 2**20:>10.3f}{value:>14.6g}"
            )
    elapsed = time.perf_counter() - start
    print(
        f"{args.updates} updates in {elapsed:.2f} s ({elapsed / args.updates * 1e3:.1f} ms/update, "
        f"including drawing the random vector)"
    )
    return 0


if __name__ == "__main__":
    from wakefl.tools.script_errors import run_script

    raise SystemExit(run_script(main, __file__))
