"""A strategy's records: the named scalars its instructions and results carry.

Each `Strategy` declares what its records may hold (`Strategy.downlink_schema` for the
per-client instructions, `Strategy.uplink_schema` for a client's result): name ->
`ScalarSpec` (integer or real, bounds, required or not). The wire format carries records as
they are (docs/PROTOCOL.md, protocol v3) and checks them against the schema of the
strategy that runs, so the transport, the device's state and the server's store never name
one algorithm's variables. Pure, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from wakefl.protocol.reasoned_error import ReasonedError

# Bounds every schema stays within: far above any real value, small enough that sums and
# squares of them stay far from overflow and every integer fits a SQLite INTEGER.
MAX_RECORD_ABS = 1e30
MAX_STEPS = 10**7  # local step counts


class RecordError(ReasonedError, ValueError):
    """A record that does not fit its schema. `reason` is a wire rejection code:
    "malformed" (unknown or missing name, not a number), "non_finite" or "out_of_range"."""


@dataclass(frozen=True)
class ScalarSpec:
    """One named scalar: `integer` values must be whole numbers; every value is finite and
    within [low, high]; a `required` one must be present."""

    low: float
    high: float
    integer: bool = False
    required: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low <= self.high):
            raise ValueError(
                f"a scalar's bounds must be finite with low <= high, got [{self.low}, {self.high}]"
            )


RecordSchema = Mapping[str, ScalarSpec]


def _short(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_scalar(value: Any, spec: ScalarSpec, name: str) -> float:
    """`value` as a float if it fits `spec`; RecordError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RecordError("malformed", f"{name} must be a number, got {type(value).__name__}")
    if isinstance(value, int) and not spec.low <= value <= spec.high:
        # checked before float(): float(10**400) raises OverflowError
        raise RecordError(
            "out_of_range", f"{name} is {_short(value)}, outside [{spec.low:g}, {spec.high:g}]"
        )
    if not math.isfinite(value):
        raise RecordError("non_finite", f"{name} is {value}")
    if not spec.low <= value <= spec.high:
        raise RecordError(
            "out_of_range", f"{name} is {value:g}, outside [{spec.low:g}, {spec.high:g}]"
        )
    if spec.integer and value != int(value):
        raise RecordError("malformed", f"{name} must be a whole number, got {value:g}")
    return float(value)


def check_record(record: Mapping[str, Any], schema: RecordSchema, what: str) -> dict[str, float]:
    """The record as floats if every entry is declared in `schema` and fits it and every
    required entry is present; RecordError otherwise. `what` names the record in errors."""
    if not isinstance(record, Mapping):
        raise RecordError("malformed", f"{what} must be an object")
    unknown = [k for k in record if k not in schema]
    if unknown:
        raise RecordError(
            "malformed",
            f"{what} holds {_short(sorted(map(str, unknown)))}, "
            f"which the strategy does not declare",
        )
    missing = [k for k, spec in schema.items() if spec.required and k not in record]
    if missing:
        raise RecordError("malformed", f"{what} lacks {sorted(missing)}")
    return {k: check_scalar(v, schema[k], f"{what}.{k}") for k, v in record.items()}


def finite_part(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric entries of a mapping: what a record can carry on the wire (an
    infinite value, e.g. S_-m of a client alone in its fleet, is left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


__all__ = [
    "MAX_RECORD_ABS",
    "MAX_STEPS",
    "RecordError",
    "RecordSchema",
    "ScalarSpec",
    "check_record",
    "check_scalar",
    "finite_part",
]
