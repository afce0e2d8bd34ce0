"""The production broker's configuration, rendered from the templates in server/config/:
the ACL (server/config/acl.template, one block per device, and acl_worker.template per
aggregation worker of a sharded server) and mosquitto.conf (TLS listener, password file,
ACL, persistence)."""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources
from pathlib import Path

SERVER_USER = "wakefl-server"
WORKER_PREFIX = "wakefl-agg-"  # + worker id: the broker accounts of aggregation workers
DEFAULT_HOST = "127.0.0.1"
DEFAULT_TLS_PORT = 8883


def config_text(name: str) -> str:
    """The text of server/config/`name`."""
    return resources.files("wakefl.server").joinpath("config", name).read_text()


def render_acl(fleet: str, devices: dict[str, str], workers: Iterable[str] = ()) -> str:
    """The broker ACL of `fleet`: the server's rules, then each device's and each
    aggregation worker's."""
    template = config_text("acl.template")
    head, _, device_block = template.partition("# --- device (repeated per device)\n")
    out = head.replace("@FLEET@", fleet)
    for dev in sorted(devices):
        out += f"\n# device {dev} ({devices[dev]})\n"
        out += device_block.replace("@FLEET@", fleet).replace("@DEVICE@", dev)
    worker_block = config_text("acl_worker.template")
    for w in sorted(workers):
        out += "\n" + worker_block.replace("@FLEET@", fleet).replace("@WORKER@", w)
    return out


def render_broker_conf(state: Path, host: str, port: int, persist: Path) -> str:
    return (
        config_text("mosquitto.conf")
        .replace("@PORT@", str(port))
        .replace("@HOST@", host)
        .replace("@DIR@", str(state))
        .replace("@PERSIST@", str(persist))
    )
