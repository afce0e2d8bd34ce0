"""`wakefl provision`: broker credentials, ACL, CA and device config for one device.

The provisioning directory (`--state`) holds everything the production broker needs and
one config per device:

    ca.key ca.crt server.key server.crt   a private CA (openssl) and the broker's certificate
    passwd                                mosquitto password file (mosquitto_passwd)
    acl                                   rendered from server/config/acl.template
    mosquitto.conf                        rendered from server/config/mosquitto.conf
    fleet.json                            {"fleet", "devices": {id: type}} for `wakefl server --devices`
    server.json, devices/<id>.json        broker URL with credentials (mode 0600)
    workers/<id>.json                     the same for a sharded server's aggregation
                                          workers (`--worker ID`; docs/SCALE.md)
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from wakefl.errors import ConfigError
from wakefl.sdk.atomic_files import write_atomic

SERVER_USER = "wakefl-server"
WORKER_PREFIX = "wakefl-agg-"  # + worker id: the broker accounts of aggregation workers


def _run(cmd: list[str]) -> None:
    if shutil.which(cmd[0]) is None:
        raise ConfigError(f"{cmd[0]} is not installed (Debian: mosquitto / openssl)")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ConfigError(f"{' '.join(cmd[:3])} failed: {proc.stderr.strip()[-500:]}")


def _config_text(name: str) -> str:
    return resources.files("wakefl.server").joinpath("config", name).read_text()


def _write_private(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, (json.dumps(data, indent=2) + "\n").encode(), mode=0o600)


def ensure_ca(state: Path, host: str) -> None:
    """A private CA and a server certificate for `host` (IP or DNS name), made once."""
    if (state / "server.crt").is_file():
        return
    _run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "3650",
            "-subj",
            "/CN=wakefl-ca",
            "-keyout",
            str(state / "ca.key"),
            "-out",
            str(state / "ca.crt"),
        ]
    )
    _run(
        [
            "openssl",
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={host}",
            "-keyout",
            str(state / "server.key"),
            "-out",
            str(state / "server.csr"),
        ]
    )
    kind = "IP" if host.replace(".", "").isdigit() or ":" in host else "DNS"
    (state / "server.ext").write_text(f"subjectAltName={kind}:{host}\n")
    _run(
        [
            "openssl",
            "x509",
            "-req",
            "-in",
            str(state / "server.csr"),
            "-CA",
            str(state / "ca.crt"),
            "-CAkey",
            str(state / "ca.key"),
            "-CAcreateserial",
            "-days",
            "3650",
            "-extfile",
            str(state / "server.ext"),
            "-out",
            str(state / "server.crt"),
        ]
    )
    os.chmod(state / "ca.key", 0o600)


def render_acl(fleet: str, devices: dict[str, str], workers: Iterable[str] = ()) -> str:
    template = _config_text("acl.template")
    head, _, device_block = template.partition("# --- device (repeated per device)\n")
    out = head.replace("@FLEET@", fleet)
    for dev in sorted(devices):
        out += f"\n# device {dev} ({devices[dev]})\n"
        out += device_block.replace("@FLEET@", fleet).replace("@DEVICE@", dev)
    worker_block = _config_text("acl_worker.template")
    for w in sorted(workers):
        out += "\n" + worker_block.replace("@FLEET@", fleet).replace("@WORKER@", w)
    return out


def render_broker_conf(state: Path, host: str, port: int, persist: Path) -> str:
    return (
        _config_text("mosquitto.conf")
        .replace("@PORT@", str(port))
        .replace("@HOST@", host)
        .replace("@DIR@", str(state))
        .replace("@PERSIST@", str(persist))
    )


def _chown_for_broker(state: Path) -> None:
    """mosquitto started as root switches to the `mosquitto` user before reading these."""
    if os.geteuid() != 0:
        return
    import pwd

    try:
        pw = pwd.getpwnam("mosquitto")
    except KeyError:
        return
    for p in [
        state,
        state / "broker-data",
        *[
            state / n
            for n in ("ca.crt", "server.crt", "server.key", "passwd", "acl", "mosquitto.conf")
        ],
    ]:
        if p.exists():
            os.chown(p, pw.pw_uid, pw.pw_gid)


def _read_registry(state: Path, fleet: str, host: str, port: int) -> dict[str, Any]:
    """The folder's fleet.json (a new, empty one for `fleet` if none); refuses another fleet."""
    fleet_file = state / "fleet.json"
    registry = (
        json.loads(fleet_file.read_text())
        if fleet_file.is_file()
        else {"fleet": fleet, "host": host, "port": port, "devices": {}}
    )
    if registry["fleet"] != fleet:
        raise ConfigError(f"{state} provisions fleet {registry['fleet']!r}, not {fleet!r}")
    return registry


def _ensure_server_credentials(state: Path, passwd: Path, host: str, port: int) -> None:
    """The server's broker account and server.json, created once (a new passwd file)."""
    if (state / "server.json").is_file():
        return
    pw = secrets.token_urlsafe(24)
    _run(["mosquitto_passwd", "-b", "-c", str(passwd), SERVER_USER, pw])
    _write_private(
        state / "server.json",
        {
            "username": SERVER_USER,
            "password": pw,
            "ca_file": str(state / "ca.crt"),
            "broker": f"mqtts://{SERVER_USER}:{pw}@{host}:{port}?ca={state / 'ca.crt'}",
        },
    )


def _provision_account(
    state: Path,
    username: str,
    enter: Callable[[dict[str, Any]], None],
    *,
    fleet: str,
    host: str,
    port: int,
) -> tuple[str, str, int]:
    """Give `username` a new broker password, record it in fleet.json with `enter`, and
    render the ACL and the broker config again. Returns (password, host, port)."""
    state.mkdir(parents=True, exist_ok=True)
    (state / "broker-data").mkdir(exist_ok=True)
    registry = _read_registry(state, fleet, host, port)
    host, port = registry["host"], int(registry["port"])
    ensure_ca(state, host)
    passwd = state / "passwd"
    _ensure_server_credentials(state, passwd, host, port)
    password = secrets.token_urlsafe(24)
    _run(["mosquitto_passwd", "-b", str(passwd), username, password])
    # mosquitto_passwd leaves the file world-readable (0644): salted hashes, but still
    # material for an offline guessing attack on every device's password.
    os.chmod(passwd, 0o600)
    enter(registry)
    (state / "fleet.json").write_text(json.dumps(registry, indent=2) + "\n")
    (state / "acl").write_text(render_acl(fleet, registry["devices"], registry.get("workers", [])))
    (state / "mosquitto.conf").write_text(
        render_broker_conf(state, host, port, state / "broker-data")
    )
    return password, host, port


def provision(
    state: str | Path,
    device_id: str,
    device_type: str,
    *,
    fleet: str = "default",
    host: str = "127.0.0.1",
    port: int = 8883,
) -> dict[str, Any]:
    """Create or update the provisioning directory for `device_id`; returns its config."""
    from wakefl.sdk.topics import check_name

    check_name(device_id, "device id")
    check_name(device_type, "device type")
    check_name(fleet, "fleet")
    if device_id == SERVER_USER or device_id.startswith(WORKER_PREFIX):
        raise ConfigError(f"{device_id!r}: {SERVER_USER!r} and {WORKER_PREFIX}* are the server's")
    state = Path(state).resolve()
    password, host, port = _provision_account(
        state,
        device_id,
        lambda reg: reg["devices"].__setitem__(device_id, device_type),
        fleet=fleet,
        host=host,
        port=port,
    )
    config = {
        "device_id": device_id,
        "device_type": device_type,
        "fleet": fleet,
        "username": device_id,
        "password": password,
        "ca_file": str(state / "ca.crt"),
        "broker": f"mqtts://{device_id}:{password}@{host}:{port}?ca={state / 'ca.crt'}",
    }
    _write_private(state / "devices" / f"{device_id}.json", config)
    _chown_for_broker(state)
    return config


def provision_worker(
    state: str | Path,
    worker_id: str,
    *,
    fleet: str = "default",
    host: str = "127.0.0.1",
    port: int = 8883,
) -> dict[str, Any]:
    """A broker account for aggregation worker `worker_id` of a sharded server
    (server/config/acl_worker.template); returns its config (workers/<id>.json)."""
    from wakefl.sdk.topics import check_name

    check_name(worker_id, "worker id")
    check_name(fleet, "fleet")
    user = WORKER_PREFIX + worker_id

    def enter(reg: dict[str, Any]) -> None:
        reg["workers"] = sorted({*reg.get("workers", []), worker_id})

    state = Path(state).resolve()
    password, host, port = _provision_account(state, user, enter, fleet=fleet, host=host, port=port)
    config = {
        "worker_id": worker_id,
        "fleet": fleet,
        "username": user,
        "password": password,
        "ca_file": str(state / "ca.crt"),
        "broker": f"mqtts://{user}:{password}@{host}:{port}?ca={state / 'ca.crt'}",
    }
    _write_private(state / "workers" / f"{worker_id}.json", config)
    _chown_for_broker(state)
    return config


def _handler(args: argparse.Namespace) -> int:
    if args.worker:
        w = provision_worker(
            args.state, args.worker, fleet=args.fleet, host=args.host, port=args.port
        )
        path = Path(args.state).resolve() / "workers" / f"{args.worker}.json"
        print(
            f"provisioned aggregation worker {args.worker} ({w['username']}) in fleet "
            f"'{w['fleet']}'\n  worker config: {path} (keep secret; reload the broker)\n"
            f"  worker:        wakefl server --role worker --worker-id {args.worker} --broker "
            f'"$(jq -r .broker {path})" ...'
        )
        return 0
    if not args.id or not args.type:
        raise ConfigError("provision needs --id and --type (a device) or --worker ID")
    cfg = provision(
        args.state, args.id, args.type, fleet=args.fleet, host=args.host, port=args.port
    )
    state = Path(args.state).resolve()
    print(
        f"provisioned {cfg['device_id']} ({cfg['device_type']}) in fleet '{cfg['fleet']}'\n"
        f"  device config: {state / 'devices' / (cfg['device_id'] + '.json')} (keep secret)\n"
        f"  broker:        mosquitto -c {state / 'mosquitto.conf'}  (reload after new devices)\n"
        f'  server:        wakefl server --broker "$(jq -r .broker {state / "server.json"})" '
        f"--devices {state / 'fleet.json'} ..."
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "provision",
        help="provision broker credentials for a device",
        description=__doc__.split("\n")[0],
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
    p.add_argument("--fleet", default="default")
    p.add_argument("--host", default="127.0.0.1", help="broker host name or IP (certificate SAN)")
    p.add_argument("--port", type=int, default=8883, help="broker TLS port")
    p.set_defaults(func=_handler)
