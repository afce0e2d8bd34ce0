"""MQTT topic layout of a wakefl fleet. Device ids and fleet names never contain '/', '+'
or '#', so a broker ACL with `%c`/`%u` patterns can pin each device to its own topics.

    wakefl/<fleet>/down          server -> all devices, retained (current round or the end)
    wakefl/<fleet>/up/<D>        device D -> server (its update)
    wakefl/<fleet>/ack/<D>       server -> device D (update recorded or refused)
    wakefl/<fleet>/hello/<D>     device D -> server (online / offline as its MQTT will)
"""

from __future__ import annotations

from wakefl.errors import ProtocolError

ROOT = "wakefl"
DEFAULT_FLEET = "default"


def check_name(value: str, what: str = "name") -> str:
    """Fleet names and device ids: 1-128 printable chars without MQTT wildcards or '/'."""
    if (
        not isinstance(value, str)
        or not value
        or len(value) > 128
        or not value.isprintable()
        or any(c in value for c in "/+#$ ")
    ):
        raise ProtocolError(
            f"{what} {value!r} is not a valid id (1-128 printable characters, "
            "no '/', '+', '#', '$' or spaces)"
        )
    return value


def downlink(fleet: str) -> str:
    return f"{ROOT}/{check_name(fleet, 'fleet')}/down"


def uplink(fleet: str, device_id: str) -> str:
    return f"{ROOT}/{check_name(fleet, 'fleet')}/up/{check_name(device_id, 'device id')}"


def ack(fleet: str, device_id: str) -> str:
    return f"{ROOT}/{check_name(fleet, 'fleet')}/ack/{check_name(device_id, 'device id')}"


def hello(fleet: str, device_id: str) -> str:
    return f"{ROOT}/{check_name(fleet, 'fleet')}/hello/{check_name(device_id, 'device id')}"


def uplink_filter(fleet: str) -> str:
    return f"{ROOT}/{check_name(fleet, 'fleet')}/up/+"


def hello_filter(fleet: str) -> str:
    return f"{ROOT}/{check_name(fleet, 'fleet')}/hello/+"


def parse(topic: str) -> tuple[str, str, str | None]:
    """(fleet, kind, device id or None) of a wakefl topic; ProtocolError otherwise."""
    parts = topic.split("/")
    if len(parts) == 3 and parts[0] == ROOT and parts[2] == "down":
        return parts[1], "down", None
    if len(parts) == 4 and parts[0] == ROOT and parts[2] in ("up", "ack", "hello") and parts[3]:
        return parts[1], parts[2], parts[3]
    raise ProtocolError(f"not a wakefl topic: {topic!r}")
