"""The wire frame, read in one place.

    b"WKFL" | sha256(body[:hashed_length]) (32 bytes) | body

`body` is a safetensors file: u64 header length (little endian), the JSON header (tensor
entries, and in `__metadata__["wakefl"]` the message's JSON fields), the tensor data.

The prefix's hash covers the whole body, except in a packed update: a frame whose fields
name a delta codec (`codec.name`) and whose tensors are exactly that codec's. There it
covers the 8-byte length and the JSON header alone (`hashed_length`, protocol v7): the
header holds the codec's checksum over those tensors' bytes and the round's base
(protocol/update_codec.py), which the receiver checks before it uses the update, so the
prefix still commits to every byte while the receiver hashes the 3 MB of a full-size int8
update once, not twice (docs/SCALE.md, "Server CPU per update"). A frame with any other
tensor beside the codec's is hashed whole.
`read_header` is the one reader of that header: the decoder uses it on untrusted bytes
(protocol/message_decode.py, which then checks every entry and lets safetensors read the
tensors), and the server's store on the frames it recorded (server/recorded_updates.py,
which reads the tensors straight from the file). `peek` reads a frame's fields alone, for a
tool that routes or times messages without decoding them; `body_metadata` reads the JSON
metadata of any safetensors body the project writes under its own key (the server's state
file, an aggregation worker's result). Both keep the decoder's bounds.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from wakefl.protocol.codec_names import CODEC_TENSORS
from wakefl.protocol.reasoned_error import ReasonedError

MAGIC = b"WKFL"
HASH_LEN = hashlib.sha256().digest_size
PREFIX_LEN = len(MAGIC) + HASH_LEN  # the body starts here
# The JSON header holds per-device scalars for every sampled device of a downlink.
MAX_HEADER_BYTES = 8 * 1024 * 1024
# The key in the safetensors `__metadata__` that holds a message's JSON fields.
MESSAGE_KEY = "wakefl"


class FrameError(ReasonedError, ValueError):
    """A frame header that cannot be read; `reason` is a reject code (`malformed`)."""


@dataclass(frozen=True)
class FrameHeader:
    """The message's JSON fields, the safetensors entries of its tensors (unchecked), and
    where the tensor data starts, counted from the start of the body."""

    meta: dict[str, Any]
    entries: dict[str, Any]
    data_start: int


def _json(text: bytes | str, what: str) -> Any:
    # Besides JSONDecodeError, json.loads raises ValueError for integers of more than 4300
    # digits and RecursionError for deeply nested arrays: all are the sender's fault.
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise FrameError("malformed", f"{what} is not acceptable JSON: {str(exc)[:200]}") from None


def header_length(first8: bytes, body_len: int | None = None) -> int:
    """The JSON header's length from the body's first 8 bytes, within MAX_HEADER_BYTES
    and (when known) the body's length."""
    if len(first8) < 8:
        raise FrameError("malformed", "body shorter than a safetensors header")
    hlen = int.from_bytes(first8[:8], "little")
    if hlen > MAX_HEADER_BYTES or (body_len is not None and 8 + hlen > body_len):
        raise FrameError("malformed", f"safetensors header length {hlen} out of bounds")
    return hlen


def read_header(raw: bytes | memoryview, hlen: int, key: str = MESSAGE_KEY) -> FrameHeader:
    """Parse the `hlen` bytes of a body's JSON header; `meta` is the JSON object stored
    under `key` in its `__metadata__` (a message's fields by default)."""
    header = _json(bytes(raw[:hlen]), "safetensors header")
    if not isinstance(header, dict):
        raise FrameError("malformed", "safetensors header is not an object")
    st_meta = header.pop("__metadata__", None)
    if not isinstance(st_meta, dict) or not isinstance(st_meta.get(key), str):
        raise FrameError("malformed", f"no {key} metadata in the safetensors header")
    meta = _json(st_meta[key], f"{key} metadata")
    if not isinstance(meta, dict):
        raise FrameError("malformed", f"{key} metadata is not an object")
    return FrameHeader(meta, header, 8 + hlen)


def body_metadata(body: bytes | memoryview, key: str) -> dict[str, Any]:
    """The JSON object under `key` in a safetensors body's `__metadata__`, the header's
    length bounded as the decoder bounds it; the tensors are not read."""
    view = memoryview(body)
    hlen = header_length(bytes(view[:8]), len(view))
    return read_header(view[8:], hlen, key).meta


def peek(frame: bytes | memoryview) -> dict[str, Any]:
    """A frame's message fields (its JSON metadata), read from the head of the frame with
    the decoder's bounds; the hash is not checked and the tensors are not read, so this is
    for routing or timing a message, never for trusting it (that is the decoder's job)."""
    view = memoryview(frame)
    if len(view) < PREFIX_LEN or bytes(view[: len(MAGIC)]) != MAGIC:
        raise FrameError("malformed", "not a wakefl frame")
    return body_metadata(view[PREFIX_LEN:], MESSAGE_KEY)


def packed_tensor_names(meta: dict[str, Any]) -> frozenset[str] | None:
    """The frame's tensor names when `meta` describes a packed update (a `codec` object
    naming a delta codec), else None."""
    codec = meta.get("codec")
    name = codec.get("name") if isinstance(codec, dict) else None
    if not isinstance(name, str) or name not in CODEC_TENSORS:
        return None
    return frozenset(f"params.{t}" for t in CODEC_TENSORS[name])


def hashed_length(
    meta: dict[str, Any], tensor_names: Iterable[str], data_start: int, body_len: int
) -> int:
    """How many leading bytes of the body the prefix's hash covers: the header alone
    (`data_start` bytes) for a packed update carrying only its codec's tensors, whose
    checksum in the header covers them; the whole body otherwise."""
    names = packed_tensor_names(meta)
    if names is not None and frozenset(tensor_names) == names:
        return data_start
    return body_len


def wrap(body: bytes, hashed: int) -> bytes:
    """The frame of `body`, its prefix hashing the first `hashed` bytes (`hashed_length`)."""
    return MAGIC + hashlib.sha256(memoryview(body)[:hashed]).digest() + body


def seal(body: bytes) -> bytes:
    """The frame of any body, by the rule of `hashed_length` (a body whose header cannot be
    read is hashed whole): for a tool or test that builds its own bodies."""
    try:
        h = read_header(memoryview(body)[8:], header_length(body[:8], len(body)))
    except FrameError:
        return wrap(body, len(body))
    return wrap(body, hashed_length(h.meta, h.entries, h.data_start, len(body)))
