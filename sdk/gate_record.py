"""The served model's gate record: a JSON file beside a device's exported served model
saying what it serves, the gate's last decision and the decision that switched to it.

`wakefl device --export` writes it; a report on what each device serves and why (the
demo's) reads it. It lives here, not in the command line module, so that both sides share
one definition of the file's place and shape.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wakefl.sdk.round_training import json_safe


def gate_record_path(export: str | Path) -> Path:
    """Where the served model's gate record is written: beside its export."""
    return Path(export).with_suffix(".gate.json")


def gate_record(summary: Any) -> dict[str, Any]:
    """The record of a run's `RunSummary`: `served` (the served model and its point
    figures against the baseline), `gate` (the last decision) and `switched_by` (the
    decision that switched to the served model; None while the baseline is served)."""
    switched = [o.gate for o in summary.outcomes if o.gate and o.gate.get("switched")]
    return {
        "served": summary.served,
        "gate": summary.gate,
        "switched_by": switched[-1] if switched else None,
    }


def write_gate_record(export: str | Path, summary: Any) -> Path:
    """Write `gate_record(summary)` beside `export`; returns its path."""
    path = gate_record_path(export)
    path.write_text(json.dumps(json_safe(gate_record(summary)), indent=1) + "\n")
    return path


def read_gate_record(export: str | Path) -> dict[str, Any] | None:
    """The gate record beside `export` (None when there is none)."""
    path = gate_record_path(export)
    if not path.is_file():
        return None
    return json.loads(path.read_text())


__all__ = ["gate_record", "gate_record_path", "read_gate_record", "write_gate_record"]
