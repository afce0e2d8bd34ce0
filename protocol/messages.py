"""The federation's wire messages: typed, versioned, validated at the boundary.

Every message on the wire is one frame:

    b"WKFL" | sha256(body) (32 bytes) | body

(a packed update's prefix hashes the body's header alone: protocol/frames.py) and `body` is
a safetensors file: the tensors (float32 or float16) plus, in the safetensors
header's `__metadata__`, one entry `wakefl` holding the message's JSON fields. Nothing is
ever unpickled; the header is checked by hand (size, dtypes, shapes, offsets) before the
safetensors library reads the tensors, and every refusal is a `MessageRejected` whose
`reason` is one of `REJECT_REASONS` (the server counts rejections by that code).

See docs/PROTOCOL.md for the topic layout and the ack/resend rules.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from wakefl.errors import ProtocolError
from wakefl.finite import all_finite
from wakefl.protocol import frames, update_codec
from wakefl.protocol.reasoned_error import ReasonedError
from wakefl.protocol.records import (
    MAX_RECORD_ABS,
    MAX_STEPS,
    RecordError,
    RecordSchema,
    check_record,
    finite_part,
)
from wakefl.protocol.round_settings import RoundSettings, SettingsError
from wakefl.protocol.update_codec import DELTA_CODECS, CodecError, Packed

# Version 2: acks name the message they answer (`answers`), the `decline` uplink, and
# bounds on every scalar field. Version 3: the strategy's own scalars travel as records
# (`instructions` down, `record` up) checked against the strategy's declared schema; the
# downlink's `sigma0_sq` and the uplink's `sigma_m_sq` and `local_steps` fields are gone
# (docs/PROTOCOL.md). Version 4: an uplink may carry its parameters compressed relative to
# the round's global model (`codec`: fp16 or int8 deltas with per-block scales, int8
# tensors on the wire, a checksum of the decoded vector; protocol/update_codec.py), and the
# downlink announces the fleet's `uplink_codec`. Version 5: the downlink's unchecked
# `hyperparameters` object is replaced by typed, checked `settings` (protocol/round_settings.py).
# Version 6: a packed uplink's checksum covers its packed bytes and the base's digest, not
# the decoded vector, and a frame's message id is the body hash its prefix carries.
# Version 7: a packed update's prefix hashes its header alone, which holds the checksum of
# its tensors (protocol/frames.py): the server hashes each update's bytes once, not twice
# (docs/SCALE.md, "Server CPU per update").
PROTOCOL_VERSION = 7
MAGIC = frames.MAGIC
_PREFIX_LEN = frames.PREFIX_LEN
# 64 MiB: a 3M-parameter fp32 model is ~12 MB, so this leaves room for Algorithm 2's second
# model and larger widths while staying below the shipped broker's packet limit.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
MAX_HEADER_BYTES = frames.MAX_HEADER_BYTES
MAX_ID_LEN = 128
# Bounds on scalar fields, far above any real fleet's values but small enough that every
# integer fits a SQLite INTEGER (signed 64 bit) and every float stays far from overflow
# when the server sums or squares it. A value outside is refused as `out_of_range`.
MAX_ROUND_ID = 2**31 - 1
MAX_NUM_SAMPLES = 10**9
MAX_LOCAL_STEPS = MAX_STEPS  # a strategy's step counts (records.MAX_STEPS)
MAX_SCALAR_ABS = MAX_RECORD_ABS  # every entry of a record, whatever its schema says
MAX_RELATIVE = 1e6  # relative FA / FR (ratios to the baseline)
MAX_DEADLINE = 1e11  # unix time, year ~5000
MAX_SCALARS = 256  # entries of a scalar map
MAX_REASON_LEN = 200
MESSAGE_ID_LEN = 32  # hex characters of `message_id`

WIRE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
_ST_DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2), "I8": (torch.int8, 1)}
# The only tensor that may be int8: the codes of an int8-delta uplink.
_INT8_TENSOR = "params.q"

REJECT_REASONS = (
    "malformed",  # not a frame, bad JSON, missing/ill-typed field
    "bad_hash",  # sha256 mismatch: corrupted in transit
    "oversized",  # larger than the configured limit
    "version",  # protocol version this build does not speak
    "pickle",  # pickle / torch.save content: never loaded
    "dtype",  # tensor dtype other than float32/float16
    "shape",  # tensor shape differs from the model's
    "non_finite",  # NaN or Inf in a tensor or a scalar
    "wrong_kind",  # e.g. a downlink on an uplink topic
    "topic_mismatch",  # device id in the message differs from the topic's
    "unknown_device",
    "wrong_device_type",
    "stale_round",  # round id other than the open round (late or replayed)
    "not_sampled",  # device was not sampled for this round
    "duplicate",  # second update for the same (round, device): QoS 1 redelivery or resend
    "out_of_range",  # a scalar field outside its documented bounds (e.g. num_samples >= 2^63)
    "outlier",  # refused at aggregation: too far from the global model (update_screening)
    "checksum",  # a compressed update decodes to other values than the device's checksum
    "internal",  # the server failed while handling the message (a bug; logged with a traceback)
)


class MessageRejected(ReasonedError, ProtocolError):
    """A message refused at the boundary; `reason` is one of REJECT_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in REJECT_REASONS:
            raise ValueError(f"unknown reject reason {reason!r}")
        super().__init__(reason, detail)


# ----------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Downlink:
    """Server -> all devices of a fleet, one per round (retained on the downlink topic).

    `instructions` holds, for each device sampled this round, the record of the strategy's
    `ClientInstructions` (its `downlink_schema` says what it may hold). Devices not listed
    sit the round out. `final=True` announces the end of the run (params = final global
    model).
    """

    fleet: str
    run_id: str
    round_id: int
    global_params: Tensor
    model_config: dict[str, Any]
    instructions: dict[str, dict[str, float]]
    settings: RoundSettings
    deadline: float
    final: bool = False
    strategy: str = "selffl"
    tensors: dict[str, Tensor] = field(default_factory=dict)  # shared extras for all devices
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Uplink:
    """Device -> server: its update for one round."""

    fleet: str
    run_id: str
    device_id: str
    device_type: str
    round_id: int
    params: Tensor
    num_samples: int
    record: dict[str, float] = field(default_factory=dict)  # the strategy's `ClientResult` scalars
    relative_fa: float | None = None
    relative_fr: float | None = None
    tensors: dict[str, Tensor] = field(default_factory=dict)  # e.g. Algorithm 2's model
    version: int = PROTOCOL_VERSION
    # A compressed update as received (`params` is empty until `unpack_uplink` rebuilds it
    # from the round's global model), or one to send as it is (already packed).
    packed: Packed | None = None


@dataclass(frozen=True)
class Ack:
    """Server -> one device: was its update for `round_id` recorded? `answers` is the
    `message_id` of the uplink this ack answers: a device acts only on acks for the very
    message it sent, so garbage that someone else published on its topic cannot make it
    drop its own update."""

    fleet: str
    device_id: str
    round_id: int
    accepted: bool
    reason: str = ""
    answers: str = ""
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Decline:
    """Device -> server on `up/D`: D was sampled for `round_id` but cannot train (broken
    local data or state, diverging training). The server stops waiting for D, so the round
    closes once the others answered instead of at its deadline."""

    fleet: str
    run_id: str
    device_id: str
    round_id: int
    reason: str = ""
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Hello:
    """Device -> server on every (re)connect, and as its MQTT will with online=False."""

    fleet: str
    device_id: str
    device_type: str
    num_samples: int = 0
    online: bool = True
    version: int = PROTOCOL_VERSION


Message = Downlink | Uplink | Ack | Hello | Decline

# ----------------------------------------------------------------------------- encoding


def _check_id(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LEN:
        raise MessageRejected(
            "malformed", f"{name} must be a non-empty string of at most {MAX_ID_LEN} chars"
        )
    if any(c in value for c in "/+#\x00") or not value.isprintable():
        raise MessageRejected(
            "malformed", f"{name} {value!r} contains '/', '+', '#' or control characters"
        )
    return value


def message_id(payload: bytes) -> str:
    """The id an `Ack` carries in `answers`, 128 bits in hex: for a frame, the first half
    of the body hash its prefix carries (the decoder checks that hash, so an accepted
    message is named without hashing it again); for any other bytes, of sha256(payload),
    so even garbage has one."""
    if len(payload) >= _PREFIX_LEN and payload[: len(MAGIC)] == MAGIC:
        return payload[len(MAGIC) : len(MAGIC) + MESSAGE_ID_LEN // 2].hex()
    return hashlib.sha256(payload).hexdigest()[:MESSAGE_ID_LEN]


def _short(value: Any) -> str:
    # repr of a 10^5-digit int is slow and useless in a log line
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _finite_float(
    value: Any, name: str, *, low: float = -MAX_SCALAR_ABS, high: float = MAX_SCALAR_ABS
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MessageRejected("malformed", f"{name} must be a number, got {type(value).__name__}")
    if isinstance(value, int) and not low <= value <= high:
        # float(10**400) would raise OverflowError
        raise MessageRejected(
            "out_of_range", f"{name} is {_short(value)}, outside [{low:g}, {high:g}]"
        )
    if not math.isfinite(value):
        raise MessageRejected("non_finite", f"{name} is {value}")
    if not low <= value <= high:
        raise MessageRejected("out_of_range", f"{name} is {value:g}, outside [{low:g}, {high:g}]")
    return float(value)


def _optional_float(
    value: Any, name: str, *, low: float = -MAX_SCALAR_ABS, high: float = MAX_SCALAR_ABS
) -> float | None:
    return None if value is None else _finite_float(value, name, low=low, high=high)


def _int(value: Any, name: str, minimum: int = 0, maximum: int = MAX_ROUND_ID) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MessageRejected("malformed", f"{name} must be an integer, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise MessageRejected(
            "out_of_range", f"{name} is {_short(value)}, outside [{minimum}, {maximum}]"
        )
    return value


def _text(value: Any, name: str, limit: int = MAX_REASON_LEN) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise MessageRejected("malformed", f"{name} must be a string of at most {limit} chars")
    return value


def _prepare_tensor(t: Tensor, name: str, wire: torch.dtype) -> Tensor:
    if not isinstance(t, Tensor):
        raise ProtocolError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
    if not t.is_floating_point():
        raise ProtocolError(f"tensor {name!r} has dtype {t.dtype}; only float tensors are sent")
    out = t.detach().to("cpu", wire).contiguous()
    if not all_finite(out):
        hint = " (values beyond the fp16 range?)" if wire == torch.float16 else ""
        raise ProtocolError(f"tensor {name!r} holds NaN or Inf{hint}; refusing to send it")
    return out


def _frame(
    meta: dict[str, Any], tensors: dict[str, Tensor], wire_dtype: str, max_bytes: int
) -> bytes:
    if wire_dtype not in WIRE_DTYPES:
        raise ProtocolError(f"wire dtype must be one of {sorted(WIRE_DTYPES)}, got {wire_dtype!r}")
    wire = WIRE_DTYPES[wire_dtype]
    prepared = {
        k: v.contiguous() if v.dtype == torch.int8 else _prepare_tensor(v, k, wire)
        for k, v in tensors.items()
    }
    body = st_save(
        prepared, metadata={"wakefl": json.dumps(meta, allow_nan=False, separators=(",", ":"))}
    )
    data_start = 8 + int.from_bytes(body[:8], "little")
    payload = frames.wrap(body, frames.hashed_length(meta, prepared, data_start, len(body)))
    if len(payload) > max_bytes:
        raise MessageRejected("oversized", f"message is {len(payload)} bytes, limit {max_bytes}")
    return payload


def _pack_params(
    msg: Uplink, meta: dict[str, Any], tensors: dict[str, Tensor], codec: str, base: Tensor | None
) -> str:
    """Replace the uplink's `params` tensor by its packed form (`msg.packed`, or `codec`
    relative to `base`) and describe it in `meta["codec"]`; returns the frame's float
    dtype (int8 scales travel in fp32, an fp16 delta in fp16)."""
    packed = msg.packed
    if packed is None:
        if base is None:
            raise ProtocolError(f"uplink codec {codec} needs the round's global model")
        try:
            packed = update_codec.encode(msg.params, base, codec)
        except ValueError as exc:
            raise ProtocolError(f"cannot pack the update with {codec}: {exc}") from exc
    del tensors["params"]
    tensors.update({f"params.{k}": v for k, v in packed.tensors.items()})
    meta["codec"] = {
        "name": packed.codec,
        "numel": packed.numel,
        "block": packed.block,
        "sha256": packed.checksum,
    }
    wire = "fp16" if packed.codec == "fp16-delta" else "fp32"
    meta["wire_dtype"] = wire
    return wire


def _downlink_meta(msg: Downlink, wire_dtype: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The downlink's header and tensors (the global model, then its extra tensors)."""
    meta = {
        "v": msg.version,
        "kind": "down",
        "fleet": msg.fleet,
        "run_id": msg.run_id,
        "round_id": msg.round_id,
        "model_config": msg.model_config,
        "instructions": msg.instructions,
        "settings": msg.settings.to_wire(),
        "deadline": msg.deadline,
        "final": msg.final,
        "strategy": msg.strategy,
        "wire_dtype": wire_dtype,
    }
    tensors = {"global_params": msg.global_params}
    tensors.update({f"x.{k}": v for k, v in msg.tensors.items()})
    return meta, tensors


def _uplink_meta(
    msg: Uplink, wire_dtype: str, uplink_codec: str, base: Tensor | None
) -> tuple[dict[str, Any], dict[str, Tensor], str]:
    """The uplink's header, tensors and frame dtype, its parameters packed when it has a
    packed form or `uplink_codec` is a delta codec."""
    meta = {
        "v": msg.version,
        "kind": "up",
        "fleet": msg.fleet,
        "run_id": msg.run_id,
        "device_id": msg.device_id,
        "device_type": msg.device_type,
        "round_id": msg.round_id,
        "num_samples": msg.num_samples,
        "record": msg.record,
        "relative_fa": msg.relative_fa,
        "relative_fr": msg.relative_fr,
        "wire_dtype": wire_dtype,
    }
    tensors = {"params": msg.params}
    tensors.update({f"x.{k}": v for k, v in msg.tensors.items()})
    if msg.packed is not None or uplink_codec in DELTA_CODECS:
        wire_dtype = _pack_params(msg, meta, tensors, uplink_codec, base)
    return meta, tensors, wire_dtype


def _control_meta(msg: Message) -> dict[str, Any]:
    """The header of a message without tensors: an ack, a decline or a hello."""
    if isinstance(msg, Ack):
        return {
            "v": msg.version,
            "kind": "ack",
            "fleet": msg.fleet,
            "device_id": msg.device_id,
            "round_id": msg.round_id,
            "accepted": msg.accepted,
            "reason": msg.reason,
            "answers": msg.answers,
        }
    if isinstance(msg, Decline):
        return {
            "v": msg.version,
            "kind": "decline",
            "fleet": msg.fleet,
            "run_id": msg.run_id,
            "device_id": msg.device_id,
            "round_id": msg.round_id,
            "reason": msg.reason[:MAX_REASON_LEN],
        }
    if isinstance(msg, Hello):
        return {
            "v": msg.version,
            "kind": "hello",
            "fleet": msg.fleet,
            "device_id": msg.device_id,
            "device_type": msg.device_type,
            "num_samples": msg.num_samples,
            "online": msg.online,
        }
    raise ProtocolError(f"cannot encode a {type(msg).__name__}")


def encode(
    msg: Message,
    *,
    wire_dtype: str = "fp32",
    max_bytes: int = DEFAULT_MAX_BYTES,
    uplink_codec: str = "",
    base: Tensor | None = None,
) -> bytes:
    """Serialise a message to one wire frame. Raises ProtocolError for non-finite tensors
    or scalars, and MessageRejected('oversized') past `max_bytes`. An `Uplink` is packed
    relative to `base` (the round's global model, as the device decoded it) when
    `uplink_codec` is a delta codec, or sent as its `packed` form when it has one."""
    tensors: dict[str, Tensor]
    try:
        if isinstance(msg, Downlink):
            meta, tensors = _downlink_meta(msg, wire_dtype)
        elif isinstance(msg, Uplink):
            meta, tensors, wire_dtype = _uplink_meta(msg, wire_dtype, uplink_codec, base)
        else:
            meta, tensors = _control_meta(msg), {}
    except AttributeError as exc:
        raise ProtocolError(f"incomplete message: {exc}") from exc
    try:
        return _frame(meta, tensors, wire_dtype, max_bytes)
    except ValueError as exc:  # json.dumps(allow_nan=False)
        raise ProtocolError(f"message scalars must be finite: {exc}") from exc


# ----------------------------------------------------------------------------- decoding


def _check_tensor_entry(name: str, entry: Any, data_len: int) -> str:
    """One tensor's header entry: dtype F32/F16, a shape of non-negative ints, offsets
    inside the data that match the shape. Returns the dtype."""
    if not isinstance(entry, dict):
        raise MessageRejected("malformed", f"tensor entry {name!r} is not an object")
    dt, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dt not in _ST_DTYPES or (dt == "I8" and name != _INT8_TENSOR):
        raise MessageRejected(
            "dtype",
            f"tensor {name!r} has dtype {_short(dt)}; only F32/F16 are accepted "
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


def _read_header(body: bytes) -> frames.FrameHeader:
    hlen = frames.header_length(body[:8], len(body))
    return frames.read_header(memoryview(body)[8:], hlen)


def _parse_body(
    body: bytes, parsed: frames.FrameHeader | None = None
) -> tuple[dict[str, Any], dict[str, Tensor], str]:
    """Validate the safetensors header by hand (`parsed`, when the caller has read it),
    then let safetensors read the tensors."""
    if parsed is None:
        try:
            parsed = _read_header(body)
        except frames.FrameError as exc:
            raise MessageRejected(exc.reason, exc.detail) from None
    header, meta = parsed.entries, parsed.meta
    data_len = len(body) - parsed.data_start
    all_dtypes = {_check_tensor_entry(name, entry, data_len) for name, entry in header.items()}
    dtypes = all_dtypes - {"I8"}  # the float tensors are all of one dtype
    if len(dtypes) > 1:
        raise MessageRejected("dtype", f"mixed tensor dtypes {sorted(dtypes)}")
    if "I8" in all_dtypes:
        dtypes = {"I8"}
    try:
        tensors = st_load(body) if header else {}
    except Exception as exc:  # the library's own checks (overlaps, alignment...)
        raise MessageRejected("malformed", f"safetensors refused the body: {exc}") from exc
    for name, t in tensors.items():
        if not all_finite(t):
            raise MessageRejected("non_finite", f"tensor {name!r} holds NaN or Inf")
    return meta, tensors, (next(iter(dtypes)) if dtypes else "")


def _check_hash(body: bytes, hashed: int, sent: bytes) -> None:
    """The prefix's hash over the body's first `hashed` bytes (frames.hashed_length)."""
    if hashlib.sha256(memoryview(body)[:hashed]).digest() != sent:
        raise MessageRejected("bad_hash", "sha256 of the body does not match: corrupted payload")


def _refuse_pickle(body: bytes) -> None:
    # A safetensors body starts with its header length (u64 LE), whose first byte may well
    # be 0x80: only a body whose length prefix is impossible is taken for a pickle/zip.
    impossible = len(body) < 8 or struct.unpack("<Q", body[:8])[0] > len(body)
    if impossible and (body[:1] == b"\x80" or body[:4] == b"PK\x03\x04"):
        raise MessageRejected(
            "pickle", "body looks like a pickle or torch.save archive; never loaded"
        )


def _unframe(data: bytes, max_bytes: int) -> tuple[dict[str, Any], dict[str, Tensor]]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MessageRejected("malformed", f"payload is a {type(data).__name__}, not bytes")
    data = bytes(data)
    if len(data) > max_bytes:
        raise MessageRejected("oversized", f"message is {len(data)} bytes, limit {max_bytes}")
    if data[:1] == b"\x80" or data[:4] == b"PK\x03\x04":
        raise MessageRejected(
            "pickle", "payload looks like a pickle or torch.save archive; never loaded"
        )
    if len(data) < _PREFIX_LEN or data[: len(MAGIC)] != MAGIC:
        if b"pickle" in data[:256] or data[:2] in (b"\x80\x02", b"\x80\x04"):
            raise MessageRejected("pickle", "payload looks like a pickle; never loaded")
        raise MessageRejected("malformed", "not a wakefl frame (bad magic or too short)")
    body, sent = data[_PREFIX_LEN:], data[len(MAGIC) : _PREFIX_LEN]
    try:
        parsed = _read_header(body)
    except frames.FrameError as exc:
        _check_hash(body, len(body), sent)  # corrupted in transit, or sent so
        _refuse_pickle(body)
        raise MessageRejected(exc.reason, exc.detail) from None
    _check_hash(
        body,
        frames.hashed_length(parsed.meta, parsed.entries, parsed.data_start, len(body)),
        sent,
    )
    meta, tensors, _ = _parse_body(body, parsed)
    version = meta.get("v")
    if version != PROTOCOL_VERSION:
        older = (
            " (a peer from before v7's frame hash of packed updates: update it)"
            if version == PROTOCOL_VERSION - 1
            else ""
        )
        raise MessageRejected(
            "version",
            f"protocol version {_short(version)}, this build speaks {PROTOCOL_VERSION}{older}",
        )
    return meta, tensors


def _extras(tensors: dict[str, Tensor], main: str) -> dict[str, Tensor]:
    extra = {}
    for k, v in tensors.items():
        if k == main:
            continue
        if not k.startswith("x."):
            raise MessageRejected("malformed", f"unexpected tensor {k!r}")
        extra[k[2:]] = v.float()
    return extra


def _scalar_map(value: Any, name: str, schema: RecordSchema | None = None) -> dict[str, float]:
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
        _text(k, f"{name} key", MAX_ID_LEN): _finite_float(v, f"{name}.{k}")
        for k, v in value.items()
    }
    if schema is None:
        return record
    try:
        return check_record(value, schema, name)
    except RecordError as exc:
        raise MessageRejected(exc.reason, exc.detail) from None


def _uplink_params(
    meta: dict[str, Any], tensors: dict[str, Tensor], expected_numel: int | None
) -> tuple[Tensor, Packed | None]:
    """The uplink's parameters: the plain `params` tensor, or (with a `codec` field) the
    packed update's tensors taken out of `tensors` and checked field by field
    (update_codec.check_packed); its `params` stay empty until `unpack_uplink`."""
    codec = meta.get("codec")
    if codec is None:
        return _main_tensor(tensors, "params", expected_numel), None
    if not isinstance(codec, dict):
        raise MessageRejected("malformed", "codec must be an object")
    if "params" in tensors:
        raise MessageRejected("malformed", "a packed uplink carries no plain params tensor")
    numel = codec.get("numel")
    if expected_numel is not None and numel != expected_numel:
        raise MessageRejected(
            "shape", f"packed update of {_short(numel)} entries, the model has {expected_numel}"
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


def _main_tensor(tensors: dict[str, Tensor], name: str, expected_numel: int | None) -> Tensor:
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


@dataclass(frozen=True)
class Expect:
    """What the receiver knows beforehand: the model's parameter count (checks every
    shipped model vector) and the running strategy's record schemas (check the uplink's
    `record` and each entry of the downlink's `instructions`). None: not checked."""

    numel: int | None = None
    uplink_schema: RecordSchema | None = None
    downlink_schema: RecordSchema | None = None


def decode(
    data: bytes,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    expected_numel: int | None = None,
    uplink_schema: RecordSchema | None = None,
    downlink_schema: RecordSchema | None = None,
) -> Message:
    """Parse and validate one wire frame; raises MessageRejected with a precise reason,
    and only MessageRejected, whatever the bytes. `expected_numel` (the model's parameter
    count) checks every shipped model vector; `uplink_schema` / `downlink_schema` (the
    running strategy's) check the records."""
    expect = Expect(expected_numel, uplink_schema, downlink_schema)
    try:
        meta, tensors = _unframe(data, max_bytes)
        return _decode_fields(meta, tensors, expect)
    except MessageRejected:
        raise
    except Exception as exc:  # noqa: BLE001 - hostile bytes must never escape as a crash
        raise MessageRejected(
            "malformed", f"undecodable message ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None


def _decode_fields(meta: dict[str, Any], tensors: dict[str, Tensor], expect: Expect) -> Message:
    kind = meta.get("kind")
    try:
        if kind == "down":
            return _decode_downlink(meta, tensors, expect)
        if kind == "up":
            return _decode_uplink(meta, tensors, expect)
        if isinstance(kind, str) and kind in _TENSORLESS:
            if tensors:
                raise MessageRejected("malformed", f"a {kind} message carries no tensors")
            return _TENSORLESS[kind](meta)
    except KeyError as exc:
        raise MessageRejected("malformed", f"{kind} message lacks field {exc}") from exc
    if tensors:
        raise MessageRejected("malformed", f"a {_short(kind)} message carries no tensors")
    raise MessageRejected("malformed", f"unknown message kind {_short(kind)}")


def _decode_downlink(meta: dict[str, Any], tensors: dict[str, Tensor], expect: Expect) -> Downlink:
    expected_numel = expect.numel
    instr = meta["instructions"]
    if not isinstance(instr, dict):
        raise MessageRejected("malformed", "instructions must be an object")
    instructions = {
        _check_id(d, "device id"): _scalar_map(s, f"instructions.{d}", expect.downlink_schema)
        for d, s in instr.items()
    }
    if not isinstance(meta["model_config"], dict):
        raise MessageRejected("malformed", "model_config must be an object")
    try:
        settings = RoundSettings.from_wire(meta["settings"])
    except SettingsError as exc:
        raise MessageRejected(exc.reason, exc.detail) from None
    if not isinstance(meta["final"], bool):
        raise MessageRejected("malformed", "final must be a boolean")
    extras = _extras(tensors, "global_params")
    if expected_numel is not None:
        for k, v in extras.items():
            if v.numel() != expected_numel:
                raise MessageRejected("shape", f"extra tensor {k!r} has {v.numel()} entries")
    return Downlink(
        fleet=_check_id(meta["fleet"], "fleet"),
        run_id=_check_id(meta["run_id"], "run_id"),
        round_id=_int(meta["round_id"], "round_id"),
        global_params=_main_tensor(tensors, "global_params", expected_numel),
        model_config=meta["model_config"],
        instructions=instructions,
        settings=settings,
        deadline=_finite_float(meta["deadline"], "deadline", low=0.0, high=MAX_DEADLINE),
        final=meta["final"],
        strategy=_text(meta.get("strategy", "selffl"), "strategy", MAX_ID_LEN),
        tensors=extras,
        version=meta["v"],
    )


def _decode_uplink(meta: dict[str, Any], tensors: dict[str, Tensor], expect: Expect) -> Uplink:
    expected_numel = expect.numel
    params, packed = _uplink_params(meta, tensors, expected_numel)
    extras = _extras(tensors, "params")
    if expected_numel is not None:
        for k, v in extras.items():
            if v.dim() != 1 or v.numel() != expected_numel:
                raise MessageRejected("shape", f"extra tensor {k!r} has shape {list(v.shape)}")
    return Uplink(
        fleet=_check_id(meta["fleet"], "fleet"),
        run_id=_check_id(meta["run_id"], "run_id"),
        device_id=_check_id(meta["device_id"], "device_id"),
        device_type=_check_id(meta["device_type"], "device_type"),
        round_id=_int(meta["round_id"], "round_id", 1),
        params=params,
        num_samples=_int(meta["num_samples"], "num_samples", 0, MAX_NUM_SAMPLES),
        record=_scalar_map(meta.get("record", {}), "record", expect.uplink_schema),
        relative_fa=_optional_float(
            meta.get("relative_fa"), "relative_fa", low=0.0, high=MAX_RELATIVE
        ),
        relative_fr=_optional_float(
            meta.get("relative_fr"), "relative_fr", low=0.0, high=MAX_RELATIVE
        ),
        tensors=extras,
        version=meta["v"],
        packed=packed,
    )


def _decode_ack(meta: dict[str, Any]) -> Ack:
    if not isinstance(meta["accepted"], bool):
        raise MessageRejected("malformed", "ack field accepted must be a boolean")
    return Ack(
        fleet=_check_id(meta["fleet"], "fleet"),
        device_id=_check_id(meta["device_id"], "device_id"),
        round_id=_int(meta["round_id"], "round_id"),
        accepted=meta["accepted"],
        reason=_text(meta.get("reason", ""), "reason"),
        answers=_text(meta.get("answers", ""), "answers", MESSAGE_ID_LEN),
        version=meta["v"],
    )


def _decode_hello(meta: dict[str, Any]) -> Hello:
    if not isinstance(meta.get("online", True), bool):
        raise MessageRejected("malformed", "hello field online must be a boolean")
    return Hello(
        fleet=_check_id(meta["fleet"], "fleet"),
        device_id=_check_id(meta["device_id"], "device_id"),
        device_type=_check_id(meta["device_type"], "device_type"),
        num_samples=_int(meta.get("num_samples", 0), "num_samples", 0, MAX_NUM_SAMPLES),
        online=meta.get("online", True),
        version=meta["v"],
    )


def _decode_decline(meta: dict[str, Any]) -> Decline:
    return Decline(
        fleet=_check_id(meta["fleet"], "fleet"),
        run_id=_check_id(meta["run_id"], "run_id"),
        device_id=_check_id(meta["device_id"], "device_id"),
        round_id=_int(meta["round_id"], "round_id", 1),
        reason=_text(meta.get("reason", ""), "reason"),
        version=meta["v"],
    )


_TENSORLESS: dict[str, Callable[[dict[str, Any]], Message]] = {
    "ack": _decode_ack,
    "hello": _decode_hello,
    "decline": _decode_decline,
}


def decode_as(data: bytes, cls: type, **kw: Any) -> Any:
    """`decode`, then insist on one message class (MessageRejected('wrong_kind') otherwise)."""
    msg = decode(data, **kw)
    if not isinstance(msg, cls):
        raise MessageRejected("wrong_kind", f"expected {cls.__name__}, got {type(msg).__name__}")
    return msg


def payload_dtype(data: bytes) -> str:
    """'fp32', 'fp16', 'int8' (an int8-delta uplink) or '' (no tensors) of an already
    valid frame, for logs and benchmarks."""
    _, _, dt = _parse_body(bytes(data)[_PREFIX_LEN:])
    return {"F32": "fp32", "F16": "fp16", "I8": "int8"}.get(dt, "")


def wire_size(numel: int, wire_dtype: str = "fp32") -> int:
    """Approximate bytes of one uplink for a model of `numel` parameters (header excluded)."""
    return numel * (2 if wire_dtype == "fp16" else 4) + _PREFIX_LEN


def scalars_only(mapping: Mapping[str, Any]) -> dict[str, float]:
    """Keep the finite numeric entries of a mapping (what fits in a record)."""
    return finite_part(mapping)
