"""Delivery of a device's update: publish, wait for the server's application-level `Ack`,
re-send on timeout (bounded), re-send a saved update after a restart, and decline a round
the device cannot train (docs/PROTOCOL.md, "Device rules").

The update to deliver is always the state's `pending` one, committed to disk before it is
first sent; every send is counted in `PendingUpdate.attempts` and saved, and only an ack
that answers these very bytes (`round_policy.answers_update`) settles it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wakefl.errors import ConfigError, ProtocolError
from wakefl.protocol import messages, topics, update_codec
from wakefl.sdk.device_link import DeviceLink
from wakefl.sdk.device_state import DeviceState, DeviceStateStore, PendingUpdate
from wakefl.sdk.round_policy import ack_verdict, answers_update, supersedes

log = logging.getLogger("wakefl.device")

_SUPERSEDED = "superseded"


def check_delivery_settings(max_sends: int, ack_timeout_s: float, wire_dtype: str | None) -> None:
    """ConfigError for settings under which no update could be delivered."""
    if max_sends < 1 or ack_timeout_s <= 0:
        raise ConfigError("need max_sends >= 1 and ack_timeout_s > 0")
    if wire_dtype is not None and wire_dtype not in messages.WIRE_DTYPES:
        raise ConfigError(f"wire dtype must be one of {sorted(messages.WIRE_DTYPES)}")


@dataclass
class RoundOutcome:
    """What the device did in one round (for progress output and the run summary)."""

    round_id: int
    sampled: bool
    accepted: bool | None = None  # None: not sent or no acknowledgement
    record: dict[str, float] = field(default_factory=dict)  # the strategy's uplink record
    relative_fa: float | None = None
    relative_fr: float | None = None
    sends: int = 0
    train_s: float = 0.0
    note: str = ""
    # The served-model gate's decision (GateDecision.as_dict) and the model served after
    # the round: {"model", "round", "relative_fa", "relative_fr"} against the baseline.
    gate: dict[str, Any] | None = None
    served: dict[str, Any] | None = None

    def take_pending(self, pending: PendingUpdate) -> None:
        """The figures of the update about to be delivered."""
        self.record = dict(pending.scalars)
        self.relative_fa = pending.report.get("relative_fa")
        self.relative_fr = pending.report.get("relative_fr")
        self.gate = pending.report.get("gate")
        self.served = pending.report.get("served")


@dataclass
class RunSummary:
    rounds_seen: int = 0
    rounds_trained: int = 0
    updates_accepted: int = 0
    finished: bool = False
    outcomes: list[RoundOutcome] = field(default_factory=list)
    # The model served at the end of the run and the gate's last decision (see RoundOutcome).
    served: dict[str, Any] | None = None
    gate: dict[str, Any] | None = None

    def add(self, outcome: RoundOutcome) -> None:
        self.rounds_seen += 1
        self.outcomes.append(outcome)
        if outcome.served is not None:
            self.served, self.gate = outcome.served, outcome.gate
        self.rounds_trained += int(outcome.sampled and outcome.sends > 0)
        self.updates_accepted += int(bool(outcome.accepted))


class UpdateDelivery:
    """Sends the state's pending update (or a decline) over `link` and settles it."""

    def __init__(
        self,
        link: DeviceLink,
        store: DeviceStateStore,
        *,
        device_type: str,
        wire_dtype: str | None,
        ack_timeout_s: float,
        max_sends: int,
        stop: threading.Event,
    ) -> None:
        self.link = link
        self.store = store
        self.device_type = device_type
        self.wire_dtype = wire_dtype
        self.ack_timeout_s = ack_timeout_s
        self.max_sends = max_sends
        self.stop = stop

    def uplink_payload(self, state: DeviceState, down: messages.Downlink | None) -> bytes:
        pending = state.pending
        assert pending is not None
        tensors = dict(pending.tensors)
        params = tensors.pop("params", None)
        if params is None:
            params = state.personal_params
        assert params is not None, "a pending update always carries its parameters"
        wire = (
            self.wire_dtype
            or (down.settings.wire_dtype if down else None)
            or pending.wire_dtype
            or "fp32"
        )
        up = messages.Uplink(
            fleet=state.fleet,
            run_id=state.run_id,
            device_id=state.device_id,
            device_type=self.device_type,
            round_id=pending.round_id,
            params=params,
            num_samples=int(pending.num_samples),
            record=messages.scalars_only(pending.scalars),
            relative_fa=pending.report.get("relative_fa"),
            relative_fr=pending.report.get("relative_fr"),
            tensors=tensors,
        )
        codec = down.settings.uplink_codec if down is not None else ""
        if down is not None and codec in update_codec.DELTA_CODECS:
            # relative to the round's global model as decoded; a re-send after a restart
            # (no downlink at hand) goes plain, which the server accepts as well
            try:
                return messages.encode(up, uplink_codec=codec, base=down.global_params)
            except ProtocolError as exc:
                log.warning("round %d: sending the update plain: %s", pending.round_id, exc)
        return messages.encode(up, wire_dtype=wire)

    def deliver(
        self, state: DeviceState, down: messages.Downlink | None, outcome: RoundOutcome
    ) -> None:
        """Publish the pending update and wait for the server's Ack, re-sending on timeout.
        A newer round or the end of the run stops the wait (the round is closed)."""
        pending = state.pending
        assert pending is not None
        payload = self.uplink_payload(state, down)
        mid = messages.message_id(payload)
        ack_timeout, deadline = self.ack_timeout_s, math.inf
        if down is not None:
            ack_timeout = down.settings.ack_timeout_s
            deadline = down.deadline
        while outcome.sends < self.max_sends and not self.stop.is_set():
            if outcome.sends > 0 and time.time() > deadline:
                outcome.note = "deadline passed before an acknowledgement"
                return
            if not self._send(state, pending, payload, outcome, ack_timeout):
                continue
            ack = self.wait_ack(pending.round_id, ack_timeout, mid, state.run_id)
            if ack == _SUPERSEDED:
                outcome.note = "round closed before the acknowledgement"
                return
            if isinstance(ack, messages.Ack):
                self._settle(state, pending, ack, outcome)
                return
            log.info(
                "round %d: no acknowledgement within %.0f s; re-sending",
                pending.round_id,
                ack_timeout,
            )
        outcome.note = outcome.note or f"no acknowledgement after {outcome.sends} send(s)"

    def _send(
        self,
        state: DeviceState,
        pending: PendingUpdate,
        payload: bytes,
        outcome: RoundOutcome,
        timeout: float,
    ) -> bool:
        """One counted send; False when the broker did not take it (retried)."""
        outcome.sends += 1
        pending.attempts += 1
        self.store.save(state, tensors_changed=False)
        try:
            self.link.publish(topics.uplink(state.fleet, state.device_id), payload, timeout)
        except messages.MessageRejected:
            raise
        except ProtocolError as exc:
            log.warning("round %d: publish failed (%s); will retry", pending.round_id, exc)
            self.link.reconnect_wait(timeout)
            return False
        return True

    def _settle(
        self, state: DeviceState, pending: PendingUpdate, ack: messages.Ack, outcome: RoundOutcome
    ) -> None:
        accepted = ack_verdict(ack)
        outcome.accepted = accepted
        if not accepted:
            outcome.note = f"refused: {ack.reason}"
        state.pending = None
        if accepted:
            state.last_acked_round = max(state.last_acked_round, pending.round_id)
        self.store.save(state, tensors_changed=False)

    def wait_ack(
        self, round_id: int, timeout: float, answers: str, run_id: str
    ) -> messages.Ack | str | None:
        """The ack that answers message `answers`, "superseded" when a downlink closes the
        round first, None on timeout."""
        end = time.monotonic() + timeout
        while not self.stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return None
            item = self.link.next(timeout=left)
            if item is None:
                continue
            kind, payload = item
            if kind == "ack" and payload.round_id == round_id:
                if answers_update(payload, round_id, answers):
                    return payload
                log.info(
                    "round %d: ignoring an ack (%s) that answers another message",
                    round_id,
                    payload.reason or "accepted",
                )
            elif kind == "down" and supersedes(payload, round_id, run_id):
                self.link.put(item)  # handled by the main loop once this wait returns
                return _SUPERSEDED
            elif kind == "connected":
                self.link.on_connected(payload)
        return None

    def decline(self, state: DeviceState, down: messages.Downlink, reason: str) -> None:
        """Say on the uplink topic that this round gets no update from us (docs/PROTOCOL.md:
        `decline`), so the server closes the round once the others answered instead of
        waiting out the deadline. Sent once: the round is marked done here either way."""
        state.pending = None
        # a declined round is not tried again when its downlink is redelivered
        state.last_trained_round = max(state.last_trained_round, down.round_id)
        self.store.save(state, tensors_changed=False)
        self.publish_decline(state.fleet, state.device_id, down, reason)

    def publish_decline(
        self, fleet: str, device_id: str, down: messages.Downlink, reason: str
    ) -> None:
        """Publish the Decline only (no state is saved: a device whose state folder cannot
        be read uses this before it stops)."""
        if not self.link.is_open:
            return
        payload = messages.encode(
            messages.Decline(
                fleet=fleet,
                run_id=down.run_id,
                device_id=device_id,
                round_id=down.round_id,
                reason=reason[: messages.MAX_REASON_LEN],
            )
        )
        try:
            self.link.publish(topics.uplink(fleet, device_id), payload, timeout=self.ack_timeout_s)
        except ProtocolError as exc:
            log.warning("round %d: decline not delivered: %s", down.round_id, exc)

    def resend_after_restart(
        self, state: DeviceState, announce: Callable[[str], None]
    ) -> RoundOutcome | None:
        """A process that died with an unacknowledged update re-sends it at once: the
        retained downlink would trigger it too, but a broker that lost the retained
        message (or a server between rounds) would leave it unsent until the next round.
        The server answers stale_round for a round that closed meanwhile, and the update
        is dropped; a newer downlink ends the wait (superseded). None: nothing to re-send."""
        pending = state.pending
        if pending is None or not state.run_id or state.finished:
            return None
        announce(
            f"{state.device_id}: re-sending the unacknowledged update for round "
            f"{pending.round_id} (sent {pending.attempts} time(s) before the restart)"
        )
        outcome = RoundOutcome(
            round_id=pending.round_id, sampled=True, note="re-sent after a restart"
        )
        outcome.record = dict(pending.scalars)
        self.deliver(state, None, outcome)
        return outcome


__all__ = ["RoundOutcome", "RunSummary", "UpdateDelivery"]
