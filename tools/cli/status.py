"""`wakefl status`: the fleet as the aggregation server recorded it: devices, their type,
online or not, last round, the gate's last decision, and refused messages with reasons."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from wakefl.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status",
        help="devices, rounds and refusals, read from a server's --state folder",
        description="Read the aggregation server's state folder (also while it runs) and "
        "print the fleet: each device's type, whether it is online, how long ago it was last "
        "heard from, the last round that "
        "sampled it and that it reported in, its relative FA/FR, the served-model gate's "
        "last decision, and the refused messages with their reasons.",
    )
    p.add_argument("--state", type=Path, required=True, help="the server's --state folder")
    p.add_argument("--recent", type=int, default=10, help="refusals listed one by one (default 10)")
    p.add_argument(
        "--online-within",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a device is online when its last Hello said so and the server heard from it "
        "this recently (default 600)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    from wakefl.tools.fleet.status import ONLINE_WITHIN_S, format_status, read_status

    within = ONLINE_WITHIN_S if args.online_within is None else args.online_within
    if not within > 0:
        raise ConfigError(f"--online-within must be > 0 s, got {args.online_within}")
    st = read_status(args.state, recent=max(0, args.recent), online_within_s=within)
    print(json.dumps(st) if args.json else format_status(st))
    return 0
