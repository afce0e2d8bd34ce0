"""Decoding of the messages from untrusted bytes: the frame's prefix, size and hash, the
safetensors header read by protocol/frames.py and checked entry by entry, no pickle ever, then
each message's fields checked; every refusal a `MessageRejected` with its reject code."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from safetensors.torch import load as st_load
from torch import Tensor

from wakefl.finite import all_finite
from wakefl.protocol import frames
from wakefl.protocol.message_checks import (
    bounded_int,
    bounded_text,
    check_id,
    check_tensor_entry,
    finite_float,
    main_tensor,
    optional_float,
    scalar_map,
    short_repr,
    uplink_params,
)
from wakefl.protocol.message_types import (
    DEFAULT_MAX_BYTES,
    MAGIC,
    MAX_DEADLINE,
    MAX_ID_LEN,
    MAX_NUM_SAMPLES,
    MAX_RELATIVE,
    MESSAGE_ID_LEN,
    PROTOCOL_VERSION,
    Ack,
    Decline,
    Downlink,
    Hello,
    Message,
    MessageRejected,
    Uplink,
)
from wakefl.protocol.records import (
    RecordSchema,
)
from wakefl.protocol.round_settings import RoundSettings, SettingsError


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
    all_dtypes = {check_tensor_entry(name, entry, data_len) for name, entry in header.items()}
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
    if len(data) < frames.PREFIX_LEN or data[: len(MAGIC)] != MAGIC:
        if b"pickle" in data[:256] or data[:2] in (b"\x80\x02", b"\x80\x04"):
            raise MessageRejected("pickle", "payload looks like a pickle; never loaded")
        raise MessageRejected("malformed", "not a wakefl frame (bad magic or too short)")
    body, sent = data[frames.PREFIX_LEN :], data[len(MAGIC) : frames.PREFIX_LEN]
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
            f"protocol version {short_repr(version)}, this build speaks {PROTOCOL_VERSION}{older}",
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
        raise MessageRejected("malformed", f"a {short_repr(kind)} message carries no tensors")
    raise MessageRejected("malformed", f"unknown message kind {short_repr(kind)}")


def _decode_downlink(meta: dict[str, Any], tensors: dict[str, Tensor], expect: Expect) -> Downlink:
    expected_numel = expect.numel
    instr = meta["instructions"]
    if not isinstance(instr, dict):
        raise MessageRejected("malformed", "instructions must be an object")
    instructions = {
        check_id(d, "device id"): scalar_map(s, f"instructions.{d}", expect.downlink_schema)
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
        fleet=check_id(meta["fleet"], "fleet"),
        run_id=check_id(meta["run_id"], "run_id"),
        round_id=bounded_int(meta["round_id"], "round_id"),
        global_params=main_tensor(tensors, "global_params", expected_numel),
        model_config=meta["model_config"],
        instructions=instructions,
        settings=settings,
        deadline=finite_float(meta["deadline"], "deadline", low=0.0, high=MAX_DEADLINE),
        final=meta["final"],
        strategy=bounded_text(meta.get("strategy", "selffl"), "strategy", MAX_ID_LEN),
        tensors=extras,
        version=meta["v"],
    )


def _decode_uplink(meta: dict[str, Any], tensors: dict[str, Tensor], expect: Expect) -> Uplink:
    expected_numel = expect.numel
    params, packed = uplink_params(meta, tensors, expected_numel)
    extras = _extras(tensors, "params")
    if expected_numel is not None:
        for k, v in extras.items():
            if v.dim() != 1 or v.numel() != expected_numel:
                raise MessageRejected("shape", f"extra tensor {k!r} has shape {list(v.shape)}")
    return Uplink(
        fleet=check_id(meta["fleet"], "fleet"),
        run_id=check_id(meta["run_id"], "run_id"),
        device_id=check_id(meta["device_id"], "device_id"),
        device_type=check_id(meta["device_type"], "device_type"),
        round_id=bounded_int(meta["round_id"], "round_id", 1),
        params=params,
        num_samples=bounded_int(meta["num_samples"], "num_samples", 0, MAX_NUM_SAMPLES),
        record=scalar_map(meta.get("record", {}), "record", expect.uplink_schema),
        relative_fa=optional_float(
            meta.get("relative_fa"), "relative_fa", low=0.0, high=MAX_RELATIVE
        ),
        relative_fr=optional_float(
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
        fleet=check_id(meta["fleet"], "fleet"),
        device_id=check_id(meta["device_id"], "device_id"),
        round_id=bounded_int(meta["round_id"], "round_id"),
        accepted=meta["accepted"],
        reason=bounded_text(meta.get("reason", ""), "reason"),
        answers=bounded_text(meta.get("answers", ""), "answers", MESSAGE_ID_LEN),
        version=meta["v"],
    )


def _decode_hello(meta: dict[str, Any]) -> Hello:
    if not isinstance(meta.get("online", True), bool):
        raise MessageRejected("malformed", "hello field online must be a boolean")
    return Hello(
        fleet=check_id(meta["fleet"], "fleet"),
        device_id=check_id(meta["device_id"], "device_id"),
        device_type=check_id(meta["device_type"], "device_type"),
        num_samples=bounded_int(meta.get("num_samples", 0), "num_samples", 0, MAX_NUM_SAMPLES),
        online=meta.get("online", True),
        version=meta["v"],
    )


def _decode_decline(meta: dict[str, Any]) -> Decline:
    return Decline(
        fleet=check_id(meta["fleet"], "fleet"),
        run_id=check_id(meta["run_id"], "run_id"),
        device_id=check_id(meta["device_id"], "device_id"),
        round_id=bounded_int(meta["round_id"], "round_id", 1),
        reason=bounded_text(meta.get("reason", ""), "reason"),
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
    _, _, dt = _parse_body(bytes(data)[frames.PREFIX_LEN :])
    return {"F32": "fp32", "F16": "fp16", "I8": "int8"}.get(dt, "")
