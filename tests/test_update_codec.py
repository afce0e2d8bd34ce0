"""Compressed updates (protocol/update_codec.py, wire protocol v4): error bounds against their
closed forms, the decoded checksum, the size gain, and every hostile packed field refused
with its reason."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save as st_save

from wakefl.protocol import frames
from wakefl.protocol import messages as M
from wakefl.protocol import update_codec as C
from wakefl.server.state_store import StateStore


def _vectors(d: int = 5000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=g)
    # blocks of very different magnitudes, and one all-zero block
    mag = torch.logspace(-6, 1, d // C.BLOCK + 1)[torch.arange(d) // C.BLOCK]
    delta = torch.randn(d, generator=g) * mag
    delta[C.BLOCK : 2 * C.BLOCK] = 0.0
    return base, base + delta


def _ulp(x: np.ndarray) -> np.ndarray:
    return np.spacing(np.abs(x).astype(np.float32))


@pytest.mark.parametrize("d", [5000, 256, 17, 4096 + 3])
def test_int8_error_is_at_most_half_a_step_of_its_block(d):
    base, params = _vectors(max(d, 600))
    base, params = base[:d], params[:d]
    packed = C.encode(params, base, "int8-delta")
    out = C.decode(packed, base).numpy()
    scale = np.repeat(packed.tensors["scale"].numpy(), C.BLOCK)[:d]
    p = params.numpy()
    # |q s - delta| <= s / 2 (rounding to the nearest code), plus one float32 rounding each
    # for the delta, the product and the sum
    bound = scale / 2 + 2 * _ulp(p) + _ulp(p - base.numpy())
    assert (np.abs(out - p) <= bound * (1 + 1e-6)).all()
    assert packed.tensors["q"].dtype == torch.int8 and int(packed.tensors["q"].min()) >= -127
    assert packed.tensors["scale"].numel() == -(-d // C.BLOCK)


def test_int8_zero_block_and_identical_model_decode_exactly():
    base, params = _vectors()
    out = C.decode(C.encode(params, base, "int8-delta"), base)
    block = slice(C.BLOCK, 2 * C.BLOCK)
    assert torch.equal(out[block], base[block])
    assert torch.equal(C.decode(C.encode(base, base, "int8-delta"), base), base)


def test_fp16_delta_error_is_half_an_fp16_ulp():
    base, params = _vectors()
    out = C.decode(C.encode(params, base, "fp16-delta"), base).numpy()
    delta = (params - base).numpy()
    half_ulp = np.spacing(np.abs(delta).astype(np.float16)).astype(np.float32) / 2
    bound = half_ulp + _ulp(params.numpy()) + _ulp(delta)
    assert (np.abs(out - params.numpy()) <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("codec", ["int8-delta", "fp16-delta"])
def test_checksum_is_sha256_of_the_base_digest_header_and_packed_bytes(codec):
    base, params = _vectors()
    packed = C.encode(params, base, codec)
    h = hashlib.sha256(hashlib.sha256(base.numpy().astype("<f4").tobytes()).digest())
    h.update(f"{codec}:{packed.numel}:{packed.block}".encode())
    for name in C.CODEC_TENSORS[codec]:
        h.update(packed.tensors[name].numpy().tobytes())
    assert packed.checksum == h.hexdigest()
    assert torch.equal(C.verified_decode(packed, base), C.decode(packed, base))


def test_the_base_digest_follows_in_place_changes_of_the_base():
    base, params = _vectors()
    packed = C.encode(params, base, "int8-delta")
    C.verified_decode(packed, base)  # the digest of this base is now cached
    base[3] += 1e-3  # the same tensor object, changed in place
    with pytest.raises(C.CodecError) as info:
        C.verified_decode(packed, base)
    assert info.value.reason == "checksum"


def test_a_decoded_overflow_is_refused_as_non_finite():
    # Valid codes and scales whose sum with a base near the float32 limit overflows: the
    # bound cannot rule it out, so the decoded vector is checked.
    base = torch.full((512,), 3.0e38)
    params = base.clone()
    packed = C.encode(params, base, "int8-delta")
    big = torch.full_like(packed.tensors["scale"], C.MAX_SCALE)
    q = torch.full_like(packed.tensors["q"], 127)
    tensors = {"q": q, "scale": big}
    digest = C.base_facts(base).digest
    forged = C.Packed(
        "int8-delta", 512, packed.block, tensors,
        C.packed_checksum("int8-delta", 512, packed.block, tensors, digest),
    )  # fmt: skip
    with pytest.raises(C.CodecError) as info:
        C.verified_decode(forged, base)
    assert info.value.reason == "non_finite"


def _up(params: torch.Tensor, **kw) -> M.Uplink:
    return M.Uplink("f1", "run1", "dev-a", "speaker", 3, params, 120, {"sigma_sq": 0.25}, **kw)


@pytest.mark.parametrize("codec", ["int8-delta", "fp16-delta"])
def test_packed_uplink_round_trip_and_size(codec):
    base, params = _vectors(100_000)
    frame = M.encode(_up(params), uplink_codec=codec, base=base)
    plain = M.encode(_up(params))
    msg = M.decode(frame, expected_numel=params.numel())
    assert msg.packed is not None and msg.packed.codec == codec and msg.params.numel() == 0
    full = M.unpack_uplink(msg, base)
    assert torch.equal(full.params, C.decode(msg.packed, base))
    assert len(frame) / len(plain) <= (0.3 if codec == "int8-delta" else 0.51)
    assert M.payload_dtype(frame) == ("int8" if codec == "int8-delta" else "fp16")


def test_a_different_base_is_refused_as_checksum():
    base, params = _vectors()
    msg = M.decode(M.encode(_up(params), uplink_codec="int8-delta", base=base))
    other = base.clone()
    other[7] += 1e-3
    with pytest.raises(M.MessageRejected) as info:
        M.unpack_uplink(msg, other)
    assert info.value.reason == "checksum"


def _packed_frame(meta_codec: dict, tensors: dict, **meta_kw) -> bytes:
    meta = {
        "v": M.PROTOCOL_VERSION,
        "kind": "up",
        "fleet": "f1",
        "run_id": "r",
        "device_id": "a",
        "device_type": "t",
        "round_id": 1,
        "num_samples": 1,
        "record": {},
        "codec": meta_codec,
        **meta_kw,
    }
    body = st_save(tensors, metadata={"wakefl": json.dumps(meta)})
    return frames.seal(body)


def _good(d: int = 1000) -> tuple[dict, dict, torch.Tensor]:
    base, params = _vectors(d)
    p = C.encode(params, base, "int8-delta")
    codec = {"name": p.codec, "numel": d, "block": p.block, "sha256": p.checksum}
    return codec, {"params.q": p.tensors["q"], "params.scale": p.tensors["scale"]}, base


def _reason(data: bytes, base: torch.Tensor | None = None, **kw) -> str:
    with pytest.raises(M.MessageRejected) as info:
        msg = M.decode(data, **kw)
        if base is not None:
            M.unpack_uplink(msg, base)
    return info.value.reason


def test_tampered_codes_with_a_valid_frame_hash_are_refused_as_checksum():
    codec, t, base = _good()
    q = t["params.q"].clone()
    q[5] = 0 if q[5] != 0 else 1
    assert _reason(_packed_frame(codec, {**t, "params.q": q}), base) == "checksum"
    # the untampered frame goes through
    msg = M.unpack_uplink(M.decode(_packed_frame(codec, t), expected_numel=1000), base)
    assert msg.params.numel() == 1000


def _scales(t: dict, value: float, at: int = 0) -> dict:
    s = t["params.scale"].clone()
    s[at] = value
    return {**t, "params.scale": s}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda c, t: (c, _scales(t, float("nan"))), "non_finite"),
        (lambda c, t: (c, _scales(t, float("inf"))), "non_finite"),
        (lambda c, t: (c, _scales(t, -1.0)), "out_of_range"),
        (lambda c, t: (c, _scales(t, 1e37)), "out_of_range"),
        # one scale too few / too many for the block count
        (lambda c, t: (c, {**t, "params.scale": t["params.scale"][:-1]}), "shape"),
        (lambda c, t: (c, {**t, "params.scale": torch.zeros(5000)}), "shape"),
        (lambda c, t: ({**c, "block": 100}, t), "out_of_range"),
        (lambda c, t: ({**c, "block": 1 << 20}, t), "out_of_range"),
        (lambda c, t: ({**c, "block": "256"}, t), "out_of_range"),
        (lambda c, t: ({**c, "numel": 2**40}, t), "shape"),
        (lambda c, t: ({**c, "numel": -1}, t), "shape"),
        (lambda c, t: ({**c, "numel": 999}, t), "shape"),
        (lambda c, t: ({**c, "name": "zip-delta"}, t), "malformed"),
        (lambda c, t: ({**c, "sha256": "00" * 31}, t), "malformed"),
        (lambda c, t: ({**c, "sha256": "G" * 64}, t), "malformed"),
        (lambda c, t: ({k: v for k, v in c.items() if k != "sha256"}, t), "malformed"),
        (lambda c, t: ("int8-delta", t), "malformed"),
        (lambda c, t: (c, {"params.q": t["params.q"]}), "malformed"),
        (lambda c, t: (c, {**t, "params": torch.zeros(1000)}), "malformed"),
        (lambda c, t: (c, {**t, "params.q": t["params.q"].float()}), "dtype"),
        (lambda c, t: (c, {**t, "params.q": t["params.q"].reshape(10, 100)}), "shape"),
        (
            lambda c, t: (c, {**t, "params.q": torch.full((1000,), -128, dtype=torch.int8)}),
            "out_of_range",
        ),
        (lambda c, t: (c, {**t, "x.personal": torch.zeros(1000, dtype=torch.int8)}), "dtype"),
    ],
)
def test_hostile_packed_fields_are_refused_with_their_reason(change, reason):
    codec, t, base = _good()
    codec, t = change(codec, t)
    assert _reason(_packed_frame(codec, t), base, expected_numel=1000) == reason


def test_absurd_size_is_refused_before_any_arithmetic_without_expected_numel():
    codec, t, _ = _good()
    assert _reason(_packed_frame({**codec, "numel": 10**12}, t)) == "out_of_range"


def test_int8_tensors_anywhere_else_are_refused():
    codec, t, _ = _good()
    meta = {
        "v": M.PROTOCOL_VERSION,
        "kind": "up",
        "fleet": "f1",
        "run_id": "r",
        "device_id": "a",
        "device_type": "t",
        "round_id": 1,
        "num_samples": 1,
        "record": {},
    }
    body = st_save({"params": torch.zeros(1000, dtype=torch.int8)}, metadata={"wakefl": "{}"})
    assert _reason(frames.seal(body)) == "dtype"
    # codes without a codec field: not a known tensor
    body = st_save(t, metadata={"wakefl": json.dumps(meta)})
    assert _reason(frames.seal(body)) == "malformed"


def test_packed_update_recorded_and_read_back_from_the_round_base(tmp_path):
    base, params = _vectors()
    frame = M.encode(_up(params), uplink_codec="int8-delta", base=base)
    msg = M.unpack_uplink(M.decode(frame), base)
    store = StateStore(tmp_path)
    try:
        assert store.record_update(msg, frame)
        (res,) = list(store.updates(3, params.numel(), base=lambda: base))
        assert torch.equal(res.params, msg.params)
        assert (tmp_path / store.update_rows(3)[0]["path"]).stat().st_size == len(frame)
    finally:
        store.close()


def test_encode_refuses_what_the_codec_cannot_carry():
    base = torch.zeros(10)
    with pytest.raises(ValueError):
        C.encode(torch.full((10,), 1e6), base, "fp16-delta")
    with pytest.raises(ValueError):
        C.encode(torch.zeros(11), base, "int8-delta")
    with pytest.raises(M.ProtocolError):
        M.encode(_up(torch.zeros(10)), uplink_codec="int8-delta")  # no base


@pytest.mark.parametrize("codec", ["int8-delta", "fp16-delta"])
@pytest.mark.parametrize("d", [C.BLOCK * 300 + 17, 100])
def test_decode_into_a_reused_buffer_is_decode(codec, d):
    base, params = _vectors(d, seed=4)
    packed = C.encode(params, base, codec)
    buf = np.full(d, np.nan, dtype=np.float32)
    got = C.decode(packed, base, out=buf)
    assert torch.equal(got, C.decode(packed, base))
    assert np.shares_memory(got.numpy(), buf)  # decoded in place, nothing allocated
    with pytest.raises(ValueError, match="float32 buffer"):
        C.decode(packed, base, out=np.empty(d, dtype=np.float64))


def test_verify_refuses_what_verified_decode_refuses_without_building_the_vector():
    base, params = _vectors()
    packed = C.encode(params, base, "int8-delta")
    C.verify(packed, base)
    other = base.clone()
    other[0] += 1.0
    with pytest.raises(C.CodecError) as info:
        C.verify(packed, other)
    assert info.value.reason == "checksum"


def _body_and_prefix(frame: bytes) -> tuple[bytes, bytes, int]:
    body = frame[frames.PREFIX_LEN :]
    return body, frame[len(frames.MAGIC) : frames.PREFIX_LEN], 8 + struct.unpack("<Q", body[:8])[0]


def test_a_packed_update_prefix_hashes_its_header_and_a_plain_one_its_whole_body():
    base, params = _vectors()
    packed = M.encode(_up(params), uplink_codec="int8-delta", base=base)
    body, prefix, data_start = _body_and_prefix(packed)
    assert prefix == hashlib.sha256(body[:data_start]).digest()
    assert prefix != hashlib.sha256(body).digest()
    plain = M.encode(_up(params))
    body, prefix, _ = _body_and_prefix(plain)
    assert prefix == hashlib.sha256(body).digest()


def test_a_packed_update_with_a_byte_changed_in_transit_is_refused_before_use():
    base, params = _vectors()
    frame = bytearray(M.encode(_up(params), uplink_codec="int8-delta", base=base))
    frame[-1] ^= 1  # a byte of the packed tensors: the header, so the prefix, still match
    msg = M.decode(bytes(frame))
    with pytest.raises(M.MessageRejected) as info:
        M.check_uplink(msg, base)
    assert info.value.reason == "checksum"
    frame[-1] ^= 1
    body, _, data_start = _body_and_prefix(bytes(frame))
    frame[frames.PREFIX_LEN + data_start - 3] ^= 1  # inside the JSON header
    assert _reason(bytes(frame)) == "bad_hash"


def test_a_packed_update_with_another_tensor_is_hashed_whole():
    codec, t, base = _good()
    frame = bytearray(_packed_frame(codec, {**t, "x.extra": torch.ones(1000)}))
    body, prefix, _ = _body_and_prefix(bytes(frame))
    assert prefix == hashlib.sha256(body).digest()
    frame[-1] ^= 1  # a byte of a tensor outside the codec's checksum
    assert _reason(bytes(frame)) == "bad_hash"
