"""Broker configurations for a bridged topology: edge mosquittos that devices connect to,
each bridged to one core mosquitto that the server connects to (docs/SCALE.md, "Bridged
edge brokers").

    python -m wakefl.tools.fleet.provision_bridge --state DIR --fleet F --core-port 8883 \\
        --edge eu1:8884:dev-a=speaker,dev-b=tv --edge us1:8885:dev-c=speaker

writes, with the same CA, password and ACL machinery as `wakefl provision`:

    DIR/core/       ca.crt server.crt server.key passwd acl mosquitto.conf server.json
                    passwd and acl: the server user (its usual block) and one bridge user
                    per edge (write up/# and hello/#, read down and ack/# of the fleet)
    DIR/edges/E/    ca.crt server.crt server.key passwd acl mosquitto.conf
                    devices/<id>.json fleet.json; passwd and acl: E's devices only (the
                    usual per-device block), mosquitto.conf ends with the bridge to the core

Each broker has its own CA and certificate (its own host name); an edge verifies the core
against the core's CA. Devices, the server and bridges all use TLS and passwords.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wakefl.errors import ConfigError
from wakefl.protocol.topics import DEFAULT_FLEET, check_name
from wakefl.server.broker_config import SERVER_USER, config_text, render_broker_conf
from wakefl.server.broker_pki import chown_for_broker, ensure_ca, run_tool, write_private

_DEVICE_MARK = "# --- device (repeated per device)\n"

# What an edge may do on the core for its fleet: forward the devices' uplinks and hellos
# (their wills included), and follow the downlink and the per-device acks. The edge's own
# ACL is what pins each device to its own topics; the core trusts the edge for that.
BRIDGE_ACL = """
# bridge from edge @EDGE@
user @BRIDGE@
topic write wakefl/@FLEET@/up/#
topic write wakefl/@FLEET@/hello/#
topic read wakefl/@FLEET@/down
topic read wakefl/@FLEET@/ack/#
"""


@dataclass
class Edge:
    """One edge broker: its name, where it listens and the devices that connect to it."""

    name: str
    port: int
    devices: dict[str, str] = field(default_factory=dict)  # device id -> device type
    host: str = "127.0.0.1"

    @property
    def bridge_user(self) -> str:
        return f"bridge-{self.name}"


def core_acl(fleet: str, edges: list[Edge]) -> str:
    """The core's ACL: the server's block of acl.template, then one block per bridge."""
    head, _, _ = config_text("acl.template").partition(_DEVICE_MARK)
    out = head.replace("@FLEET@", fleet)
    for edge in edges:
        out += (
            BRIDGE_ACL.replace("@EDGE@", edge.name)
            .replace("@BRIDGE@", edge.bridge_user)
            .replace("@FLEET@", fleet)
        )
    return out


def edge_acl(fleet: str, devices: dict[str, str]) -> str:
    """An edge's ACL: the per-device block of acl.template for each of its devices, and no
    server block (the server never connects to an edge)."""
    _, _, block = config_text("acl.template").partition(_DEVICE_MARK)
    out = "# wakefl edge broker ACL (tools/fleet/provision_bridge.py): devices only\n"
    for dev in sorted(devices):
        out += f"\n# device {dev} ({devices[dev]})\n"
        out += block.replace("@FLEET@", fleet).replace("@DEVICE@", dev)
    return out


def bridge_section(
    edge: Edge, fleet: str, core: tuple[str, int], core_ca: Path, password: str
) -> str:
    """The `connection` block appended to an edge's mosquitto.conf."""
    host, port = core
    base = f"wakefl/{fleet}"
    return (
        "\n# Bridge to the core (tools/fleet/provision_bridge.py). Uplinks and hellos go out,\n"
        "# the retained downlink and the acks come in; the downlink crosses the bridge once\n"
        "# and fans out here. cleansession false: what either side queued while the link\n"
        "# was down is delivered when it comes back.\n"
        f"connection {edge.bridge_user}\n"
        f"address {host}:{port}\n"
        "bridge_protocol_version mqttv50\n"
        f"bridge_cafile {core_ca}\n"
        f"remote_username {edge.bridge_user}\n"
        f"remote_password {password}\n"
        f"remote_clientid {edge.bridge_user}\n"
        "cleansession false\n"
        "restart_timeout 1 10\n"
        f"topic {base}/up/# out 1\n"
        f"topic {base}/hello/# out 1\n"
        f"topic {base}/down in 1\n"
        f"topic {base}/ack/# in 1\n"
    )


def _new_user(passwd: Path, user: str, create: bool = False) -> str:
    """Add `user` with a fresh random password to `passwd`; returns the password."""
    password = secrets.token_urlsafe(24)
    run_tool(["mosquitto_passwd", "-b", *(["-c"] if create else []), str(passwd), user, password])
    # mosquitto_passwd leaves the file world-readable; server/provisioning.py says why not.
    os.chmod(passwd, 0o600)
    return password


def _url(user: str, password: str, host: str, port: int, ca: Path) -> str:
    return f"mqtts://{user}:{password}@{host}:{port}?ca={ca}"


def _broker_dir(path: Path, host: str) -> Path:
    """A broker's folder with its CA, certificate and (empty) persistence folder."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "broker-data").mkdir(exist_ok=True)
    ensure_ca(path, host)
    return path


def _write_core(state: Path, fleet: str, core: tuple[str, int], edges: list[Edge]) -> dict:
    """The core broker's folder; returns {edge name: bridge password} and the server URL."""
    host, port = core
    core_dir = _broker_dir(state / "core", host)
    passwd = core_dir / "passwd"
    server_pw = _new_user(passwd, SERVER_USER, create=True)
    bridges = {e.name: _new_user(passwd, e.bridge_user) for e in edges}
    (core_dir / "acl").write_text(core_acl(fleet, edges))
    conf = render_broker_conf(core_dir, host, port, core_dir / "broker-data")
    (core_dir / "mosquitto.conf").write_text(conf)
    server_url = _url(SERVER_USER, server_pw, host, port, core_dir / "ca.crt")
    write_private(core_dir / "server.json", {"username": SERVER_USER, "broker": server_url})
    chown_for_broker(core_dir)
    return {"dir": core_dir, "port": port, "server_url": server_url, "bridges": bridges}


def _write_edge(state: Path, fleet: str, edge: Edge, core: dict, core_host: str) -> dict:
    """One edge broker's folder; returns its folder, port and each device's URL."""
    edge_dir = _broker_dir(state / "edges" / edge.name, edge.host)
    (edge_dir / "devices").mkdir(exist_ok=True)
    passwd = edge_dir / "passwd"
    passwd.unlink(missing_ok=True)
    urls = {}
    for i, (dev, typ) in enumerate(sorted(edge.devices.items())):
        password = _new_user(passwd, dev, create=i == 0)
        urls[dev] = _url(dev, password, edge.host, edge.port, edge_dir / "ca.crt")
        write_private(
            edge_dir / "devices" / f"{dev}.json",
            {"device_id": dev, "device_type": typ, "fleet": fleet, "broker": urls[dev]},
        )
    (edge_dir / "acl").write_text(edge_acl(fleet, edge.devices))
    registry = {"fleet": fleet, "devices": dict(sorted(edge.devices.items()))}
    (edge_dir / "fleet.json").write_text(json.dumps(registry, indent=2) + "\n")
    conf = render_broker_conf(edge_dir, edge.host, edge.port, edge_dir / "broker-data")
    bridge = bridge_section(
        edge, fleet, (core_host, core["port"]), core["dir"] / "ca.crt", core["bridges"][edge.name]
    )
    # The bridge password is in this file: readable by the broker only.
    (edge_dir / "mosquitto.conf").write_text(conf + bridge)
    os.chmod(edge_dir / "mosquitto.conf", 0o600)
    chown_for_broker(edge_dir)
    return {"dir": edge_dir, "port": edge.port, "device_urls": urls}


def provision_bridged(
    state: str | Path,
    fleet: str,
    core_port: int,
    edges: list[Edge],
    *,
    core_host: str = "127.0.0.1",
) -> dict[str, Any]:
    """Write the core's and every edge's folder under `state` (replacing their password
    files and ACLs). Returns {"core": {dir, port, server_url, bridges}, "edges": {name:
    {dir, port, device_urls}}}; each broker runs with `mosquitto -c <dir>/mosquitto.conf`."""
    check_name(fleet, "fleet")
    seen: set[str] = set()
    for edge in edges:
        check_name(edge.name, "edge name")
        for dev, typ in edge.devices.items():
            check_name(dev, "device id")
            check_name(typ, "device type")
            if dev in seen or dev == SERVER_USER or dev.startswith("bridge-"):
                raise ConfigError(f"device id {dev!r} is reserved or on two edges")
            seen.add(dev)
    state = Path(state).resolve()
    core = _write_core(state, fleet, (core_host, core_port), edges)
    return {
        "core": core,
        "edges": {e.name: _write_edge(state, fleet, e, core, core_host) for e in edges},
    }


def _parse_edge(text: str) -> Edge:
    """NAME:PORT:dev=type,dev=type (NAME:PORT alone: an edge with no devices yet)."""
    try:
        name, port, *rest = text.split(":")
        devices = dict(pair.split("=", 1) for pair in rest[0].split(",") if pair) if rest else {}
        return Edge(name, int(port), devices)
    except ValueError as exc:
        raise ConfigError(f"--edge {text!r}: expected NAME:PORT:dev=type,...") from exc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--state", required=True, type=Path, help="folder for every broker's files")
    p.add_argument("--fleet", default=DEFAULT_FLEET)
    p.add_argument("--core-host", default="127.0.0.1", help="core host (certificate SAN)")
    p.add_argument("--core-port", type=int, default=8883)
    p.add_argument("--edge", action="append", required=True, help="NAME:PORT:dev=type,...")
    args = p.parse_args(argv)
    edges = [_parse_edge(e) for e in args.edge]
    out = provision_bridged(args.state, args.fleet, args.core_port, edges, core_host=args.core_host)
    print(f"core:  mosquitto -c {out['core']['dir'] / 'mosquitto.conf'}")
    print(f"       server URL in {out['core']['dir'] / 'server.json'}")
    for name, edge in out["edges"].items():
        print(f"edge {name}: mosquitto -c {edge['dir'] / 'mosquitto.conf'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
