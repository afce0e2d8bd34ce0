"""`wakefl provision`: broker credentials, ACL, CA and device config for one device (or one
aggregation worker), in a provisioning folder (its layout: server/provisioning.py). The
commands it suggests read each password from its file (`--broker @FILE`), never from the
command line, where `ps` would show it."""

from __future__ import annotations

import argparse
from pathlib import Path

from wakefl.errors import ConfigError
from wakefl.protocol.topics import DEFAULT_FLEET
from wakefl.server.broker_config import DEFAULT_HOST, DEFAULT_TLS_PORT


def _handler(args: argparse.Namespace) -> int:
    from wakefl.server.provisioning import provision, provision_worker

    if args.worker:
        w = provision_worker(
            args.state, args.worker, fleet=args.fleet, host=args.host, port=args.port
        )
        path = Path(args.state).resolve() / "workers" / f"{args.worker}.json"
        print(
            f"provisioned aggregation worker {args.worker} ({w['username']}) in fleet "
            f"'{w['fleet']}'\n  worker config: {path} (keep secret; reload the broker)\n"
            f"  worker:        wakefl server --role worker --worker-id {args.worker} "
            f"--broker @{path} ..."
        )
        return 0
    if not args.id or not args.type:
        raise ConfigError("provision needs --id and --type (a device) or --worker ID")
    cfg = provision(
        args.state, args.id, args.type, fleet=args.fleet, host=args.host, port=args.port
    )
    state = Path(args.state).resolve()
    device_file = state / "devices" / f"{cfg['device_id']}.json"
    print(
        f"provisioned {cfg['device_id']} ({cfg['device_type']}) in fleet '{cfg['fleet']}'\n"
        f"  device config: {device_file} (keep secret)\n"
        f"  broker:        mosquitto -c {state / 'mosquitto.conf'}  (reload after new devices)\n"
        f"  server:        wakefl server --broker @{state / 'server.json'} "
        f"--devices {state / 'fleet.json'} ...\n"
        f"  device:        wakefl device --broker @{device_file} ..."
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "provision",
        help="provision broker credentials for a device",
        description=__doc__,
    )
    p.add_argument("--id", default=None, help="device id (also its broker username)")
    p.add_argument("--type", default=None, help="device type (cluster key)")
    p.add_argument(
        "--worker",
        default=None,
        metavar="ID",
        help="instead of a device: an account for aggregation worker ID of a sharded server",
    )
    p.add_argument("--state", required=True, help="provisioning directory")
    p.add_argument("--fleet", default=DEFAULT_FLEET)
    p.add_argument("--host", default=DEFAULT_HOST, help="broker host name or IP (certificate SAN)")
    p.add_argument("--port", type=int, default=DEFAULT_TLS_PORT, help="broker TLS port")
    p.set_defaults(func=_handler)
