"""The federation's wire messages: typed, versioned, validated at the boundary.

Every message on the wire is one frame:

    b"WKFL" | sha256(body) (32 bytes) | body

(a packed update's prefix hashes the body's header alone: protocol/frames.py) and `body` is
a safetensors file: the tensors (float32 or float16) plus, in the safetensors
header's `__metadata__`, one entry `wakefl` holding the message's JSON fields. Nothing is
ever unpickled; the header is checked by hand (size, dtypes, shapes, offsets) before the
safetensors library reads the tensors, and every refusal is a `MessageRejected` whose
`reason` is one of `REJECT_REASONS` (the server counts rejections by that code).

The messages are built in four parts: the types, limits and reject codes
(`message_types`), the field checks (`message_checks`), the encoder (`message_encode`) and
the decoder (`message_decode`). This module is their one public face: every name a device,
the server or a tool uses is here, and each part imports only those before it.

See docs/PROTOCOL.md for the topic layout and the ack/resend rules.
"""

from __future__ import annotations

from wakefl.errors import ProtocolError
from wakefl.protocol.message_checks import (
    check_uplink,
    scalars_only,
    unpack_uplink,
)
from wakefl.protocol.message_decode import (
    Expect,
    decode,
    decode_as,
    payload_dtype,
)
from wakefl.protocol.message_encode import (
    encode,
    wire_size,
)
from wakefl.protocol.message_types import (
    DEFAULT_MAX_BYTES,
    MAGIC,
    MAX_DEADLINE,
    MAX_HEADER_BYTES,
    MAX_ID_LEN,
    MAX_LOCAL_STEPS,
    MAX_NUM_SAMPLES,
    MAX_REASON_LEN,
    MAX_RELATIVE,
    MAX_ROUND_ID,
    MAX_SCALAR_ABS,
    MAX_SCALARS,
    MESSAGE_ID_LEN,
    PROTOCOL_VERSION,
    REJECT_REASONS,
    WIRE_DTYPES,
    Ack,
    Decline,
    Downlink,
    Hello,
    Message,
    MessageRejected,
    Uplink,
    message_id,
)

__all__ = [
    "Ack",
    "check_uplink",
    "Decline",
    "decode",
    "decode_as",
    "DEFAULT_MAX_BYTES",
    "Downlink",
    "encode",
    "Expect",
    "Hello",
    "MAGIC",
    "MAX_DEADLINE",
    "MAX_HEADER_BYTES",
    "MAX_ID_LEN",
    "MAX_LOCAL_STEPS",
    "MAX_NUM_SAMPLES",
    "MAX_REASON_LEN",
    "MAX_RELATIVE",
    "MAX_ROUND_ID",
    "MAX_SCALAR_ABS",
    "MAX_SCALARS",
    "Message",
    "message_id",
    "MESSAGE_ID_LEN",
    "MessageRejected",
    "payload_dtype",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "REJECT_REASONS",
    "scalars_only",
    "unpack_uplink",
    "Uplink",
    "WIRE_DTYPES",
    "wire_size",
]
