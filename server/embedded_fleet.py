"""The embedded broker provisioned as the production one is (docs/PROTOCOL.md, "What the
brokers guarantee"): `wakefl server --broker embedded` and the demo run mosquitto on
127.0.0.1 with TLS, a password per device and the ACL, made by server/provisioning.py in a
folder of the state folder, so no local process can publish as another device or forge
the server's downlink. The server's credentials and each device's (`devices/<id>.json`,
mode 0600) are handed to the processes by file (`--broker @FILE`), never on a command line.

Accounts are made once: a device already provisioned keeps its password across restarts
(its config stays valid), and the broker keeps the port it was first given. An anonymous
embedded broker is an explicit choice (`--broker embedded-anonymous`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from wakefl.errors import ConfigError
from wakefl.server.broker import ManagedBroker, free_port, reachable_by, run_as_user
from wakefl.server.broker_config import DEFAULT_HOST, render_broker_conf
from wakefl.server.provisioning import provision

EMBEDDED = "embedded"
EMBEDDED_ANONYMOUS = "embedded-anonymous"


@dataclass(frozen=True)
class EmbeddedFleet:
    """A provisioned embedded broker (not started) and where its credentials are."""

    folder: Path
    broker: ManagedBroker
    server_file: Path  # server.json: the server's broker URL with its password
    device_files: dict[str, Path]  # device id -> devices/<id>.json

    @property
    def server_url(self) -> str:
        return str(json.loads(self.server_file.read_text())["broker"])


def _recorded(folder: Path, fleet: str) -> tuple[dict[str, str], int | None]:
    """The devices already provisioned in `folder` and the broker's port (None: none yet)."""
    fleet_file = folder / "fleet.json"
    if not fleet_file.is_file():
        return {}, None
    registry = json.loads(fleet_file.read_text())
    if registry.get("fleet") != fleet:
        raise ConfigError(
            f"{folder} provisions fleet {registry.get('fleet')!r}, not {fleet!r}: give this "
            "fleet its own --state folder"
        )
    devices = {
        dev: typ
        for dev, typ in registry.get("devices", {}).items()
        if (folder / "devices" / f"{dev}.json").is_file()
    }
    return devices, int(registry["port"])


def _broker_conf(folder: Path, port: int) -> Path:
    """The production config rendered afresh (never read back from the folder, where an
    anonymous run of the same state folder may have written its own mosquitto.conf), run
    as root when the `mosquitto` user could not reach the folder (a state folder under a
    private home or pytest's 0700 tmp): it only listens on 127.0.0.1."""
    pw = run_as_user()
    user = "user root\n" if pw is not None and not reachable_by(folder, pw) else ""
    conf = folder / "embedded.conf"
    conf.write_text(
        "# written by wakefl.server.embedded_fleet from server/config/mosquitto.conf\n"
        + user
        + render_broker_conf(folder, DEFAULT_HOST, port, folder / "broker-data")
    )
    return conf


def provision_embedded(
    folder: Path, devices: dict[str, str], fleet: str, port: int | None = None
) -> EmbeddedFleet:
    """Accounts for the server and each of `devices` (id -> type) in `folder`, made as
    `wakefl provision` makes them, and the broker that enforces them."""
    if not devices:
        raise ConfigError(
            "the embedded broker gives each device its own account: list the devices with "
            f"--devices ID:TYPE,... (or a fleet file), or choose --broker {EMBEDDED_ANONYMOUS}"
        )
    folder = Path(folder).resolve()
    known, recorded_port = _recorded(folder, fleet)
    if recorded_port is not None and port is not None and port != recorded_port:
        raise ConfigError(
            f"the embedded broker of {folder} listens on port {recorded_port} (its devices' "
            f"configs say so), not {port}: leave out --embedded-port"
        )
    port = recorded_port or port or free_port()
    for dev, typ in sorted(devices.items()):
        if known.get(dev) != typ:
            provision(folder, dev, typ, fleet=fleet, host=DEFAULT_HOST, port=port)
    broker = ManagedBroker(folder, port=port, conf_file=_broker_conf(folder, port))
    return EmbeddedFleet(
        folder=folder,
        broker=broker,
        server_file=folder / "server.json",
        device_files={dev: folder / "devices" / f"{dev}.json" for dev in sorted(devices)},
    )
