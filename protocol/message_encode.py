"""Encoding of the messages: the fields as JSON in the safetensors header, the tensors in the
wire dtype, a packed uplink's codec tensors, and the frame around them (protocol/frames.py)."""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import save as st_save
from torch import Tensor

from wakefl.errors import ProtocolError
from wakefl.finite import all_finite
from wakefl.protocol import frames, update_codec
from wakefl.protocol.message_types import (
    DEFAULT_MAX_BYTES,
    MAX_REASON_LEN,
    WIRE_DTYPES,
    Ack,
    Decline,
    Downlink,
    Hello,
    Message,
    MessageRejected,
    Uplink,
)
from wakefl.protocol.update_codec import DELTA_CODECS


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


def wire_size(numel: int, wire_dtype: str = "fp32") -> int:
    """Approximate bytes of one uplink for a model of `numel` parameters (header excluded)."""
    return numel * (2 if wire_dtype == "fp16" else 4) + frames.PREFIX_LEN
