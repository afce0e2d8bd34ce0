"""Wire messages: round trips and every hostile payload refused with its reason."""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle

import pytest
import torch
from safetensors.torch import save as st_save

from wakefl.errors import ProtocolError
from wakefl.protocol import frames, topics
from wakefl.protocol import messages as M
from wakefl.protocol.round_settings import RoundSettings
from wakefl.sdk.selffl import SelfFL


def _uplink(d: int = 1000, **kw) -> M.Uplink:
    g = torch.Generator().manual_seed(0)
    base = dict(
        fleet="f1",
        run_id="run1",
        device_id="dev-a",
        device_type="speaker",
        round_id=3,
        params=torch.randn(d, generator=g),
        num_samples=120,
        record={"sigma_sq": 0.25, "local_steps": 17.0, "has_variance": 1.0},
        relative_fa=0.9,
        relative_fr=None,
        tensors={"personal": torch.randn(d, generator=g)},
    )
    base.update(kw)
    return M.Uplink(**base)


def _frame_from_body(body: bytes) -> bytes:
    return frames.seal(body)


def _body(meta: dict, tensors: dict) -> bytes:
    return st_save(tensors, metadata={"wakefl": json.dumps(meta)})


def _reason(data: bytes, **kw) -> str:
    with pytest.raises(M.MessageRejected) as info:
        M.decode(data, **kw)
    assert isinstance(info.value, ProtocolError)
    return info.value.reason


def test_uplink_round_trip_fp32_is_exact():
    up = _uplink()
    back = M.decode(M.encode(up), expected_numel=1000)
    assert isinstance(back, M.Uplink)
    assert torch.equal(back.params, up.params)
    assert torch.equal(back.tensors["personal"], up.tensors["personal"])
    assert (back.device_id, back.round_id, back.record["sigma_sq"], back.record["local_steps"]) == (
        "dev-a",
        3,
        0.25,
        17,
    )
    assert back.relative_fa == 0.9 and back.relative_fr is None
    assert back.record == {"sigma_sq": 0.25, "local_steps": 17.0, "has_variance": 1.0}
    # checked against the strategy's schema too
    assert M.decode(M.encode(up), uplink_schema=SelfFL.uplink_schema).record == back.record


def test_round_trip_fp16_halves_size_and_rounds_to_half_precision():
    up = _uplink(d=20000)
    b32, b16 = M.encode(up), M.encode(up, wire_dtype="fp16")
    assert len(b16) < 0.55 * len(b32)
    assert M.payload_dtype(b16) == "fp16"
    back = M.decode(b16)
    assert back.params.dtype == torch.float32
    assert torch.equal(back.params, up.params.half().float())


def test_header_length_with_pickle_like_first_byte_is_accepted():
    # safetensors bodies begin with their header length; 0x80 there is not a pickle opcode
    for pad in range(0, 300, 7):
        up = _uplink(d=10, record={"pad": float(pad), **{f"k{i}": 1.0 for i in range(pad // 10)}})
        data = M.encode(up)
        assert M.decode(data).device_id == "dev-a"


def test_downlink_and_ack_and_hello_round_trip():
    down = M.Downlink(
        fleet="f1",
        run_id="run1",
        round_id=2,
        global_params=torch.arange(10.0),
        model_config={"width": 0.25},
        instructions={"dev-a": {"others_precision": 3.5, "sigma0_sq": 0.5}},
        settings=RoundSettings(
            strategy_args={"lr": 0.01}, ack_timeout_s=2.5, uplink_codec="int8-delta"
        ),
        deadline=1.7e9,
        final=False,
    )
    back = M.decode(M.encode(down), expected_numel=10)
    assert back.instructions == down.instructions and back.model_config == {"width": 0.25}
    checked = M.decode(M.encode(down), downlink_schema=SelfFL.downlink_schema)
    assert checked.instructions == down.instructions
    assert torch.equal(back.global_params, down.global_params)
    assert back.settings == down.settings and back.settings.ack_timeout_s == 2.5
    ack = M.decode(M.encode(M.Ack("f1", "dev-a", 2, False, "stale_round")))
    assert ack == M.Ack("f1", "dev-a", 2, False, "stale_round")
    hello = M.decode(M.encode(M.Hello("f1", "dev-a", "speaker", 50, online=False)))
    assert hello == M.Hello("f1", "dev-a", "speaker", 50, online=False)


def test_garbage_bytes_rejected_as_malformed():
    assert _reason(b"\x00\x01garbage" * 10) == "malformed"
    assert _reason(b"") == "malformed"
    # A correct hash over a body that is not safetensors.
    assert _reason(_frame_from_body(b"not a safetensors body at all")) == "malformed"


def test_corrupted_payload_rejected_by_hash():
    data = bytearray(M.encode(_uplink()))
    data[-5] ^= 0xFF
    assert _reason(bytes(data)) == "bad_hash"


def test_oversized_rejected_on_receipt_and_before_publish():
    data = M.encode(_uplink(d=5000))
    assert _reason(data, max_bytes=len(data) - 1) == "oversized"
    with pytest.raises(M.MessageRejected) as info:
        M.encode(_uplink(d=5000), max_bytes=1000)
    assert info.value.reason == "oversized"


def test_wrong_protocol_version_rejected():
    assert _reason(M.encode(_uplink(version=M.PROTOCOL_VERSION + 1))) == "version"


def test_wrong_shape_and_dtype_rejected():
    assert _reason(M.encode(_uplink(d=999)), expected_numel=1000) == "shape"
    meta = json.loads(
        json.dumps(
            {
                "v": M.PROTOCOL_VERSION,
                "kind": "up",
                "fleet": "f1",
                "run_id": "r",
                "device_id": "a",
                "device_type": "t",
                "round_id": 1,
                "num_samples": 1,
                "record": {"sigma_sq": 0.1},
            }
        )
    )
    two_d = _frame_from_body(_body(meta, {"params": torch.zeros(10, 100)}))
    assert _reason(two_d) == "shape"
    ints = _frame_from_body(_body(meta, {"params": torch.zeros(1000, dtype=torch.int32)}))
    assert _reason(ints) == "dtype"
    doubles = _frame_from_body(_body(meta, {"params": torch.zeros(1000, dtype=torch.float64)}))
    assert _reason(doubles) == "dtype"


def test_non_finite_tensor_and_scalar_rejected():
    meta = {
        "v": M.PROTOCOL_VERSION,
        "kind": "up",
        "fleet": "f1",
        "run_id": "r",
        "device_id": "a",
        "device_type": "t",
        "round_id": 1,
        "num_samples": 1,
        "record": {"sigma_sq": 0.1, "local_steps": 1},
    }
    bad = torch.zeros(100)
    bad[7] = float("nan")
    assert _reason(_frame_from_body(_body(meta, {"params": bad}))) == "non_finite"
    bad[7] = float("inf")
    assert _reason(_frame_from_body(_body(meta, {"params": bad}))) == "non_finite"
    # JSON's non-standard Infinity token in a scalar
    body = st_save(
        {"params": torch.zeros(100)},
        metadata={"wakefl": json.dumps({**meta, "record": {"sigma_sq": float("inf")}})},
    )
    assert _reason(_frame_from_body(body)) == "non_finite"
    # and the sender refuses to emit them, fp16 overflow included
    with pytest.raises(ProtocolError):
        M.encode(_uplink(params=torch.full((1000,), 1e6)), wire_dtype="fp16")


def test_pickle_and_torch_save_content_rejected_without_loading():
    evil = pickle.dumps({"params": [1.0, 2.0]})
    assert _reason(evil) == "pickle"
    assert _reason(_frame_from_body(evil)) == "pickle"
    import io

    buf = io.BytesIO()
    torch.save({"params": torch.zeros(3)}, buf)
    assert _reason(buf.getvalue()) == "pickle"


def test_missing_field_and_wrong_kind():
    meta = {"v": M.PROTOCOL_VERSION, "kind": "up", "fleet": "f1", "run_id": "r", "device_id": "a"}
    assert _reason(_frame_from_body(_body(meta, {"params": torch.zeros(4)}))) == "malformed"
    ack = M.encode(M.Ack("f1", "a", 1, True))
    with pytest.raises(M.MessageRejected) as info:
        M.decode_as(ack, M.Uplink)
    assert info.value.reason == "wrong_kind"
    bad_id = _uplink(device_id="a/b")
    assert _reason(M.encode(bad_id)) == "malformed"


def test_lying_safetensors_header_rejected():
    good = M.encode(_uplink(d=100))
    body = bytearray(good[36:])
    hlen = int.from_bytes(body[:8], "little")
    header = json.loads(body[8 : 8 + hlen])
    header["params"]["shape"] = [10**9]  # claims far more data than present
    raw = json.dumps(header).encode()
    new_body = len(raw).to_bytes(8, "little") + raw + bytes(body[8 + hlen :])
    assert _reason(_frame_from_body(new_body)) == "malformed"


def test_topics_layout_and_names():
    assert topics.uplink("f1", "dev-a") == "wakefl/f1/up/dev-a"
    assert topics.ack("f1", "dev-a") == "wakefl/f1/ack/dev-a"
    assert topics.downlink("f1") == "wakefl/f1/down"
    assert topics.parse("wakefl/f1/up/dev-a") == ("f1", "up", "dev-a")
    for bad in ("a/b", "+", "#", "", "a b"):
        with pytest.raises(ProtocolError):
            topics.uplink("f1", bad)


def _record(**entries) -> dict:
    return {"sigma_sq": 0.1, "has_variance": 1, "local_steps": 1, **entries}


def _raw_uplink_meta(**fields) -> bytes:
    """A frame whose JSON fields are written by hand (values json.dumps would emit)."""
    meta = {
        "v": M.PROTOCOL_VERSION,
        "kind": "up",
        "fleet": "f1",
        "run_id": "r",
        "device_id": "a",
        "device_type": "t",
        "round_id": 1,
        "num_samples": 1,
        "record": _record(),
    }
    meta.update(fields)
    return _frame_from_body(_body(meta, {"params": torch.zeros(8)}))


def _raw_meta_text(text: str) -> bytes:
    """A frame whose wakefl metadata is the JSON text given, byte for byte."""
    return _frame_from_body(st_save({"params": torch.zeros(8)}, metadata={"wakefl": text}))


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_samples", 2**63),
        ("num_samples", 10**9 + 1),
        ("num_samples", -1),
        ("record", _record(local_steps=2**64)),
        ("round_id", 2**31),
        ("round_id", 0),
        ("record", _record(sigma_sq=1e31)),
        ("record", _record(sigma_sq=-0.5)),
        ("record", _record(sigma_sq=10**400)),
        ("record", _record(local_steps=10**7 + 1)),
        ("record", _record(has_variance=2)),
        ("relative_fa", 1e7),
        ("relative_fr", -1.0),
        ("record", {"x": 1e300}),
        ("record", {f"k{i}": 0.0 for i in range(300)}),
    ],
)
def test_absurd_scalar_fields_are_out_of_range(field, value):
    # every record entry is bounded whatever the strategy; its schema bounds it further
    assert (
        _reason(_raw_uplink_meta(**{field: value}), uplink_schema=SelfFL.uplink_schema)
        == "out_of_range"
    )


def test_records_hold_only_what_the_strategy_declares():
    schema = SelfFL.uplink_schema
    assert _reason(_raw_uplink_meta(record=_record(nonce=1.0)), uplink_schema=schema) == "malformed"
    assert _reason(_raw_uplink_meta(record={"sigma_sq": 0.1}), uplink_schema=schema) == "malformed"
    assert (
        _reason(_raw_uplink_meta(record=_record(local_steps=1.5)), uplink_schema=schema)
        == "malformed"
    )
    assert (
        _reason(_raw_uplink_meta(record=_record(sigma_sq="0.1")), uplink_schema=schema)
        == "malformed"
    )
    assert _reason(_raw_uplink_meta(record=[0.1]), uplink_schema=schema) == "malformed"
    assert M.decode(_raw_uplink_meta(record=_record(nonce=1.0))).record["nonce"] == 1.0  # no schema
    down = M.Downlink(
        fleet="f1",
        run_id="run1",
        round_id=2,
        global_params=torch.zeros(4),
        model_config={},
        instructions={"dev-a": {"sigma0_sq": -1.0, "others_precision": 0.0}},
        settings=RoundSettings(),
        deadline=1.7e9,
    )
    assert _reason(M.encode(down), downlink_schema=SelfFL.downlink_schema) == "out_of_range"


def test_in_range_extremes_are_accepted():
    up = M.decode(
        _raw_uplink_meta(
            num_samples=M.MAX_NUM_SAMPLES,
            record=_record(local_steps=M.MAX_LOCAL_STEPS, sigma_sq=0.0),
            round_id=M.MAX_ROUND_ID,
            relative_fa=0.0,
        ),
        uplink_schema=SelfFL.uplink_schema,
    )
    assert (up.num_samples, up.record["local_steps"], up.round_id) == (10**9, 10**7, 2**31 - 1)


def test_crafted_json_is_refused_not_raised():
    base = (
        f'{{"v":{M.PROTOCOL_VERSION},"kind":"up","fleet":"f1","run_id":"r","device_id":"a",'
        '"device_type":"t","round_id":1,"record":{"sigma_sq":0.1,"local_steps":1},'
    )
    cases = {
        "nested": base + '"num_samples":1,"record":' + "[" * 100000 + "]" * 100000 + "}",
        "digits": base + '"num_samples":' + "9" * 5000 + "}",
        "float_overflow": base + '"num_samples":1,"relative_fa":1e309}',
        "int_over_float": base + '"num_samples":1,"relative_fa":' + "1" + "0" * 309 + "}",
    }
    for name, text in cases.items():
        reason = _reason(_raw_meta_text(text))
        assert reason in ("malformed", "out_of_range", "non_finite"), (name, reason)
    # a safetensors header (outside the wakefl metadata) nested deeply
    raw = b"[" * 50000 + b"]" * 50000
    assert _reason(_frame_from_body(len(raw).to_bytes(8, "little") + raw)) == "malformed"
    # every byte string decodes or is refused with a reason, never another exception
    g = torch.Generator().manual_seed(1)
    good = M.encode(_uplink(d=16))
    for _ in range(300):
        b = bytearray(good)
        i = int(torch.randint(36, len(b), (1,), generator=g))
        b[i] = int(torch.randint(0, 256, (1,), generator=g))
        body = bytes(b[36:])
        with contextlib.suppress(M.MessageRejected):  # anything else fails the test
            M.decode(_frame_from_body(body))


def test_ack_names_the_message_it_answers_and_decline_round_trips():
    payload = M.encode(_uplink(d=16))
    mid = M.message_id(payload)
    assert len(mid) == M.MESSAGE_ID_LEN and mid == M.message_id(bytes(payload))
    ack = M.decode(M.encode(M.Ack("f1", "dev-a", 3, False, "stale_round", answers=mid)))
    assert ack.answers == mid and ack.reason == "stale_round"
    assert M.message_id(b"garbage") != mid
    # a frame is named by the body hash its prefix carries, garbage by its own sha256
    assert mid == hashlib.sha256(payload[len(M.MAGIC) + 32 :]).hexdigest()[:32]
    assert M.message_id(b"garbage") == hashlib.sha256(b"garbage").hexdigest()[:32]
    dec = M.decode(M.encode(M.Decline("f1", "run1", "dev-a", 3, "training diverged")))
    assert isinstance(dec, M.Decline) and (dec.round_id, dec.reason) == (3, "training diverged")
    long_reason = M.decode(M.encode(M.Decline("f1", "run1", "dev-a", 3, "x" * 1000)))
    assert len(long_reason.reason) == M.MAX_REASON_LEN


def _downlink_with_settings(settings: object, version: int = M.PROTOCOL_VERSION) -> bytes:
    """A downlink frame whose `settings` field is exactly `settings` (bypassing the
    sender's own checks, as a hostile or broken server could)."""
    good = M.Downlink("f1", "run1", 2, torch.zeros(4), {}, {}, RoundSettings(), 1.7e9)
    frame = M.encode(good)
    body = frame[len(M.MAGIC) + 32 :]
    hlen = int.from_bytes(body[:8], "little")
    header = json.loads(body[8 : 8 + hlen])
    meta = json.loads(header["__metadata__"]["wakefl"])
    meta["settings"], meta["v"] = settings, version
    header["__metadata__"]["wakefl"] = json.dumps(meta)
    new_header = json.dumps(header).encode()
    new_header += b" " * (-len(new_header) % 8)
    new_body = len(new_header).to_bytes(8, "little") + new_header + body[8 + hlen :]
    return _frame_from_body(new_body)


_GOOD_SETTINGS = RoundSettings(strategy_args={"lr": 0.01}).to_wire()


@pytest.mark.parametrize(
    ("change", "reason", "says"),
    [
        ({"ack_timeout_s": float("nan")}, "out_of_range", "ack_timeout_s nan"),
        ({"ack_timeout_s": "soon"}, "malformed", "ack_timeout_s must be a number"),
        ({"ack_timeout_s": -5}, "out_of_range", "ack_timeout_s -5.0"),
        ({"ack_timeout_s": 0}, "out_of_range", "ack_timeout_s 0.0"),
        ({"ack_timeout_s": 1e9}, "out_of_range", "ack_timeout_s"),
        ({"ack_timeout_s": True}, "malformed", "ack_timeout_s must be a number"),
        ({"ack_timeout_s": None}, "malformed", "got null"),
        ({"wire_dtype": "bf16"}, "out_of_range", "wire_dtype"),
        ({"wire_dtype": 16}, "malformed", "wire_dtype must be a string"),
        ({"uplink_codec": "zip"}, "out_of_range", "uplink_codec"),
        ({"rounds": -1}, "out_of_range", "rounds"),
        ({"rounds": 2.5}, "malformed", "rounds must be an integer"),
        ({"strategy": ""}, "out_of_range", "strategy"),
        ({"strategy_args": [1]}, "malformed", "strategy_args must be an object"),
        ({"surprise": 1}, "malformed", "unknown fields"),
        ({"ack_timeout_s": ...}, "malformed", "lack ack_timeout_s"),
        ({"strategy": ..., "rounds": ...}, "malformed", "lack strategy, rounds"),
    ],
)
def test_round_settings_are_refused_with_the_field_and_the_reason(change, reason, says):
    settings = {k: v for k, v in {**_GOOD_SETTINGS, **change}.items() if v is not ...}
    frame = _downlink_with_settings(settings)
    with pytest.raises(M.MessageRejected) as info:
        M.decode(frame)
    assert info.value.reason == reason and says in info.value.detail, info.value.detail


def test_round_settings_that_are_not_an_object_are_refused():
    for bad in (None, [], "fast", 3):
        with pytest.raises(M.MessageRejected, match="settings must be an object"):
            M.decode(_downlink_with_settings(bad))


def test_good_round_settings_decode_to_the_typed_record():
    back = M.decode(_downlink_with_settings(_GOOD_SETTINGS))
    assert isinstance(back, M.Downlink)
    assert back.settings == RoundSettings(strategy_args={"lr": 0.01})


def test_a_peer_of_the_previous_protocol_version_is_refused_clearly():
    frame = _downlink_with_settings(_GOOD_SETTINGS, version=M.PROTOCOL_VERSION - 1)
    with pytest.raises(M.MessageRejected) as info:
        M.decode(frame)
    assert info.value.reason == "version"
    assert f"this build speaks {M.PROTOCOL_VERSION}" in info.value.detail
    assert "update it" in info.value.detail


def test_a_sender_cannot_build_settings_that_a_receiver_would_refuse():
    from wakefl.protocol.round_settings import SettingsError

    with pytest.raises(SettingsError, match="ack_timeout_s"):
        RoundSettings(ack_timeout_s=float("nan"))
    with pytest.raises(SettingsError, match="uplink_codec"):
        RoundSettings(uplink_codec="gzip")
