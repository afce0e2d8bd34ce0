"""MQTT topic layout of a wakefl fleet. Device ids and fleet names never contain '/', '+'
or '#', so a broker ACL with `%c`/`%u` patterns can pin each device to its own topics.

    wakefl/<fleet>/down          server -> all devices, retained (current round or the end)
    wakefl/<fleet>/up/<D>        device D -> server (its update)
    wakefl/<fleet>/ack/<D>       server -> device D (update recorded or refused)
    wakefl/<fleet>/hello/<D>     device D -> server (online / offline as its MQTT will)

Sharded aggregation (server/aggregation_worker.py) adds, for the server's processes only
(the ACL grants devices none of them):

    $share/<group>/wakefl/<fleet>/up/+   the workers' shared subscription to the uplinks
    wakefl/<fleet>/agg/worker/<W>        worker W -> coordinator, retained: online (cleared
                                         by its will when it dies)
    wakefl/<fleet>/agg/task/<W>          coordinator -> worker W: a pass over some updates
    wakefl/<fleet>/agg/result            workers -> coordinator: partial sums
"""

from __future__ import annotations

from wakefl.errors import ProtocolError

ROOT = "wakefl"
DEFAULT_FLEET = "default"
DEFAULT_SHARE_GROUP = "wakefl-agg"  # the aggregation workers' shared subscription


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


def shared_uplink_filter(fleet: str, group: str) -> str:
    """MQTT v5 shared subscription: the broker hands each uplink to one member of `group`."""
    return f"$share/{check_name(group, 'share group')}/{uplink_filter(fleet)}"


def agg_worker(fleet: str, worker: str) -> str:
    return f"{ROOT}/{check_name(fleet, 'fleet')}/agg/worker/{check_name(worker, 'worker id')}"


def agg_worker_filter(fleet: str) -> str:
    return f"{ROOT}/{check_name(fleet, 'fleet')}/agg/worker/+"


def agg_task(fleet: str, worker: str) -> str:
    return f"{ROOT}/{check_name(fleet, 'fleet')}/agg/task/{check_name(worker, 'worker id')}"


def agg_result(fleet: str) -> str:
    return f"{ROOT}/{check_name(fleet, 'fleet')}/agg/result"


def parse(topic: str) -> tuple[str, str, str | None]:
    """(fleet, kind, device id or None) of a wakefl topic; ProtocolError otherwise."""
    parts = topic.split("/")
    if len(parts) == 3 and parts[0] == ROOT and parts[2] == "down":
        return parts[1], "down", None
    if len(parts) == 4 and parts[0] == ROOT and parts[2] in ("up", "ack", "hello") and parts[3]:
        return parts[1], parts[2], parts[3]
    raise ProtocolError(f"not a wakefl topic: {topic!r}")
