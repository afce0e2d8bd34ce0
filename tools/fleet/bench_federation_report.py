"""What the federation benchmark (tools/fleet/bench_federation.py) prints about its rounds:
each round's wall time against the slowest device's compute or against the transport floor,
what the floor is made of, where the CPU went, and the server's CPU per accepted update, and the bytes of one update in each wire format."""

from __future__ import annotations

import os
import statistics
from typing import Any

import torch

from wakefl.protocol import messages as M


def print_rounds(
    n_devices: int,
    reports: list,
    compute: dict[str, dict[int, float]],
    cpu: dict[str, float],
    wall: float,
    rounds: int,
    warmup: int,
    up_bytes: int,
    rate: float,
) -> list[float]:
    """Print each round's wall time against the slowest device's compute, where the CPU
    went, and the median overhead; returns the overheads after the warm-up rounds."""
    # Each round moves n uplinks and n copies of the downlink (about the same size) through
    # the broker: at the single-stream rate measured above, that alone takes `floor`.
    floor = 2 * n_devices * up_bytes / rate
    print(
        f"  {n_devices:3d} devices: broker moves {rate / 1e6:.0f} MB/s one publisher to one "
        f"subscriber ({up_bytes / 1e6:.1f} MB messages), so a round's {2 * n_devices} model "
        f"transfers take at least {floor:.2f} s (transport floor)"
    )
    overheads = []
    for rep in reports:
        slowest = max(c.get(rep.round_id, 0.0) for c in compute.values())
        overheads.append(rep.wall_s - slowest)
        print(
            f"  {n_devices:3d} devices, round {rep.round_id}: round wall time {rep.wall_s:.2f} s, "
            f"slowest device compute {slowest:.4f} s, orchestration overhead "
            f"{rep.wall_s - slowest:.2f} s ({len(rep.reported)}/{len(rep.sampled)} updates, "
            f"closed by {rep.closed_by}); open {rep.phases_s['open']:.2f} s, collect "
            f"{rep.phases_s['collect']:.2f} s, aggregate+persist {rep.phases_s['aggregate']:.2f} s"
        )
    # Where the CPU went: on this machine every simulated device shares the cores with the
    # broker and the server; in a fleet each device's share runs on the device.
    per_round = {k: v / rounds for k, v in cpu.items()}
    print(
        f"  {n_devices:3d} devices: CPU seconds per round: devices {per_round['devices']:.2f} "
        f"(all {n_devices} together), broker {per_round['broker']:.2f}, server "
        f"{per_round['server']:.2f}; {os.cpu_count()} cores x {wall / rounds:.2f} s wall = "
        f"{(os.cpu_count() or 1) * wall / rounds:.2f} core-seconds available per round"
    )
    measured = overheads[warmup:]
    med = statistics.median(measured)
    print(
        f"  {n_devices:3d} devices: median orchestration overhead {med:.2f} s over rounds "
        f"{warmup + 1}-{rounds} = {med / floor:.2f} x the transport floor"
        + (
            f" (warm-up rounds 1-{warmup}: median {statistics.median(overheads[:warmup]):.2f} s)"
            if warmup
            else ""
        )
    )
    return measured


def print_floor(
    n_devices: int,
    up: tuple[int, str, float],
    down: tuple[int, str, float],
    floor: float,
    down_copies: int,
) -> None:
    """The transport floor and what it is made of: (bytes, format, broker rate) of the
    uplink and of the downlink, and how many downlink copies a round moves."""
    (up_bytes, codec, rate_up), (down_bytes, wire_dtype, rate_down) = up, down
    print(
        f"  {n_devices:4d} devices: uplink {up_bytes / 1e6:.2f} MB ({codec}) at "
        f"{rate_up / 1e6:.0f} MB/s, downlink {down_bytes / 1e6:.2f} MB ({wire_dtype}) at "
        f"{rate_down / 1e6:.0f} MB/s one publisher to one subscriber: transport floor "
        f"{floor:.2f} s a round"
    )
    if down_copies < n_devices:
        print(
            f"  {n_devices:4d} devices: --follower-only: one downlink copy a round, in the "
            "floor as in the run; the fan-out to every device is measured apart "
            "(tools/fleet/bench_fanout.py)"
        )


def print_loadgen(
    n: int,
    server: Any,
    report: dict,
    cpu: dict[str, float],
    wall: float,
    rounds: int,
    warmup: int,
    floor: float,
) -> None:
    walls = []
    for rep in server.reports:
        row = report["rounds"].get(str(rep.round_id), {})
        walls.append(rep.wall_s)
        print(
            f"  {n:4d} devices, round {rep.round_id}: {rep.wall_s:.2f} s "
            f"({rep.wall_s / floor:.2f}x the floor; open {rep.phases_s['open']:.2f}, collect "
            f"{rep.phases_s['collect']:.2f}, aggregate+persist {rep.phases_s['aggregate']:.2f}); "
            f"server recorded {len(rep.reported)}/{len(rep.sampled)}, closed by {rep.closed_by}; "
            f"devices: sent {row.get('sent')}, accepted {row.get('accepted')}, refused "
            f"{row.get('refused')}, unanswered {row.get('unanswered')}, re-sends "
            f"{row.get('resends')}, payload building {row.get('build_s')} s"
        )
    per_round = {k: round(v / rounds, 2) for k, v in cpu.items()}
    med = statistics.median(walls[warmup:])
    print_cpu_per_update(n, server, cpu["server"])
    print(
        f"  {n:4d} devices: CPU seconds per round {per_round} ({os.cpu_count()} cores x "
        f"{wall / rounds:.2f} s wall); server rejections {dict(server.rejections) or 'none'}; "
        f"load generator errors {report['errors'] or 'none'}"
    )
    print(
        f"  {n:4d} devices: median round time {med:.2f} s over rounds {warmup + 1}-{rounds} "
        f"= {med / floor:.2f}x the transport floor ({floor:.2f} s)"
    )


def print_cpu_after_warmup(n: int, server: Any, at_round_ends: list[float], warmup: int) -> None:
    """The server's CPU per accepted update over the rounds after the warm-up ones alone
    (`at_round_ends`: the process's CPU seconds as each round closed)."""
    reports = server.reports
    if not 0 < warmup < len(reports) or len(at_round_ends) != len(reports):
        return
    accepted = sum(len(rep.reported) for rep in reports[warmup:])
    cpu_s = at_round_ends[-1] - at_round_ends[warmup - 1]
    if accepted:
        print(
            f"  {n:4d} devices: server CPU per accepted update after the warm-up, rounds "
            f"{warmup + 1}-{len(reports)}: {1000 * cpu_s / accepted:.1f} ms ({cpu_s:.2f} CPU s "
            f"for {accepted} updates)"
        )


def print_cpu_per_update(n: int, server: Any, server_cpu_s: float) -> None:
    """The server's CPU per update it accepted: every thread of the server process
    (receipt, checks, decoding, recording, acks, screening, aggregation, persisting the
    state) over every round run, warm-up included, divided by the updates aggregated."""
    accepted = sum(len(rep.reported) for rep in server.reports)
    if accepted:
        print(
            f"  {n:4d} devices: server CPU per accepted update {1000 * server_cpu_s / accepted:.1f} "
            f"ms ({server_cpu_s:.2f} CPU s for {accepted} updates, all rounds)"
        )


def packed_up_bytes(params: torch.Tensor, codec: str, record: dict[str, float]) -> int:
    """Bytes of one uplink of `params` in a wire dtype or a delta codec."""
    up = M.Uplink("bench", "r", "dev0000", "type0", 1, params + 1e-3, 100, record)
    if codec in ("fp32", "fp16"):
        return len(M.encode(up, wire_dtype=codec))
    return len(M.encode(up, uplink_codec=codec, base=params))


def print_update_sizes(params: torch.Tensor, record: dict[str, float]) -> None:
    """Bytes of one uplink in each wire dtype and each delta codec."""
    for dt in ("fp32", "fp16"):
        up = M.Uplink(
            "f", "r", "dev", "t", 1, params, 100, {**record, "local_steps": 10.0}, 0.95, 1.0
        )
        print(f"bytes per update {dt}: {len(M.encode(up, wire_dtype=dt))}")
    fp32_bytes = packed_up_bytes(params, "fp32", record)
    for codec in ("fp16-delta", "int8-delta"):
        nbytes = packed_up_bytes(params, codec, record)
        print(f"bytes per update {codec}: {nbytes} = {nbytes / fp32_bytes:.3f}x fp32")
