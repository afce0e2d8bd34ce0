"""The federation's wire messages as types: the protocol version, the limits on every field,
the reject codes, and the five messages (Downlink, Uplink, Ack, Decline, Hello).

protocol/messages.py is the public face of the messages (`from wakefl.protocol import
messages`); this module, the checks (`message_checks`), the encoder (`message_encode`) and
the decoder (`message_decode`) are its parts. See docs/PROTOCOL.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from wakefl.errors import ProtocolError
from wakefl.protocol import frames
from wakefl.protocol.reasoned_error import ReasonedError
from wakefl.protocol.records import (
    MAX_RECORD_ABS,
    MAX_STEPS,
)
from wakefl.protocol.round_settings import RoundSettings
from wakefl.protocol.update_codec import Packed

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


def message_id(payload: bytes) -> str:
    """The id an `Ack` carries in `answers`, 128 bits in hex: for a frame, the first half
    of the body hash its prefix carries (the decoder checks that hash, so an accepted
    message is named without hashing it again); for any other bytes, of sha256(payload),
    so even garbage has one."""
    if len(payload) >= frames.PREFIX_LEN and payload[: len(MAGIC)] == MAGIC:
        return payload[len(MAGIC) : len(MAGIC) + MESSAGE_ID_LEN // 2].hex()
    return hashlib.sha256(payload).hexdigest()[:MESSAGE_ID_LEN]
