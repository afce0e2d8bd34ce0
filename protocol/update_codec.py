"""Compressed model updates: pure encoding and decoding of a flat parameter vector relative
to the round's global model (no I/O; numpy for the arithmetic, so both ends compute the
same float32 results bit for bit).

Codecs (chosen per fleet by the server, announced in the downlink's
`settings.uplink_codec`; docs/PROTOCOL.md):

- `fp32`, `fp16`: the parameters themselves in that dtype (no base needed).
- `fp16-delta`: delta = params - base in float16; decoded = base + float32(delta).
- `int8-delta`: delta in blocks of `BLOCK` (256) entries; per block a float32 scale
  s = max|delta| / 127 and int8 codes q = round(delta / s) in [-127, 127]; decoded =
  base + float32(q) * s (the product and the sum each rounded once, in float32). Each
  entry's quantisation error is at most s / 2 of its block. 256 entries per scale: the
  scales cost 4/256 = 1.6 % on top of the 1 byte per entry, so an update is ~0.254x its
  fp32 size, while a block still spans only part of one convolution's weights (the
  full-size model's layers hold 10^3-10^6 entries), so one large entry widens the step of
  at most 255 neighbours.

The sender's checksum (`packed_checksum`, protocol v6) is SHA-256 over the digest of the
base it encoded against (`base_facts`: SHA-256 of the base's float32 little-endian bytes),
the codec's name, size and block, and the packed tensors' little-endian bytes. The
receiver checks it against its own copy of the base's digest before decoding, and refuses
the update when they differ (a different base, a bug or tampering). Decoding is a fixed
sequence of float32 operations on those bytes, so what it aggregates is exactly what the
device meant to send. Hashing the packed bytes (2.9 MB for the full model in int8) instead
of the decoded vector (11.7 MB) costs the server a quarter of the time per update; the
base's digest is taken once per base tensor (docs/SCALE.md, "Server CPU per update").

Every field of a packed update is bounded and checked (`check_packed`) before any
arithmetic; a violation raises `CodecError` with a reason from the wire protocol's reject
codes.
"""

from __future__ import annotations

import hashlib
import math
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from wakefl.protocol.codec_names import CODEC_TENSORS, CODECS, DELTA_CODECS, PLAIN_CODECS
from wakefl.protocol.reasoned_error import ReasonedError

BLOCK = 256  # entries per int8 scale
MIN_BLOCK, MAX_BLOCK = 16, 65536  # accepted block sizes (powers of two)
# A scale larger than this cannot come from a finite float32 delta (max 3.4e38 / 127).
MAX_SCALE = float(np.finfo(np.float32).max) / 127.0
MAX_NUMEL = 1 << 28  # 256 M entries: far above any model this SDK ships
CHECKSUM_LEN = 64  # hex characters of SHA-256

_DTYPES = {"delta": torch.float16, "q": torch.int8, "scale": torch.float32}


class CodecError(ReasonedError, ValueError):
    """A packed update that cannot be decoded; `reason` is a wire reject code."""


@dataclass(frozen=True)
class Packed:
    """One encoded update: `tensors` by codec (`CODEC_TENSORS`), the decoded vector's
    `numel` and `checksum`, the int8 `block` (0 for fp16-delta)."""

    codec: str
    numel: int
    block: int
    tensors: dict[str, Tensor]
    checksum: str

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def checksum(vec: Tensor) -> str:
    """SHA-256 (hex) over the little-endian bytes of `vec` as a contiguous float32 vector."""
    arr = np.ascontiguousarray(vec.detach().cpu().to(torch.float32).numpy(), dtype="<f4")
    return hashlib.sha256(arr.data.cast("B")).hexdigest()


@dataclass(frozen=True)
class BaseFacts:
    """What encoding and decoding against one base need of it, taken once per base
    tensor: its digest, and its largest magnitude (for the finiteness bound)."""

    digest: bytes
    max_abs: float


# id(base) -> (a weak reference to it, its in-place version, its facts); a few bases at
# most are live at once (a round's, the previous one's), so the oldest entries are dropped.
_BASE_FACTS: dict[int, tuple[weakref.ref[Tensor], int, BaseFacts]] = {}
_BASE_FACTS_KEPT = 8
_BASE_LOCK = threading.Lock()


def base_facts(base: Tensor) -> BaseFacts:
    """The base's digest and largest magnitude, cached per tensor object and in-place
    version (a round's base is decoded once and used for every update of the round)."""
    with _BASE_LOCK:
        held = _BASE_FACTS.get(id(base))
    if held is not None and held[0]() is base and held[1] == base._version:
        return held[2]
    b = _f32(base).reshape(-1)
    big = float(np.abs(b).max()) if b.size else 0.0
    facts = BaseFacts(bytes.fromhex(checksum(base)), big)
    with _BASE_LOCK:
        _BASE_FACTS[id(base)] = (weakref.ref(base), base._version, facts)
        while len(_BASE_FACTS) > _BASE_FACTS_KEPT:
            del _BASE_FACTS[next(iter(_BASE_FACTS))]
    return facts


_WIRE_DTYPES = {"delta": "<f2", "q": "i1", "scale": "<f4"}


def packed_checksum(
    codec: str, numel: int, block: int, tensors: dict[str, Tensor], digest: bytes
) -> str:
    """SHA-256 (hex) over the base's `digest`, the codec's name, size and block, and the
    codec's tensors' little-endian bytes in `CODEC_TENSORS` order."""
    h = hashlib.sha256(digest)
    h.update(f"{codec}:{numel}:{block}".encode("ascii"))
    for name in CODEC_TENSORS[codec]:
        arr = np.ascontiguousarray(tensors[name].detach().cpu().numpy(), dtype=_WIRE_DTYPES[name])
        h.update(arr.data.cast("B"))
    return h.hexdigest()


def _f32(t: Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float32).contiguous().numpy()


def quantize_int8(delta: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(int8 codes, float32 scale per block) of a float32 vector; a zero block has scale 0."""
    n = delta.size
    nb = -(-n // block)
    padded = np.zeros(nb * block, dtype=np.float32)
    padded[:n] = delta
    blocks = padded.reshape(nb, block)
    scale = (np.abs(blocks).max(axis=1) / np.float32(127.0)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    q = np.clip(np.rint(blocks / safe[:, None]), -127, 127).astype(np.int8)
    return q.reshape(-1)[:n], scale


def dequantize_int8(
    q: np.ndarray, scale: np.ndarray, block: int, out: np.ndarray | None = None
) -> np.ndarray:
    """float32(q) * scale of its block, one rounding per entry, into `out` when given (a
    float32 buffer of q's size, reused by a caller that decodes many updates). Whole blocks
    broadcast their scale (no per-entry copy of the scales); the last, partial block uses
    its own."""
    if out is None:
        out = np.empty(q.size, dtype=np.float32)
    full = (q.size // block) * block
    np.multiply(
        q[:full].reshape(-1, block),
        scale[: full // block, None],
        out=out[:full].reshape(-1, block),
        dtype=np.float32,
    )
    if full < q.size:
        np.multiply(q[full:], scale[full // block], out=out[full:], dtype=np.float32)
    return out


def _decode_delta(packed: Packed, out: np.ndarray | None = None) -> np.ndarray:
    if packed.codec == "int8-delta":
        return dequantize_int8(
            packed.tensors["q"].numpy(), packed.tensors["scale"].numpy(), packed.block, out
        )
    delta = packed.tensors["delta"].numpy()
    if out is None:
        return delta.astype(np.float32)
    out[...] = delta
    return out


def decode(packed: Packed, base: Tensor, out: np.ndarray | None = None) -> Tensor:
    """The float32 vector a packed update stands for, given the round's global model (no
    checksum check: `verified_decode` does that); into `out` (a float32 buffer of the
    update's size) when given, else a new array."""
    b = _f32(base)
    if b.size != packed.numel:
        raise CodecError("shape", f"the base has {b.size} entries, the update {packed.numel}")
    if out is not None and (out.dtype != np.float32 or out.size != packed.numel):
        raise ValueError(f"out must be a float32 buffer of {packed.numel} entries")
    # Overflow to Inf is not an error here: `verified_decode` refuses it.
    with np.errstate(over="ignore", invalid="ignore"):
        delta = _decode_delta(packed, out)  # the sum goes into it
        return torch.from_numpy(np.add(b, delta, out=delta, dtype=np.float32))


def _surely_finite(packed: Packed, base_max_abs: float) -> bool:
    """True when base + delta cannot overflow float32: the largest delta an int8 block
    can hold (127 scales) or fp16 can hold (65504), plus the base's largest entry, stays
    below half the float32 range (each sum is rounded once, far from the limit)."""
    if packed.codec == "int8-delta":
        scale = packed.tensors["scale"]
        biggest = 127.0 * float(scale.max()) if scale.numel() else 0.0
    else:
        biggest = 65504.0
    return base_max_abs + biggest < float(np.finfo(np.float32).max) / 2


def _checked_facts(packed: Packed, base: Tensor) -> BaseFacts:
    """The base's facts, once the sender's checksum matches the packed bytes and them."""
    facts = base_facts(base)
    got = packed_checksum(packed.codec, packed.numel, packed.block, packed.tensors, facts.digest)
    if got != packed.checksum:
        raise CodecError(
            "checksum",
            f"update has sha256 {got[:16]}..., the device sent "
            f"{packed.checksum[:16]}... (a different base model, or corrupted codes)",
        )
    return facts


def _require_finite(decoded: Tensor) -> Tensor:
    if not bool(np.isfinite(decoded.numpy()).all()):
        raise CodecError("non_finite", "the decoded update holds NaN or Inf")
    return decoded


def verify(packed: Packed, base: Tensor) -> None:
    """Insist on the sender's checksum for the packed bytes and this base, and on a
    finite decoded vector: decoded and checked only where the codes could overflow."""
    facts = _checked_facts(packed, base)
    if not _surely_finite(packed, facts.max_abs):
        _require_finite(decode(packed, base))


def verified_decode(packed: Packed, base: Tensor) -> Tensor:
    """`verify` and `decode` with one decode."""
    facts = _checked_facts(packed, base)
    out = decode(packed, base)
    return out if _surely_finite(packed, facts.max_abs) else _require_finite(out)


def encode(params: Tensor, base: Tensor, codec: str, block: int = BLOCK) -> Packed:
    """Pack `params` relative to `base` with a delta codec, with `packed_checksum` over the
    packed tensors and the base's digest. ValueError when the delta does not fit the codec
    (fp16 overflow) or the inputs are not finite vectors of one size."""
    if codec not in DELTA_CODECS:
        raise ValueError(f"codec must be one of {DELTA_CODECS}, got {codec!r}")
    p, b = _f32(params).reshape(-1), _f32(base).reshape(-1)
    if p.size != b.size:
        raise ValueError(f"params have {p.size} entries, the base {b.size}")
    delta = np.subtract(p, b, dtype=np.float32)
    if not np.isfinite(delta).all():
        raise ValueError("the update is not finite relative to the base")
    if codec == "int8-delta":
        _check_block(block)
        q, scale = quantize_int8(delta, block)
        tensors = {"q": torch.from_numpy(q), "scale": torch.from_numpy(scale)}
    else:
        with np.errstate(over="ignore"):
            half = delta.astype(np.float16)
        if not np.isfinite(half).all():
            raise ValueError("the delta exceeds the float16 range")
        tensors, block = {"delta": torch.from_numpy(half)}, 0
    digest = base_facts(base).digest
    return Packed(
        codec,
        int(p.size),
        block,
        tensors,
        packed_checksum(codec, int(p.size), block, tensors, digest),
    )


def _check_block(block: object) -> int:
    if (
        isinstance(block, bool)
        or not isinstance(block, int)
        or not MIN_BLOCK <= block <= MAX_BLOCK
        or block & (block - 1)
    ):
        raise CodecError(
            "out_of_range",
            f"block size {block!r} is not a power of two in [{MIN_BLOCK}, {MAX_BLOCK}]",
        )
    return block


def _check_tensor(name: str, t: Tensor, numel: int) -> None:
    if t.dtype != _DTYPES[name]:
        raise CodecError("dtype", f"{name} is {t.dtype}, the codec needs {_DTYPES[name]}")
    if t.dim() != 1 or t.numel() != numel:
        raise CodecError("shape", f"{name} has shape {list(t.shape)}, expected [{numel}]")


def _check_fields(codec: object, numel: object, digest: object) -> None:
    if codec not in DELTA_CODECS:
        raise CodecError("malformed", f"unknown update codec {str(codec)[:40]!r}")
    if isinstance(numel, bool) or not isinstance(numel, int) or not 0 < numel <= MAX_NUMEL:
        raise CodecError("out_of_range", f"update size {str(numel)[:40]} outside [1, {MAX_NUMEL}]")
    if (
        not isinstance(digest, str)
        or len(digest) != CHECKSUM_LEN
        or any(c not in "0123456789abcdef" for c in digest)
    ):
        raise CodecError("malformed", "checksum must be 64 lowercase hex characters")


def check_packed(
    codec: object, numel: object, block: object, digest: object, tensors: dict[str, Tensor]
) -> Packed:
    """A `Packed` from untrusted fields, every one bounded: known codec, size within
    MAX_NUMEL, block size, checksum format, exactly the codec's tensors with their dtypes
    and sizes (int8: one scale per block), scales finite in [0, MAX_SCALE], codes in
    [-127, 127], fp16 deltas finite."""
    _check_fields(codec, numel, digest)
    assert isinstance(codec, str) and isinstance(numel, int) and isinstance(digest, str)
    names = CODEC_TENSORS[codec]
    if set(tensors) != set(names):
        raise CodecError("malformed", f"{codec} carries {sorted(names)}, got {sorted(tensors)}")
    if codec == "int8-delta":
        blk = _check_block(block)
        _check_tensor("q", tensors["q"], numel)
        _check_tensor("scale", tensors["scale"], math.ceil(numel / blk))
        scale = tensors["scale"].numpy()
        if not np.isfinite(scale).all():
            raise CodecError("non_finite", "a block scale is NaN or Inf")
        if scale.size and not (scale.min() >= 0 and scale.max() <= MAX_SCALE):
            raise CodecError("out_of_range", f"block scales must lie in [0, {MAX_SCALE:.3g}]")
        if int(tensors["q"].min()) < -127:
            raise CodecError("out_of_range", "int8 codes must lie in [-127, 127]")
    else:
        if block != 0:
            raise CodecError("out_of_range", "fp16-delta has no block size (0)")
        blk = 0
        _check_tensor("delta", tensors["delta"], numel)
        if not bool(torch.isfinite(tensors["delta"]).all()):
            raise CodecError("non_finite", "the fp16 delta holds NaN or Inf")
    return Packed(codec, numel, blk, dict(tensors), digest)


def size_ratio(numel: int, codec: str, block: int = BLOCK) -> float:
    """Tensor bytes of one update with `codec` over its fp32 bytes (headers excluded)."""
    per_entry = {"fp32": 4.0, "fp16": 2.0, "fp16-delta": 2.0, "int8-delta": 1.0}[codec]
    extra = 4 * math.ceil(numel / block) if codec == "int8-delta" else 0
    return (per_entry * numel + extra) / (4.0 * numel)


__all__ = [
    "BLOCK",
    "CODEC_TENSORS",
    "CODECS",
    "DELTA_CODECS",
    "PLAIN_CODECS",
    "CodecError",
    "Packed",
    "check_packed",
    "base_facts",
    "checksum",
    "packed_checksum",
    "decode",
    "encode",
    "size_ratio",
    "verified_decode",
    "verify",
]
