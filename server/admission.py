"""The server's admission rule: what becomes of one message on `up/<D>` or `hello/<D>`, as
pure functions.

Whether an uplink is accepted, refused (and why), acknowledged and counted is decided here
from the open round's state and the decoded message (or the reason it could not be
decoded); the server only carries the decision out (records, counts, logs, acks). No I/O,
so every rule of docs/PROTOCOL.md ("Server" rule 3) is tested row by row without a broker
(tests/test_admission.py).

Acks: a refusal is acknowledged (`Ack(accepted=false, reason)`) only when the topic names a
registered device and a round id is known; a `duplicate` gets `Ack(accepted=true,
"duplicate")` so that the device stops re-sending; both are rate-limited per device by the
server. Acks that record something (accepted, declined) are never withheld.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from wakefl.protocol.messages import Decline, Hello, MessageRejected, Uplink


@dataclass(frozen=True)
class OpenRound:
    """The round now taking updates: its id, the devices sampled for it, its deadline."""

    round_id: int
    sampled: frozenset[str]
    deadline: float

    @classmethod
    def of(cls, round_id: int, sampled: list[str] | set[str], deadline: float) -> OpenRound:
        return cls(int(round_id), frozenset(sampled), float(deadline))


class Outcome(enum.Enum):
    ACCEPT = "accept"  # record the update (durably), then ack it as accepted
    DECLINE = "decline"  # record the decline, then ack it as `declined`
    REFUSE = "refuse"  # count it as `reason`, log it, maybe ack the refusal
    IGNORE = "ignore"  # not counted (a refused retained Hello of an earlier run), maybe acked


class AckKind(enum.Enum):
    NONE = "none"  # nobody to answer (no registered device in the topic, no round id)
    ACCEPTED = "accepted"  # Ack(accepted=True, "") after the update is on record
    DECLINED = "declined"  # Ack(accepted=True, "declined") after the decline is on record
    REFUSED = "refused"  # Ack(accepted=False, reason), rate-limited per device
    DUPLICATE = "duplicate"  # Ack(accepted=True, "duplicate"), rate-limited per device
    # A refused Hello: Ack(accepted=False, "<reason>: <detail>", round 0, answers "hello"),
    # rate-limited per device: a device the server never samples would not learn why.
    HELLO_REFUSED = "hello_refused"


@dataclass(frozen=True)
class Decision:
    """What the server does with one message. `reason` is the reject code it is counted
    as (REJECT_REASONS; "" when nothing is refused), `ack_device`/`round_id` whom the ack
    goes to, for which round."""

    outcome: Outcome
    ack: AckKind
    reason: str = ""
    detail: str = ""
    device: str | None = None  # the device the message is counted against
    round_id: int | None = None
    ack_device: str | None = None


@dataclass(frozen=True)
class Arrival:
    """Where a message came from and what the server knows of its sender.

    `topic_device`: the device id of its topic (None: the topic names no valid one).
    `registry`: registered device ids and their types. `on_record`: the message's
    (round, device) already has an update on record (a re-send or QoS 1 redelivery)."""

    topic: str
    topic_device: str | None
    fleet: str
    run_id: str
    registry: Mapping[str, str]
    open_round: OpenRound | None
    on_record: bool = False

    @property
    def registered(self) -> str | None:
        dev = self.topic_device
        return dev if dev is not None and dev in self.registry else None

    @property
    def open_id(self) -> int | None:
        return self.open_round.round_id if self.open_round is not None else None


def refuse(
    reason: str, detail: str, device: str | None, round_id: int | None, ack_to: str | None
) -> Decision:
    """Refuse and count as `reason`; a `duplicate` is answered with a duplicate ack (the
    device stops re-sending), anything else with a refusal when `ack_to` and `round_id`
    are known."""
    if reason == "duplicate" and device is not None and round_id is not None:
        return Decision(Outcome.REFUSE, AckKind.DUPLICATE, reason, detail, device, round_id, device)
    ack = AckKind.REFUSED if ack_to is not None and round_id is not None else AckKind.NONE
    return Decision(
        Outcome.REFUSE,
        ack,
        reason,
        detail,
        device,
        round_id,
        ack_to if ack is AckKind.REFUSED else None,
    )


def admit_undecoded(arrival: Arrival, exc: MessageRejected) -> Decision:
    """A payload that did not decode (or was neither an uplink nor a decline): refused as
    its decoding's reason, acked to a registered topic device against the open round."""
    return refuse(exc.reason, exc.detail, arrival.topic_device, arrival.open_id, arrival.registered)


def admit(arrival: Arrival, msg: Uplink | Decline | MessageRejected) -> Decision:
    """The admission of one message on `up/<D>` (docs/PROTOCOL.md, Server rule 3)."""
    dev = arrival.topic_device
    if dev is None:
        detail = f"topic {arrival.topic[:200]!r} names no valid device id"
        return refuse("malformed", detail, None, arrival.open_id, None)
    if isinstance(msg, MessageRejected):
        return admit_undecoded(arrival, msg)
    rid = msg.round_id
    if msg.device_id != dev or msg.fleet != arrival.fleet:
        detail = f"message from {msg.device_id!r} of fleet {msg.fleet!r} on topic {arrival.topic!r}"
        return refuse("topic_mismatch", detail, dev, rid, arrival.registered)
    if arrival.registered is None:
        return refuse("unknown_device", f"{dev!r} is not in the registry", dev, rid, None)
    if isinstance(msg, Decline):
        return _admit_decline(arrival, msg)
    registered_type = arrival.registry[dev]
    if registered_type != msg.device_type:
        detail = f"{dev!r} is registered as {registered_type!r}, sent {msg.device_type!r}"
        return refuse("wrong_device_type", detail, dev, rid, dev)
    if msg.run_id == arrival.run_id and arrival.on_record:
        return refuse("duplicate", f"round {rid} already has an update from {dev}", dev, rid, dev)
    stale = _stale(arrival, msg.run_id, rid)
    if stale:
        return refuse(
            "stale_round", f"update for round {rid} (run {msg.run_id}); {stale}", dev, rid, dev
        )
    assert arrival.open_round is not None
    if dev not in arrival.open_round.sampled:
        return refuse("not_sampled", f"{dev} was not sampled for round {rid}", dev, rid, dev)
    return Decision(Outcome.ACCEPT, AckKind.ACCEPTED, device=dev, round_id=rid, ack_device=dev)


def _stale(arrival: Arrival, run_id: str, round_id: int) -> str:
    """Why (run_id, round_id) is not the open round ("" when it is)."""
    if arrival.open_round is None or run_id != arrival.run_id or round_id != arrival.open_id:
        return f"open round is {arrival.open_id}"
    return ""


def _admit_decline(arrival: Arrival, msg: Decline) -> Decision:
    dev, rid = msg.device_id, msg.round_id
    if _stale(arrival, msg.run_id, rid):
        return refuse("stale_round", f"decline for round {rid} (run {msg.run_id})", dev, rid, dev)
    assert arrival.open_round is not None
    if dev not in arrival.open_round.sampled:
        detail = f"{dev} declined round {rid} it was not sampled for"
        return refuse("not_sampled", detail, dev, rid, dev)
    if arrival.on_record:
        detail = f"{dev} declined round {rid} after its update was recorded"
        return refuse("duplicate", detail, dev, rid, dev)
    return Decision(Outcome.DECLINE, AckKind.DECLINED, device=dev, round_id=rid, ack_device=dev)


def admit_hello(
    topic_device: str, msg: Hello, fleet: str, registry: Mapping[str, str], static: bool
) -> Decision:
    """What becomes of a decoded Hello on `hello/<D>` (docs/PROTOCOL.md, Server rule 1).
    ACCEPT: the device goes online (registered first when the registry is open and it is
    new). Refused: a mismatched topic or fleet (no answer: the sender is not who the topic
    says), an unknown device of a static fleet or a registered device of another type
    (answered, `HELLO_REFUSED`). Counted against no round."""
    dev = topic_device
    if msg.device_id != dev or msg.fleet != fleet:
        return refuse("topic_mismatch", f"hello from {msg.device_id!r} on {dev!r}", dev, None, None)
    known = registry.get(dev)
    if known is None and static:
        return _hello_refused("unknown_device", f"{dev!r} is not in the fleet", dev)
    if known is not None and known != msg.device_type:
        detail = f"{dev!r} says type {msg.device_type!r}, registered as {known!r}"
        return _hello_refused("wrong_device_type", detail, dev)
    return Decision(Outcome.ACCEPT, AckKind.NONE, device=dev)


def _hello_refused(reason: str, detail: str, dev: str) -> Decision:
    return Decision(Outcome.REFUSE, AckKind.HELLO_REFUSED, reason, detail, dev, None, dev)


def after_admission(reason: str, detail: str, device: str, round_id: int) -> Decision:
    """An admitted update refused while it is being recorded: `checksum` (its packed
    form does not decode to the device's checksum), `non_finite`/`shape` likewise,
    `duplicate` (another copy was recorded first), `stale_round` (the round closed first).
    The device is registered, so it is answered."""
    return refuse(reason, detail, device, round_id, device)


def refused_at_screening(detail: str, device: str, round_id: int) -> Decision:
    """An update recorded and acknowledged, refused as `outlier` at aggregation: counted,
    never acked again (its ack only meant "recorded")."""
    return refuse("outlier", detail, device, round_id, None)


def internal_failure(arrival: Arrival, detail: str) -> Decision:
    """The server failed on the message (a bug): counted as `internal`, and the device
    still gets a refusal when the topic names a registered one."""
    return refuse("internal", detail, arrival.topic_device, arrival.open_id, arrival.registered)
