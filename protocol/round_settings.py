"""The settings a downlink carries for its round (protocol v5, docs/PROTOCOL.md): which
strategy the fleet runs and with which arguments, how long a device waits for an ack
before re-sending, the downlink's tensor dtype, what devices send, how many rounds.

Typed and checked where they are read off the wire: a field that is missing, of the
wrong type or out of range is refused (`SettingsError`, turned into a `MessageRejected`
by the decoder) with the field's name, never read later with a default of its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from wakefl.errors import ProtocolError
from wakefl.protocol.codec_names import CODECS, WIRE_DTYPE_NAMES
from wakefl.protocol.reasoned_error import ReasonedError

MAX_ACK_TIMEOUT_S = 86400.0  # a day: a longer wait is a typo, not a setting
MAX_ROUNDS = 2**31 - 1
MAX_NAME_LEN = 128
MAX_ARGS = 256
MAX_ARGS_BYTES = 64 * 1024  # the strategy's arguments as JSON


class SettingsError(ReasonedError, ProtocolError):
    """Round settings refused; `reason` is a reject code (`malformed`, `out_of_range`)."""


@dataclass(frozen=True)
class RoundSettings:
    """What a device needs of the server's configuration to take part in a round."""

    strategy: str = "selffl"
    strategy_args: dict[str, Any] = field(default_factory=dict)  # the strategy's constructor's
    ack_timeout_s: float = 30.0  # a device re-sends an unacknowledged update after this
    wire_dtype: str = "fp32"  # the downlink's tensors, and plain uplinks by default
    uplink_codec: str = "fp32"  # what devices send (protocol/update_codec.py)
    rounds: int = 0  # rounds of the run (0: not announced)

    def __post_init__(self) -> None:
        check_settings(self.to_wire())

    def to_wire(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "strategy_args": self.strategy_args,
            "ack_timeout_s": self.ack_timeout_s,
            "wire_dtype": self.wire_dtype,
            "uplink_codec": self.uplink_codec,
            "rounds": self.rounds,
        }

    @classmethod
    def from_wire(cls, value: Any) -> RoundSettings:
        """The settings of a decoded downlink; SettingsError when they cannot stand."""
        return cls(**check_settings(value))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _text(value: Any, name: str, allowed: tuple[str, ...] = ()) -> str:
    if not isinstance(value, str):
        raise SettingsError("malformed", f"settings.{name} must be a string, got {_kind(value)}")
    if allowed and value not in allowed:
        raise SettingsError(
            "out_of_range", f"settings.{name} {value[:40]!r} is not one of {allowed}"
        )
    if not 1 <= len(value) <= MAX_NAME_LEN:
        raise SettingsError("out_of_range", f"settings.{name} must be 1-{MAX_NAME_LEN} characters")
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _ack_timeout(value: Any) -> float:
    if not _is_number(value):
        raise SettingsError(
            "malformed", f"settings.ack_timeout_s must be a number, got {_kind(value)}"
        )
    v = float(value)
    if not math.isfinite(v) or not 0.0 < v <= MAX_ACK_TIMEOUT_S:
        raise SettingsError(
            "out_of_range", f"settings.ack_timeout_s {v} is not in (0, {MAX_ACK_TIMEOUT_S:g}] s"
        )
    return v


def _rounds(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SettingsError("malformed", f"settings.rounds must be an integer, got {_kind(value)}")
    if not 0 <= value <= MAX_ROUNDS:
        raise SettingsError("out_of_range", f"settings.rounds {value} is not in [0, {MAX_ROUNDS}]")
    return value


def _strategy_args(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SettingsError("malformed", "settings.strategy_args must be an object")
    if len(value) > MAX_ARGS:
        raise SettingsError("out_of_range", f"settings.strategy_args has over {MAX_ARGS} entries")
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SettingsError(
            "malformed", f"settings.strategy_args is not plain JSON: {exc}"
        ) from None
    if len(text) > MAX_ARGS_BYTES:
        raise SettingsError("out_of_range", "settings.strategy_args is too large")
    return dict(value)


def check_settings(value: Any) -> dict[str, Any]:
    """Every field of the settings, checked: the constructor's keyword arguments."""
    if not isinstance(value, dict):
        raise SettingsError("malformed", f"settings must be an object, got {_kind(value)}")
    fields = ("strategy", "strategy_args", "ack_timeout_s", "wire_dtype", "uplink_codec", "rounds")
    missing = [f for f in fields if f not in value]
    if missing:
        raise SettingsError("malformed", f"settings lack {', '.join(missing)}")
    unknown = sorted(str(k)[:40] for k in value if k not in fields)
    if unknown:
        raise SettingsError("malformed", f"settings hold unknown fields {unknown[:5]}")
    return {
        "strategy": _text(value["strategy"], "strategy"),
        "strategy_args": _strategy_args(value["strategy_args"]),
        "ack_timeout_s": _ack_timeout(value["ack_timeout_s"]),
        "wire_dtype": _text(value["wire_dtype"], "wire_dtype", WIRE_DTYPE_NAMES),
        "uplink_codec": _text(value["uplink_codec"], "uplink_codec", tuple(CODECS)),
        "rounds": _rounds(value["rounds"]),
    }
