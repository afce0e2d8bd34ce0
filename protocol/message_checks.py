"""The checks of the messages' fields at the boundary, each refusal a `MessageRejected` with
its reject code: ids, bounded numbers and texts, tensor entries of the safetensors header,
scalar maps, and an uplink's parameters against the round's base model."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from wakefl.protocol import update_codec
from wakefl.protocol.message_types import (
    MAX_ID_LEN,
    MAX_REASON_LEN,
    MAX_ROUND_ID,
    MAX_SCALAR_ABS,
    MAX_SCALARS,
    MessageRejected,
    Uplink,
)
from wakefl.protocol.records import (
    RecordError,
    RecordSchema,
    check_record,
    finite_part,
)
from wakefl.protocol.update_codec import CodecError, Packed

_ST_DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2), "I8": (torch.int8, 1)}
# The only tensor that may be int8: the codes of an int8-delta uplink.
_INT8_TENSOR = "params.q"


def check_id(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LEN:
        raise MessageRejected(
            "malformed", f"{name} must be a non-empty string of at most {MAX_ID_LEN} chars"
        )
    if any(c in value for c in "/+#\x00") or not value.isprintable():
        raise MessageRejected(
            "malformed", f"{name} {value!r} contains '/', '+', '#' or control characters"
        )
    return value


def short_repr(value: Any) -> str:
    # repr of a 10^5-digit int is slow and useless in a log line
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def finite_float(
    value: Any, name: str, *, low: float = -MAX_SCALAR_ABS, high: float = MAX_SCALAR_ABS
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MessageRejected("malformed", f"{name} must be a number, got {type(value).__name__}")
    if isinstance(value, int) and not low <= value <= high:
        # float(10**400) would raise OverflowError
        raise MessageRejected(
            "out_of_range", f"{name} is {short_repr(value)}, outside [{low:g}, {high:g}]"
        )
    if not math.isfinite(value):
        raise MessageRejected("non_finite", f"{name} is {value}")
    if not low <= value <= high:
        raise MessageRejected("out_of_range", f"{name} is {value:g}, outside [{low:g}, {high:g}]")
    return float(value)


def optional_float(
    value: Any, name: str, *, low: float = -MAX_SCALAR_ABS, high: float = MAX_SCALAR_ABS
) -> float | None:
    return None if value is None else finite_float(value, name, low=low, high=high)


def bounded_int(value: Any, name: str, minimum: int = 0, maximum: int = MAX_ROUND_ID) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MessageRejected("malformed", f"{name} must be an integer, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise MessageRejected(
            "out_of_range", f"{name} is {short_repr(value)}, outside [{minimum}, {maximum}]"
        )
    return value


def bounded_text(value: Any, name: str, limit: int = MAX_REASON_LEN) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise MessageRejected("malformed", f"{name} must be a string of at most {limit} chars")
    return value


def check_tensor_entry(name: str, entry: Any, data_len: int) -> str:
    """One tensor's header entry: dtype F32/F16, a shape of non-negative ints, offsets
    inside the data that match the shape. Returns the dtype."""
    if not isinstance(entry, dict):
        raise MessageRejected("malformed", f"tensor entry {name!r} is not an object")
    dt, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dt not in _ST_DTYPES or (dt == "I8" and name != _INT8_TENSOR):
        raise MessageRejected(
            "dtype",
            f"tensor {name!r} has dtype {short_repr(dt)}; only F32/F16 are accepted "
            f"(and I8 for {_INT8_TENSOR})",
        )
    if (
        not isinstance(shape, list)
        or not all(isinstance(s, int) and s >= 0 for s in shape)
        or not isinstance(offs, list)
        or len(offs) != 2
        or not all(isinstance(o, int) for o in offs)
    ):
        raise MessageRejected("malformed", f"tensor {name!r} has a bad shape or offsets")
    numel = math.prod(shape)
    if not 0 <= offs[0] <= offs[1] <= data_len or offs[1] - offs[0] != numel * _ST_DTYPES[dt][1]:
        raise MessageRejected("malformed", f"tensor {name!r} offsets do not match its shape")
    return dt


def scalar_map(value: Any, name: str, schema: RecordSchema | None = None) -> dict[str, float]:
    """A record: at most MAX_SCALARS finite numbers within +-MAX_SCALAR_ABS under short
    names, whatever the strategy; then, given the strategy's `schema`, exactly what it
    declares, within its bounds."""
    if not isinstance(value, dict):
        raise MessageRejected("malformed", f"{name} must be an object")
    if len(value) > MAX_SCALARS:
        raise MessageRejected(
            "out_of_range", f"{name} has {len(value)} entries, at most {MAX_SCALARS}"
        )
    record = {
        bounded_text(k, f"{name} key", MAX_ID_LEN): finite_float(v, f"{name}.{k}")
        for k, v in value.items()
    }
    if schema is None:
        return record
    try:
        return check_record(value, schema, name)
    except RecordError as exc:
        raise MessageRejected(exc.reason, exc.detail) from None


def uplink_params(
    meta: dict[str, Any], tensors: dict[str, Tensor], expected_numel: int | None
) -> tuple[Tensor, Packed | None]:
    """The uplink's parameters: the plain `params` tensor, or (with a `codec` field) the
    packed update's tensors taken out of `tensors` and checked field by field
    (update_codec.check_packed); its `params` stay empty until `unpack_uplink`."""
    codec = meta.get("codec")
    if codec is None:
        return main_tensor(tensors, "params", expected_numel), None
    if not isinstance(codec, dict):
        raise MessageRejected("malformed", "codec must be an object")
    if "params" in tensors:
        raise MessageRejected("malformed", "a packed uplink carries no plain params tensor")
    numel = codec.get("numel")
    if expected_numel is not None and numel != expected_numel:
        raise MessageRejected(
            "shape", f"packed update of {short_repr(numel)} entries, the model has {expected_numel}"
        )
    parts = {k[len("params.") :]: v for k, v in tensors.items() if k.startswith("params.")}
    for k in parts:
        del tensors[f"params.{k}"]
    try:
        packed = update_codec.check_packed(
            codec.get("name"), numel, codec.get("block", 0), codec.get("sha256"), parts
        )
    except CodecError as exc:
        raise MessageRejected(exc.reason, exc.detail) from None
    return torch.empty(0), packed


def check_uplink(msg: Uplink, base: Tensor) -> None:
    """`unpack_uplink`'s checks (`checksum`, `non_finite`) without rebuilding the
    parameters, for a receiver that records the packed update and decodes it later."""
    if msg.packed is None:
        return
    try:
        update_codec.verify(msg.packed, base)
    except CodecError as exc:
        raise MessageRejected(exc.reason, exc.detail) from None


def unpack_uplink(msg: Uplink, base: Tensor) -> Uplink:
    """A packed uplink with its parameters rebuilt from `base` (the round's global model
    as the devices decoded it), refused as `checksum` unless they are exactly what the
    device computed (`non_finite`, `shape` likewise). A plain uplink is returned as it is."""
    if msg.packed is None:
        return msg
    try:
        params = update_codec.verified_decode(msg.packed, base)
    except CodecError as exc:
        raise MessageRejected(exc.reason, exc.detail) from None
    return replace(msg, params=params)


def main_tensor(tensors: dict[str, Tensor], name: str, expected_numel: int | None) -> Tensor:
    t = tensors.get(name)
    if t is None:
        raise MessageRejected("malformed", f"tensor {name!r} is missing")
    if not t.is_floating_point():
        raise MessageRejected("dtype", f"{name} must be a float tensor")
    if t.dim() != 1:
        raise MessageRejected("shape", f"{name} must be a flat vector, got shape {list(t.shape)}")
    if expected_numel is not None and t.numel() != expected_numel:
        raise MessageRejected(
            "shape", f"{name} has {t.numel()} entries, the model has {expected_numel}"
        )
    return t.float()


def scalars_only(mapping: Mapping[str, Any]) -> dict[str, float]:
    """Keep the finite numeric entries of a mapping (what fits in a record)."""
    return finite_part(mapping)
