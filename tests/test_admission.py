"""The server's admission rule (server/admission.py), row by row without a broker: each
row is the open round, where a message came from, the message (or why it did not decode)
and what the server must do with it."""

from __future__ import annotations

import pytest
import torch

from wakefl.protocol import messages as M
from wakefl.protocol.messages import REJECT_REASONS, MessageRejected
from wakefl.server.admission import (
    AckKind,
    Arrival,
    OpenRound,
    Outcome,
    admit,
    admit_hello,
    after_admission,
    internal_failure,
    refused_at_screening,
)

FLEET, RUN = "f", "run1"
REGISTRY = {"a": "speaker", "b": "tv", "c": "speaker"}
OPEN = OpenRound.of(3, ["a", "b"], 1e9)  # round 3, a and b sampled; c registered, not sampled


def _arrival(dev: str | None = "a", open_round: OpenRound | None = OPEN, on_record: bool = False):
    topic = f"wakefl/{FLEET}/up/{dev}" if dev is not None else f"wakefl/{FLEET}/up/"
    return Arrival(topic, dev, FLEET, RUN, REGISTRY, open_round, on_record)


def _up(
    dev: str = "a", *, typ: str | None = None, round_id: int = 3, run_id: str = RUN, fleet=FLEET
):
    typ = typ or REGISTRY.get(dev, "speaker")
    return M.Uplink(fleet, run_id, dev, typ, round_id, torch.zeros(4), 1, {})


def _decline(dev: str = "a", round_id: int = 3, run_id: str = RUN) -> M.Decline:
    return M.Decline(FLEET, run_id, dev, round_id, "no data")


# (name, arrival, message, outcome, counted as, ack kind, acked device, round id in the ack)
ROWS = [
    ("accepted", _arrival(), _up(), Outcome.ACCEPT, "", AckKind.ACCEPTED, "a", 3),
    ("decline recorded", _arrival(), _decline(), Outcome.DECLINE, "", AckKind.DECLINED, "a", 3),
    # the topic names no device id: counted, nobody to answer
    ("no device id", _arrival(None), _up(), Outcome.REFUSE, "malformed", AckKind.NONE, None, 3),
    (
        "topic of another device",
        _arrival("b"),
        _up("a"),
        Outcome.REFUSE,
        "topic_mismatch",
        AckKind.REFUSED,
        "b",
        3,
    ),
    (
        "other fleet",
        _arrival(),
        _up(fleet="g"),
        Outcome.REFUSE,
        "topic_mismatch",
        AckKind.REFUSED,
        "a",
        3,
    ),
    (
        "mismatch from an unregistered topic device",
        _arrival("zz"),
        _up("a"),
        Outcome.REFUSE,
        "topic_mismatch",
        AckKind.NONE,
        None,
        3,
    ),
    (
        "unregistered",
        _arrival("zz"),
        _up("zz"),
        Outcome.REFUSE,
        "unknown_device",
        AckKind.NONE,
        None,
        3,
    ),
    (
        "unregistered decline",
        _arrival("zz"),
        _decline("zz"),
        Outcome.REFUSE,
        "unknown_device",
        AckKind.NONE,
        None,
        3,
    ),
    (
        "wrong type",
        _arrival(),
        _up(typ="tv"),
        Outcome.REFUSE,
        "wrong_device_type",
        AckKind.REFUSED,
        "a",
        3,
    ),
    (
        "already on record",
        _arrival(on_record=True),
        _up(),
        Outcome.REFUSE,
        "duplicate",
        AckKind.DUPLICATE,
        "a",
        3,
    ),
    (
        "decline after the update",
        _arrival(on_record=True),
        _decline(),
        Outcome.REFUSE,
        "duplicate",
        AckKind.DUPLICATE,
        "a",
        3,
    ),
    # on record in this round of ANOTHER run: stale, not a duplicate
    (
        "old run on record",
        _arrival(on_record=True),
        _up(run_id="old"),
        Outcome.REFUSE,
        "stale_round",
        AckKind.REFUSED,
        "a",
        3,
    ),
    (
        "late round",
        _arrival(),
        _up(round_id=2),
        Outcome.REFUSE,
        "stale_round",
        AckKind.REFUSED,
        "a",
        2,
    ),
    (
        "no round open",
        _arrival(open_round=None),
        _up(),
        Outcome.REFUSE,
        "stale_round",
        AckKind.REFUSED,
        "a",
        3,
    ),
    (
        "late decline",
        _arrival(),
        _decline(round_id=2),
        Outcome.REFUSE,
        "stale_round",
        AckKind.REFUSED,
        "a",
        2,
    ),
    (
        "not sampled",
        _arrival("c"),
        _up("c"),
        Outcome.REFUSE,
        "not_sampled",
        AckKind.REFUSED,
        "c",
        3,
    ),
    (
        "decline, not sampled",
        _arrival("c"),
        _decline("c"),
        Outcome.REFUSE,
        "not_sampled",
        AckKind.REFUSED,
        "c",
        3,
    ),
]

# Refused while decoding: counted as the decoder's reason, answered to a registered topic
# device against the open round, to nobody otherwise.
DECODE_REASONS = [
    "malformed",
    "bad_hash",
    "oversized",
    "version",
    "pickle",
    "dtype",
    "shape",
    "non_finite",
    "wrong_kind",
    "out_of_range",
]
for _reason in DECODE_REASONS:
    _exc = MessageRejected(_reason, "x")
    ROWS.append(
        (f"{_reason} at decode", _arrival(), _exc, Outcome.REFUSE, _reason, AckKind.REFUSED, "a", 3)
    )
    ROWS.append(
        (
            f"{_reason}, unregistered",
            _arrival("zz"),
            _exc,
            Outcome.REFUSE,
            _reason,
            AckKind.NONE,
            None,
            3,
        )
    )
ROWS.append(
    (
        "undecodable, no round open",
        _arrival(open_round=None),
        MessageRejected("malformed", "x"),
        Outcome.REFUSE,
        "malformed",
        AckKind.NONE,
        None,
        None,
    )
)


@pytest.mark.parametrize(
    ("arrival", "msg", "outcome", "reason", "ack", "ack_device", "round_id"),
    [r[1:] for r in ROWS],
    ids=[r[0] for r in ROWS],
)
def test_admission_row(arrival, msg, outcome, reason, ack, ack_device, round_id):
    d = admit(arrival, msg)
    assert (d.outcome, d.reason, d.ack, d.ack_device, d.round_id) == (
        outcome,
        reason,
        ack,
        ack_device,
        round_id,
    )
    assert (d.reason in REJECT_REASONS) == (outcome is Outcome.REFUSE)
    if outcome is Outcome.REFUSE:
        assert d.detail  # every refusal says why in the log


@pytest.mark.parametrize(
    ("reason", "ack"),
    [
        ("checksum", AckKind.REFUSED),
        ("non_finite", AckKind.REFUSED),
        ("stale_round", AckKind.REFUSED),  # the round closed before the record
        ("duplicate", AckKind.DUPLICATE),  # another copy was recorded first
    ],
)
def test_refusals_while_recording_an_admitted_update_are_answered(reason, ack):
    d = after_admission(reason, "why", "a", 3)
    assert (d.outcome, d.reason, d.ack, d.ack_device, d.round_id) == (
        Outcome.REFUSE,
        reason,
        ack,
        "a",
        3,
    )


def test_an_outlier_is_counted_but_never_acked_again():
    d = refused_at_screening("1e9 from the model", "a", 3)
    assert (d.outcome, d.reason, d.ack, d.ack_device) == (
        Outcome.REFUSE,
        "outlier",
        AckKind.NONE,
        None,
    )


def test_an_internal_failure_is_answered_only_to_a_registered_device():
    assert internal_failure(_arrival(), "bug").ack is AckKind.REFUSED
    assert internal_failure(_arrival("zz"), "bug").ack is AckKind.NONE
    assert internal_failure(_arrival(None), "bug").reason == "internal"


def test_every_reject_reason_of_the_protocol_has_a_row():
    covered = {r[4] for r in ROWS} | {"checksum", "outlier", "internal"}
    assert covered - {""} == set(REJECT_REASONS)


def test_the_open_round_is_a_frozen_record():
    r = OpenRound.of(3, ["b", "a", "a"], 10)
    assert r.sampled == frozenset({"a", "b"}) and r.round_id == 3 and r.deadline == 10.0
    with pytest.raises(AttributeError):
        r.round_id = 4  # type: ignore[misc]


def _hello(dev: str = "a", typ: str = "speaker", fleet: str = FLEET) -> M.Hello:
    return M.Hello(fleet, dev, typ, 10, True)


# (topic device, hello, static registry) -> outcome, reason, ack
HELLO_ROWS = [
    ("a", _hello(), True, Outcome.ACCEPT, "", AckKind.NONE),
    ("new", _hello("new"), False, Outcome.ACCEPT, "", AckKind.NONE),  # open registry: joins
    ("new", _hello("new"), True, Outcome.REFUSE, "unknown_device", AckKind.HELLO_REFUSED),
    ("a", _hello(typ="tv"), True, Outcome.REFUSE, "wrong_device_type", AckKind.HELLO_REFUSED),
    ("a", _hello(typ="tv"), False, Outcome.REFUSE, "wrong_device_type", AckKind.HELLO_REFUSED),
    ("a", _hello("b"), True, Outcome.REFUSE, "topic_mismatch", AckKind.NONE),  # not who it says
    ("a", _hello(fleet="other"), True, Outcome.REFUSE, "topic_mismatch", AckKind.NONE),
]


@pytest.mark.parametrize(("dev", "hello", "static", "outcome", "reason", "ack"), HELLO_ROWS)
def test_hello_row(dev, hello, static, outcome, reason, ack):
    d = admit_hello(dev, hello, FLEET, REGISTRY, static)
    assert (d.outcome, d.reason, d.ack) == (outcome, reason, ack)
    assert d.round_id is None  # a Hello is counted against no round
    assert d.ack_device == (dev if ack is AckKind.HELLO_REFUSED else None)
