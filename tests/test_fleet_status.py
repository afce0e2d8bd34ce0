"""`wakefl status` reads a server's state folder: devices, types, online or not, the last
round that sampled each and that each reported in, the gate's last decision, and refused
messages with their reasons. The state is written through the server's own store."""

from __future__ import annotations

import json

import torch

from wakefl.protocol.messages import Uplink
from wakefl.server.state_store import StateStore
from wakefl.tools.cli import main
from wakefl.tools.fleet.status import format_status, gate_summary, read_status


def _fleet(root):
    store = StateStore(root)
    for dev, typ in (("kitchen-1", "A"), ("hall-2", "B"), ("attic-3", "A")):
        store.register_device(dev, typ, "fleet.json")
    store.set_online("kitchen-1", True)
    store.set_online("hall-2", True)
    store.open_round(1, ["kitchen-1", "hall-2"], deadline=1e12)
    record = {"sigma_sq": 0.1, "gate_switched": 1.0, "gate_served_relative_fa": 0.5}
    up = Uplink("f", "run", "kitchen-1", "A", 1, torch.zeros(4), 8, record, 0.4, 1.0)
    assert store.record_update(up, b"frame")
    store.record_decline(1, "hall-2", "no training clips")
    store.count_rejection("wrong_device_type", "attic-3", 1, "claims type B, registered A")
    store.count_rejection("unknown_device", "ghost", 1, "not in the fleet")
    store.flush_rejections()
    store.close()


def test_status_lists_devices_rounds_and_refusals(tmp_path, capsys):
    _fleet(tmp_path / "state")
    st = read_status(tmp_path / "state")
    devices = {d["device"]: dict(d) for d in st["devices"]}
    seen = devices["kitchen-1"].pop("last_seen"), devices["kitchen-1"].pop("seen_s_ago")
    assert seen[0] is not None and 0.0 <= seen[1] < 60.0
    assert devices["kitchen-1"] == {
        "device": "kitchen-1",
        "type": "A",
        "online": True,
        "last_sampled": 1,
        "last_round": 1,
        "rounds_reported": 1,
        "relative_fa": 0.4,
        "relative_fr": 1.0,
        "rejected": 0,
        "decision": "switched",
        "served_relative_fa": 0.5,
        "served_relative_fr": None,
    }
    assert devices["hall-2"]["last_sampled"] == 1 and devices["hall-2"]["last_round"] is None
    assert not devices["attic-3"]["online"] and devices["attic-3"]["last_sampled"] is None
    assert st["rounds"] == [
        {
            "round": 1,
            "status": "open",
            "sampled": ["kitchen-1", "hall-2"],
            "accepted": 1,
            "declined": {"hall-2": "no training clips"},
        }
    ]
    assert st["rejections"] == {"wrong_device_type": 1, "unknown_device": 1}
    assert {r["reason"] for r in st["recent_rejections"]} == {"wrong_device_type", "unknown_device"}
    text = format_status(st)
    assert "declined by hall-2" in text and "wrong_device_type: attic-3 round 1" in text
    assert main(["status", "--state", str(tmp_path / "state"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["devices"]
    assert [d["device"] for d in listed] == [d["device"] for d in st["devices"]]
    assert [d["online"] for d in listed] == [d["online"] for d in st["devices"]]


def test_status_of_a_folder_without_state_is_one_line(tmp_path, capsys):
    assert main(["status", "--state", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no server state" in err and not (tmp_path / "server.sqlite").exists()


def test_gate_summary_of_records():
    assert gate_summary({})["decision"] is None
    assert gate_summary({"gate_switched": 0.0})["decision"] == "kept"
    got = gate_summary({"gate_switched": 1.0, "gate_served_relative_fr": float("nan")})
    assert got == {"decision": "switched", "served_relative_fa": None, "served_relative_fr": None}
