"""Provisioning a fleet's production broker: the provisioning folder holds everything the
broker needs and one config per device or aggregation worker:

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

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wakefl.errors import ConfigError
from wakefl.protocol.topics import DEFAULT_FLEET
from wakefl.server.broker_config import (
    DEFAULT_HOST,
    DEFAULT_TLS_PORT,
    SERVER_USER,
    WORKER_PREFIX,
    render_acl,
    render_broker_conf,
)
from wakefl.server.broker_pki import chown_for_broker, ensure_ca, run_tool, write_private


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
    run_tool(["mosquitto_passwd", "-b", "-c", str(passwd), SERVER_USER, pw])
    write_private(
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
    run_tool(["mosquitto_passwd", "-b", str(passwd), username, password])
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
    fleet: str = DEFAULT_FLEET,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_TLS_PORT,
) -> dict[str, Any]:
    """Create or update the provisioning directory for `device_id`; returns its config."""
    from wakefl.protocol.topics import check_name

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
    write_private(state / "devices" / f"{device_id}.json", config)
    chown_for_broker(state)
    return config


def provision_worker(
    state: str | Path,
    worker_id: str,
    *,
    fleet: str = DEFAULT_FLEET,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_TLS_PORT,
) -> dict[str, Any]:
    """A broker account for aggregation worker `worker_id` of a sharded server
    (server/config/acl_worker.template); returns its config (workers/<id>.json)."""
    from wakefl.protocol.topics import check_name

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
    write_private(state / "workers" / f"{worker_id}.json", config)
    chown_for_broker(state)
    return config
