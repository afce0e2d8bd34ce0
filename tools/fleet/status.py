"""What an operator asks of a running or finished fleet: which devices there are, of which
type, online or not, the round each last reported and what its served-model gate decided,
what the server refused and why, and where the run stands. Read from the server's state
folder through `server.state_store.StateStore` (SQLite in WAL mode, so a running server
keeps writing while this reads)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from wakefl.errors import ConfigError


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def gate_summary(record: dict[str, Any]) -> dict[str, Any]:
    """The served-model gate's last decision from an uplink record's `gate_*` scalars:
    kept or switched, and the served model's relative FA/FR against the baseline."""
    if "gate_switched" not in record:
        return {"decision": None, "served_relative_fa": None, "served_relative_fr": None}
    return {
        "decision": "switched" if record.get("gate_switched") else "kept",
        "served_relative_fa": _finite(record.get("gate_served_relative_fa")),
        "served_relative_fr": _finite(record.get("gate_served_relative_fr")),
    }


# A device counts as online when its last Hello said so and the server heard from it
# this recently: a device and a server that both exited leave "online" on record (the
# device's offline Hello found no server to read it), and only the time tells.
ONLINE_WITHIN_S = 600.0


def is_online(said_online: bool, last_seen: float | None, now: float, within_s: float) -> bool:
    """Online: the device's last Hello said online (no will or clean-exit Hello since) and
    the server heard from it at most `within_s` seconds before `now`."""
    return said_online and last_seen is not None and 0.0 <= now - last_seen <= within_s


def age_text(seconds: float | None) -> str:
    """`12 s`, `5 min`, `3 h`, `2 d` ago; `never` when never seen."""
    if seconds is None:
        return "never"
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def _rounds(store: Any) -> list[dict[str, Any]]:
    out, k = [], 1
    while (rec := store.round(k)) is not None:
        out.append(
            {
                "round": rec.round_id,
                "status": rec.status,
                "sampled": list(rec.sampled),
                "accepted": rec.accepted,
                "declined": store.declines(rec.round_id),
            }
        )
        k += 1
    return out


def read_status(
    state_dir: Path | str,
    recent: int = 10,
    online_within_s: float = ONLINE_WITHIN_S,
    now: float | None = None,
) -> dict[str, Any]:
    """The fleet's state as one JSON-ready object, online as `is_online` says at `now`."""
    import json

    from wakefl.server.state_store import StateStore

    now = time.time() if now is None else now

    state_dir = Path(state_dir)
    if not (state_dir / "server.sqlite").is_file():
        raise ConfigError(f"{state_dir} holds no server state (no server.sqlite): give --state")
    store = StateStore(state_dir)
    try:
        presence = store.presence()
        clients = store.clients()
        rounds = _rounds(store)
        devices = []
        for dev, dtype in sorted(store.devices().items()):
            c = clients.get(dev, {})
            record = json.loads(c["record"]) if c.get("record") else {}
            sampled_in = [r["round"] for r in rounds if dev in r["sampled"]]
            said_online, last_seen = presence.get(dev, (False, None))
            devices.append(
                {
                    "device": dev,
                    "type": dtype,
                    "online": is_online(said_online, last_seen, now, online_within_s),
                    "last_seen": last_seen,
                    "seen_s_ago": None if last_seen is None else max(0.0, now - last_seen),
                    "last_sampled": sampled_in[-1] if sampled_in else None,
                    "last_round": c.get("last_round"),
                    "rounds_reported": c.get("rounds_reported", 0),
                    "relative_fa": _finite(c.get("relative_fa")),
                    "relative_fr": _finite(c.get("relative_fr")),
                    "rejected": c.get("rejected", 0),
                    **gate_summary(record),
                }
            )
        return {
            "state": str(state_dir),
            "run_id": store.get_meta("run_id"),
            "online_within_s": online_within_s,
            "rounds": rounds,
            "devices": devices,
            "rejections": store.rejection_counts(),
            "recent_rejections": store.recent_rejections(recent),
        }
    finally:
        store.close()


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def format_status(st: dict[str, Any], now: float | None = None) -> str:
    """The status as text for a terminal."""
    now = time.time() if now is None else now
    rounds = st["rounds"]
    last = rounds[-1] if rounds else None
    lines = [f"run {st['run_id']} in {st['state']}"]
    if last is None:
        lines.append("no round opened yet")
    else:
        lines.append(
            f"round {last['round']} {last['status']}: sampled {', '.join(last['sampled']) or '-'}; "
            f"{last['accepted']} update(s)"
            + (f", declined by {', '.join(last['declined'])}" if last["declined"] else "")
        )
    head = (
        f"{'device':<20} {'type':<5} {'online':<6} {'last seen':>9} {'sampled':>7} {'reported':>8} "
        f"{'relFA':>6} {'relFR':>6} {'gate':<8} {'served relFA/FR':>15} {'refused':>7}"
    )
    lines += ["", head, "-" * len(head)]
    for d in st["devices"]:
        served = f"{_fmt(d['served_relative_fa'])}/{_fmt(d['served_relative_fr'])}"
        lines.append(
            f"{d['device'][:20]:<20} {d['type']:<5} {'yes' if d['online'] else 'no':<6} "
            f"{age_text(d['seen_s_ago']):>9} "
            f"{d['last_sampled'] or '-':>7} {d['last_round'] or '-':>8} "
            f"{_fmt(d['relative_fa']):>6} {_fmt(d['relative_fr']):>6} "
            f"{d['decision'] or '-':<8} {served:>15} {d['rejected']:>7}"
        )
    counts = st["rejections"]
    lines.append("")
    lines.append(
        "refused messages: "
        + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) if counts else "none")
    )
    for r in st["recent_rejections"]:
        ago = max(0.0, now - float(r["at"]))
        who = r["device_id"] or "?"
        rnd = f" round {r['round_id']}" if r["round_id"] is not None else ""
        lines.append(f"  {ago:7.0f} s ago  {r['reason']}: {who}{rnd} {r['detail'] or ''}".rstrip())
    lines.append(
        f"online: the device's last Hello said online (no will or clean-exit Hello since) "
        f"and the server heard from it within the last {age_text(st['online_within_s'])}; "
        "last seen: how long ago the server last heard from it"
    )
    lines.append(
        "sampled/reported: the last round that sampled the device / it reported in; "
        "relFA/relFR: its last personalized model against the baseline; gate: the "
        "served-model gate's last decision, and the served model against the baseline"
    )
    return "\n".join(lines)
