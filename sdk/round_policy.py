"""The device's round policy: what one downlink asks of this device, as pure functions.

These are the rules that keep a round from being counted twice in the device's running
variance (docs/PROTOCOL.md, "Device rules"): a downlink for another fleet, the start of a
new run, the end of a run, a stale round, a round the device is not sampled for, the
re-send of a saved update, a round already trained, a deadline already passed, and only
then local training. `plan_round` decides, `apply_plan` carries out the bookkeeping the
decision implies on the in-memory `DeviceState`; neither does any I/O, so every branch is
tested without a broker (tests/test_round_policy.py). `DeviceClient` does the rest:
resetting the state for a new run, saving, training, delivering, progress lines.

The delivery rules of protocol v2 live here too: which acks answer the update in flight
(`ack_verdict`), which downlink ends the wait for one (`supersedes`), and which of several
queued downlinks counts (`newer`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from wakefl.protocol.messages import Ack, Downlink
from wakefl.sdk.device_state import DeviceState


class RoundStep(enum.Enum):
    """What the device does with one downlink."""

    OTHER_FLEET = "other_fleet"  # not our fleet: ignored (logged)
    RUN_ALREADY_OVER = "run_already_over"  # the end of a run this device never joined
    RUN_ENDED_BEFORE = "run_ended_before"  # the end of our run, already noted
    END_RUN = "end_run"  # the server ended our run: mark finished, drop any pending update
    STALE = "stale"  # a round older than one seen or acknowledged: nothing to do
    NOT_SAMPLED = "not_sampled"  # the round goes on without this device
    RESEND = "resend"  # the saved update of this very round goes out again
    ALREADY_TRAINED = "already_trained"  # trained once; refused or given up: never again
    DEADLINE_PASSED = "deadline_passed"  # the round's deadline passed before we began
    TRAIN = "train"  # train the round, then deliver the update


@dataclass(frozen=True)
class RoundPlan:
    """The decision for one downlink and the bookkeeping it implies.

    `new_run`: the downlink belongs to another run than the state's: the device starts
    from a fresh personal state (`DeviceClient` builds it) before the bookkeeping below.
    `adopt_run`: record the downlink's run id in a state that has none yet.
    `last_round`: the state's new highest round seen (None: unchanged).
    `drop_pending`: the saved update belongs to a closed round (the server would call it
    stale) or to an ended run: forget it.
    `finish`: the run is over.
    `save`: the bookkeeping is committed to disk now (training and delivery commit their
    own saves).
    """

    step: RoundStep
    round_id: int
    run_id: str
    new_run: bool = False
    adopt_run: bool = False
    last_round: int | None = None
    drop_pending: bool = False
    finish: bool = False
    save: bool = False

    @property
    def takes_part(self) -> bool:
        """Does the device send (or re-send) an update this round?"""
        return self.step in (RoundStep.RESEND, RoundStep.TRAIN)


@dataclass(frozen=True)
class _View:
    """The state as the policy sees it: a fresh one when the downlink starts a new run."""

    run_id: str = ""
    finished: bool = False
    last_round: int = 0
    last_acked_round: int = 0
    last_trained_round: int = 0
    pending_round: int | None = None


def _view(state: DeviceState, new_run: bool) -> _View:
    if new_run:
        return _View()
    pending = state.pending
    return _View(
        state.run_id,
        state.finished,
        state.last_round,
        state.last_acked_round,
        state.last_trained_round,
        None if pending is None else pending.round_id,
    )


def plan_round(state: DeviceState, down: Downlink, device_id: str, now: float) -> RoundPlan:
    """What device `device_id`, in `state`, does with `down` at unix time `now`."""
    rid, run = down.round_id, down.run_id
    if down.fleet != state.fleet:
        return RoundPlan(RoundStep.OTHER_FLEET, rid, run)
    new_run = bool(state.run_id) and run != state.run_id
    v = _view(state, new_run)
    if down.final and not v.run_id:
        # Retained on the broker from an earlier run: wait for the next run, do not leave.
        return RoundPlan(RoundStep.RUN_ALREADY_OVER, rid, run, new_run=new_run)
    adopt = not v.run_id
    if down.final:
        if v.finished:
            return RoundPlan(RoundStep.RUN_ENDED_BEFORE, rid, run, new_run, adopt)
        return RoundPlan(
            RoundStep.END_RUN,
            rid,
            run,
            new_run,
            adopt,
            last_round=max(v.last_round, rid),
            drop_pending=True,
            finish=True,
            save=True,
        )
    if rid < v.last_round or rid <= v.last_acked_round:
        return RoundPlan(RoundStep.STALE, rid, run, new_run, adopt)
    # From here on the round counts as seen; a saved update of an earlier round is stale.
    drop = v.pending_round is not None and v.pending_round < rid

    def plan(step: RoundStep, save: bool) -> RoundPlan:
        return RoundPlan(
            step, rid, run, new_run, adopt, last_round=rid, drop_pending=drop, save=save
        )

    if device_id not in down.instructions:
        return plan(RoundStep.NOT_SAMPLED, save=True)
    if v.pending_round == rid:
        return plan(RoundStep.RESEND, save=False)  # the delivery saves each send
    if rid <= v.last_trained_round:
        # Trained already and the update was refused or given up on: training again would
        # count the round twice in the running variance.
        return plan(RoundStep.ALREADY_TRAINED, save=True)
    if now > down.deadline:
        return plan(RoundStep.DEADLINE_PASSED, save=True)
    return plan(RoundStep.TRAIN, save=False)  # the training commit saves


def apply_plan(state: DeviceState, plan: RoundPlan) -> None:
    """The bookkeeping of `plan` on `state` (in memory; the caller saves when `plan.save`).
    A `new_run` plan expects `state` to be the fresh state of the new run already."""
    if plan.adopt_run:
        state.run_id = plan.run_id
    if plan.last_round is not None:
        state.last_round = plan.last_round
    if plan.drop_pending:
        state.pending = None
    if plan.finish:
        state.finished = True


# ----------------------------------------------------------------------------- delivery
def supersedes(down: Downlink, round_id: int, run_id: str) -> bool:
    """Does `down`, arriving while the device waits for the ack of its update for
    `round_id`, close that round (a newer round, the end of the run, another run)?"""
    return down.final or down.round_id > round_id or down.run_id != run_id


def answers_update(ack: Ack, round_id: int, message_id: str) -> bool:
    """Is `ack` the server's answer to the update in flight? Only an ack naming these very
    bytes counts: anyone able to publish on the uplink topic (or garbage) draws acks too,
    and those say nothing about ours."""
    return ack.round_id == round_id and ack.answers == message_id


def ack_verdict(ack: Ack) -> bool:
    """Accepted? A 'duplicate' refusal means an earlier send was already recorded."""
    return ack.accepted or ack.reason.startswith("duplicate")


def newer(a: Downlink, b: Downlink) -> bool:
    """Of two queued downlinks, does `a` replace `b`? Another run always does (the latest
    message on the retained topic wins); within a run the higher round, or the end."""
    if a.run_id != b.run_id:
        return True
    return (a.round_id, a.final) >= (b.round_id, b.final)


__all__ = [
    "RoundPlan",
    "RoundStep",
    "ack_verdict",
    "answers_update",
    "apply_plan",
    "newer",
    "plan_round",
    "supersedes",
]
