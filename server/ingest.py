"""Ingest: what the server does with each message devices send (uplinks, declines,
hellos) and with the broker's count of dropped messages.

It runs on paho's network thread. Each uplink is decoded outside the lock, admitted by
the pure rule of server/admission.py against the open round, and the decision carried
out here: an accepted update is checked against its checksum when packed, recorded
durably (packed) by the role's `Recorder`, acknowledged, and folded into the open round's
receipts; a refusal is counted, logged and acked at a bounded rate per device id
(docs/PROTOCOL.md, Server rule 3). Hellos likewise, by `admission.admit_hello`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from torch import Tensor

from wakefl.errors import ProtocolError
from wakefl.protocol import topics
from wakefl.protocol.messages import (
    Ack,
    Decline,
    Hello,
    MessageRejected,
    Uplink,
    check_uplink,
    decode,
    decode_as,
    encode,
)
from wakefl.sdk.selffl.strategy import Strategy
from wakefl.sdk.served_model_gate import with_gate_schema
from wakefl.server.admission import (
    AckKind,
    Arrival,
    Decision,
    Outcome,
    admit,
    admit_hello,
    after_admission,
    internal_failure,
)
from wakefl.server.server_session import ServerSession
from wakefl.server.throttle import LazyId, Throttle

log = logging.getLogger("wakefl.server")

# Refusal acks to one device id: a burst, then a steady rate (token bucket). A device that
# floods its topic gets no more acks than that (each refusal is still counted and logged);
# an honest device's re-send after ack_timeout_s finds the bucket refilled.
REFUSAL_ACK_BURST = 10
REFUSAL_ACKS_PER_S = 2.0
# Warning lines for refusals per device id, likewise; the rest are summarised.
REFUSAL_LOG_BURST = 20
REFUSAL_LOGS_PER_S = 1.0

# Records an accepted, checked update durably, then calls its third argument with "" once
# on record, else with the reason it was not ("duplicate": another copy came first;
# "stale_round": the round closed meanwhile). It may do so later, on another thread
# (server/update_batches.py): the update's ack and PUBACK wait for it.
Recorder = Callable[[Uplink, bytes, Callable[[str], None]], None]


def topic_device(topic: str) -> str | None:
    """The valid device id the topic names, None when it names none."""
    try:
        _, _, dev = topics.parse(topic)
        return topics.check_name(dev or "", "device id")
    except ProtocolError:
        return None


class Ingest:
    """Receives, admits, records and acknowledges. `base()` is the open round's global
    model as the devices decoded it; `refresh()`, when given, loads the open round before
    each uplink (a worker learns it from the shared store, not from its own rounds)."""

    def __init__(
        self,
        session: ServerSession,
        strategy: Strategy,
        recorder: Recorder,
        base: Callable[[], Tensor] | None = None,
        refresh: Callable[[], None] | None = None,
        fold: Callable[[Callable[[], object]], None] | None = None,
    ) -> None:
        self.s = session
        self.strategy = strategy
        # The strategy's record plus the served-model gate's optional scalars, which a
        # device adds to its uplink (docs/SELF_FL.md, "The served-model gate").
        self._uplink_schema = with_gate_schema(strategy.uplink_schema)
        self._record = recorder
        self._base = base or session.round_base
        self._refresh = refresh
        # Runs the folding of an accepted update into the receipts (by default here, on the
        # recorder's thread; server/receipt_worker.py runs it on a thread of its own).
        self._fold = fold or (lambda job: job())
        self.rejections: Counter[str] = Counter(session.store.rejection_counts())
        self.acks_withheld = 0  # refusal acks not sent to a flooding device id
        self.broker_dropped = 0  # mosquitto's $SYS count of dropped messages
        self._stale_hellos_logged: set[str] = set()  # device ids of refused retained hellos
        self._ack_throttle = Throttle(REFUSAL_ACK_BURST, REFUSAL_ACKS_PER_S)
        self._log_throttle = Throttle(REFUSAL_LOG_BURST, REFUSAL_LOGS_PER_S)

    # ------------------------------------------------------------------ carrying out
    def count(self, reason: str, detail: str, device: str | None, round_id: int | None) -> None:
        """Count and log one refusal. Never waits for the disk (the store commits counts
        in batches) and logs a flood of one device id only at a bounded rate."""
        self.rejections[reason] += 1
        try:
            self.s.store.count_rejection(reason, device, round_id, detail)
        except Exception:  # noqa: BLE001 - the in-memory count and the log line still stand
            log.exception("rejection of a message from %s not counted in the state store", device)
        logged, unlogged = self._log_throttle.allow(device or "<no device id>")
        if logged:
            more = f" ({unlogged} earlier refusal(s) of this device counted, not logged one by one)"
            log.warning(
                "rejected message from %s (round %s): %s: %s%s",
                device,
                round_id,
                reason,
                detail,
                more if unlogged else "",
            )

    def carry_out(self, decision: Decision, answers: str | LazyId = "") -> None:
        """Count, log and answer a refusal as `decision` says."""
        if decision.outcome is Outcome.REFUSE:
            self.count(decision.reason, decision.detail, decision.device, decision.round_id)
        if decision.ack is AckKind.HELLO_REFUSED and decision.ack_device is not None:
            dev = decision.ack_device
            if self._ack_throttle.allow(dev)[0]:
                why = f"{decision.reason}: {decision.detail}"[:200]
                self.send_ack(dev, 0, False, why, "hello")
            return
        if decision.ack_device is None or decision.round_id is None:
            return
        dev, rid = decision.ack_device, decision.round_id
        if decision.ack in (AckKind.REFUSED, AckKind.DUPLICATE):
            if self._ack_throttle.allow(dev)[0]:
                dup = decision.ack is AckKind.DUPLICATE
                self.send_ack(dev, rid, dup, decision.reason, answers)
            else:
                self.acks_withheld += 1
        elif decision.ack is AckKind.ACCEPTED:
            self.send_ack(dev, rid, True, "", answers)
        elif decision.ack is AckKind.DECLINED:
            self.send_ack(dev, rid, True, "declined", answers)

    def send_ack(
        self, device: str, round_id: int, accepted: bool, reason: str, answers: str | LazyId = ""
    ) -> None:
        payload = encode(
            Ack(self.s.cfg.fleet, device, round_id, accepted, reason, answers=str(answers))
        )
        self.s.publish(topics.ack(self.s.cfg.fleet, device), payload, f"ack to {device}")

    def report_throttled(self) -> None:
        unlogged = self._log_throttle.take_suppressed()
        unacked = self._ack_throttle.take_suppressed()
        if unlogged or unacked:
            log.warning(
                "refusals counted but not logged one by one: %s; refusal acks withheld "
                "from flooding device ids: %s",
                unlogged or "none",
                unacked or "none",
            )

    # ------------------------------------------------------------------ uplinks
    def _arrival(self, topic: str, dev: str | None, on_record: bool = False) -> Arrival:
        s = self.s
        return Arrival(
            topic, dev, s.cfg.fleet, s.run_id, s.registry(), s.open_round, on_record=on_record
        )

    def _guarded(
        self, what: str, handle: Callable[[str, bytes], None], topic: str, payload: bytes
    ) -> None:
        """Every message ends as handled or as a counted, logged rejection: an exception
        is the server's own failure (reason `internal`, logged with its traceback), and the
        device still gets a refusal when it can be identified."""
        try:
            handle(topic, payload)
        except Exception as exc:  # noqa: BLE001
            log.exception("internal error while handling a %s on %r", what, topic[:200])
            try:
                detail = f"{what}: {type(exc).__name__}: {str(exc)[:200]}"
                arrival = self._arrival(topic, topic_device(topic))
                self.carry_out(internal_failure(arrival, detail), LazyId(payload))
            except Exception:  # noqa: BLE001 - never let the network thread die
                log.exception("could not count an internal error")

    def on_uplink(self, topic: str, payload: bytes) -> None:
        self._guarded("uplink", self._handle_uplink, topic, payload)

    def on_hello(self, topic: str, payload: bytes) -> None:
        self._guarded("hello", self._handle_hello, topic, payload)

    def _decode(self, payload: bytes) -> Uplink | Decline | MessageRejected:
        try:
            msg = decode(
                payload,
                max_bytes=self.s.cfg.max_bytes,
                expected_numel=self.s.numel,
                uplink_schema=self._uplink_schema,
            )
        except MessageRejected as exc:
            return exc
        if not isinstance(msg, Uplink | Decline):
            return MessageRejected(
                "wrong_kind", f"expected Uplink or Decline, got {type(msg).__name__}"
            )
        return msg

    def _handle_uplink(self, topic: str, payload: bytes) -> None:
        if self._refresh is not None:
            self._refresh()
        mid = LazyId(payload)
        dev = topic_device(topic)
        if dev is None:  # refused before anything is decoded
            self.carry_out(admit(self._arrival(topic, None), MessageRejected("malformed", "")))
            return
        msg = self._decode(payload)
        on_record = not isinstance(msg, MessageRejected) and self.s.store.has_update(
            msg.round_id, dev
        )
        with self.s.lock:
            decision = admit(self._arrival(topic, dev, on_record), msg)
            if decision.outcome is Outcome.DECLINE:
                assert isinstance(msg, Decline)
                self.s.store.record_decline(msg.round_id, dev, msg.reason)
                self.carry_out(decision, mid)
                log.warning(
                    "round %d: %s declined: %s", msg.round_id, dev, msg.reason or "no reason"
                )
                self.s.changed.notify_all()
            elif decision.outcome is not Outcome.ACCEPT:
                self.carry_out(decision, mid)
        if decision.outcome is Outcome.ACCEPT:
            # Outside the lock: the checksum takes milliseconds, and a round that closes
            # meanwhile is caught by the recorder's commit (stale_round), as for any update
            # still queued for the disk.
            assert isinstance(msg, Uplink)
            self._accept(msg, payload, mid)

    def _accept(self, msg: Uplink, payload: bytes, mid: LazyId) -> None:
        """Record and acknowledge an admitted update; a packed one must first match its
        checksum against the round's global model (it is recorded packed, and decoded on
        the fly by the receipts and the aggregation). Called on paho's thread, during the
        message's delivery (its PUBACK is deferred here), without the session's lock."""
        dev, rid = msg.device_id, msg.round_id
        try:
            if msg.packed is not None:  # a plain update needs no base (none may be out yet)
                check_uplink(msg, self._base())
        except MessageRejected as exc:
            self.carry_out(after_admission(exc.reason, exc.detail, dev, rid), mid)
            return
        assert self.s.link is not None
        puback = self.s.link.defer_ack()
        self._record(msg, payload, lambda refused: self._recorded(msg, mid, refused, puback))

    def _recorded(self, msg: Uplink, mid: LazyId, refused: str, puback: Callable[[], None]) -> None:
        """The update's fate is known: ack it (or refuse it), then let the broker drop its
        copy (PUBACK): only now is an accepted update durable."""
        dev, rid = msg.device_id, msg.round_id
        try:
            if refused:
                detail = (
                    f"round {rid} already has an update from {dev}"
                    if refused == "duplicate"
                    else f"round {rid} closed before the update was recorded"
                    if refused == "stale_round"
                    else "the server could not record it"
                )
                self.carry_out(after_admission(refused, detail, dev, rid), mid)
                return
            self.send_ack(dev, rid, True, "", mid)
        finally:
            # The update is durable (or refused): the broker may drop its copy and hand this
            # session the next uplink while the receipts below are computed.
            puback()
        self._fold(lambda: self._note_distance(msg))
        log.info(
            "round %d: update from %s accepted (%s)",
            rid,
            dev,
            self.strategy.describe_result(msg.record),
        )
        with self.s.lock:
            self.s.changed.notify_all()

    def _note_distance(self, msg: Uplink) -> None:
        """Fold the update into the open round's receipts (its screening distance and the
        difference sum, server/round_receipts.py) while it is in memory, when this process
        runs the round."""
        receipts = self.s.receipts
        if receipts is not None and receipts.round_id == msg.round_id:
            if msg.packed is not None:
                receipts.note_packed(msg.device_id, msg.packed, self._base())
            else:
                receipts.note(msg.device_id, msg.params)

    # ------------------------------------------------------------------ hellos
    def _handle_hello(self, topic: str, payload: bytes) -> None:
        dev = topic_device(topic)
        if dev is None:
            self.count(
                "malformed", f"hello on topic {topic[:200]!r} names no valid device id", None, None
            )
            return
        retained = self.s.link is not None and self.s.link.delivered_retained()
        try:
            msg: Hello = decode_as(payload, Hello, max_bytes=1 << 20)
        except MessageRejected as exc:
            if retained:
                self._refused_retained_hello(dev, f"{exc.reason}: hello: {exc.detail}", False)
            else:
                self.count(exc.reason, f"hello: {exc.detail}", dev, None)
            return
        with self.s.lock:
            reg = self.s.registry()
            decision = admit_hello(dev, msg, self.s.cfg.fleet, reg, self.s.static)
            if decision.outcome is Outcome.REFUSE:
                self._refuse_hello(decision, dev, msg.online, retained)
                return
            if dev not in reg:
                self.s.store.register_device(dev, msg.device_type, "hello")
            self.s.store.set_online(dev, msg.online)
            self.s.changed.notify_all()
        log.info("device %s (%s) %s", dev, msg.device_type, "online" if msg.online else "offline")

    def _refuse_hello(self, decision: Decision, dev: str, online: bool, retained: bool) -> None:
        """Carry out a refused Hello. A refusal answers the one Hello that asked to join:
        the offline Hello a refused device leaves with (its clean exit or its will) is
        neither counted nor answered, since nobody would read that answer but the device's
        next session, which the broker keeps and would hand it as the refusal of its next,
        perhaps corrected, Hello."""
        if retained:
            self._refused_retained_hello(dev, f"{decision.reason}: {decision.detail}", online)
            if online:
                self.carry_out(replace(decision, outcome=Outcome.IGNORE))
        elif online:
            self.carry_out(decision)
        else:
            log.info("offline hello from refused device %s ignored: %s", dev, decision.detail)

    def _refused_retained_hello(self, dev: str, why: str, online: bool) -> None:
        """A Hello that cannot stand, delivered as the broker's retained copy: it predates
        this server's subscription, most often an earlier run's (a device since dropped from
        the fleet, or of another type), so it is not counted against this run; it is logged
        once per device id. Still refused: the device is neither registered nor sampled."""
        if dev in self._stale_hellos_logged:
            return
        self._stale_hellos_logged.add(dev)
        log.warning(
            "retained hello from %s (%s) refused, not counted: it was on the broker before "
            "this server subscribed: %s",
            dev,
            "online" if online else "offline",
            why,
        )

    # ------------------------------------------------------------------ the broker
    def on_broker_dropped(self, topic: str, payload: bytes) -> None:
        """mosquitto's $SYS counter of messages it dropped (a client's queue was full, or
        its in-flight window): a dropped uplink is an update the server never sees, so the
        count is logged and kept where the operator looks."""
        try:
            total = int(payload.decode("ascii", "replace").strip() or 0)
        except ValueError:
            return
        with self.s.lock:
            grew = total > self.broker_dropped
            self.broker_dropped = total
        if grew:
            log.warning("the broker has dropped %d message(s) so far (queue overflow)", total)
            self.s.progress(
                f"warning: the broker reports {total} dropped message(s) "
                "(a client's queue overflowed; see max_queued_messages)"
            )
