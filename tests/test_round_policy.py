"""The device's round policy (sdk/round_policy.py), branch by branch, without a broker:
each row is a device state, a downlink and the plan the device must make of it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from wakefl.protocol import messages
from wakefl.protocol.round_settings import RoundSettings
from wakefl.sdk.device_state import DeviceState, PendingUpdate
from wakefl.sdk.round_policy import (
    RoundPlan,
    RoundStep,
    ack_verdict,
    answers_update,
    apply_plan,
    newer,
    plan_round,
    supersedes,
)

NOW = 1_000_000.0
ME = "dev1"


def _state(
    run_id: str = "run1",
    *,
    finished: bool = False,
    last_round: int = 0,
    acked: int = 0,
    trained: int = 0,
    pending: int | None = None,
) -> DeviceState:
    st = DeviceState(
        device_id=ME,
        device_type="A",
        fleet="f",
        run_id=run_id,
        finished=finished,
        last_round=last_round,
        last_acked_round=acked,
        last_trained_round=trained,
    )
    if pending is not None:
        st.pending = PendingUpdate(round_id=pending, num_samples=4)
    return st


def _down(
    round_id: int,
    sampled: tuple[str, ...] = (ME,),
    *,
    run_id: str = "run1",
    final: bool = False,
    fleet: str = "f",
    deadline: float = NOW + 60,
) -> messages.Downlink:
    return messages.Downlink(
        fleet=fleet,
        run_id=run_id,
        round_id=round_id,
        global_params=torch.zeros(3),
        model_config={},
        instructions={d: {} for d in sampled},
        settings=RoundSettings(),
        deadline=deadline,
        final=final,
    )


# (case, state, downlink, step, expected bookkeeping beyond step/round/run)
CASES = [
    ("other fleet", _state(), _down(1, fleet="g"), RoundStep.OTHER_FLEET, {}),
    (
        "end of a run never joined",
        _state(""),
        _down(5, final=True, run_id="run0"),
        RoundStep.RUN_ALREADY_OVER,
        {},
    ),
    (
        "end of an old run after a new one began",
        _state("run1", last_round=3),
        _down(5, final=True, run_id="run2"),
        RoundStep.RUN_ALREADY_OVER,
        {"new_run": True},
    ),
    (
        "end of our run, already noted",
        _state(finished=True, last_round=4),
        _down(4, final=True),
        RoundStep.RUN_ENDED_BEFORE,
        {},
    ),
    (
        "end of our run",
        _state(last_round=3, pending=3),
        _down(4, final=True),
        RoundStep.END_RUN,
        {"last_round": 4, "drop_pending": True, "finish": True, "save": True},
    ),
    (
        "end of our run announced with an older round id",
        _state(last_round=6),
        _down(4, final=True),
        RoundStep.END_RUN,
        {"last_round": 6, "drop_pending": True, "finish": True, "save": True},
    ),
    ("stale: older than the last round seen", _state(last_round=5), _down(4), RoundStep.STALE, {}),
    (
        "stale: round already acknowledged",
        _state(last_round=4, acked=4),
        _down(4),
        RoundStep.STALE,
        {},
    ),
    (
        "stale round of a state without a run: the run is adopted",
        _state(""),
        _down(0),
        RoundStep.STALE,
        {"adopt_run": True},
    ),
    (
        "not sampled",
        _state(last_round=1),
        _down(2, ("other",)),
        RoundStep.NOT_SAMPLED,
        {"last_round": 2, "save": True},
    ),
    (
        "not sampled: a saved update of an older round is dropped",
        _state(last_round=1, pending=1),
        _down(2, ("other",)),
        RoundStep.NOT_SAMPLED,
        {"last_round": 2, "save": True, "drop_pending": True},
    ),
    (
        "re-send the saved update of this round",
        _state(last_round=2, trained=2, pending=2),
        _down(2),
        RoundStep.RESEND,
        {"last_round": 2},
    ),
    (
        "re-send even after the deadline (the server decides)",
        _state(last_round=2, trained=2, pending=2),
        _down(2, deadline=NOW - 1),
        RoundStep.RESEND,
        {"last_round": 2},
    ),
    (
        "trained already, update refused or given up",
        _state(last_round=2, trained=2),
        _down(2),
        RoundStep.ALREADY_TRAINED,
        {"last_round": 2, "save": True},
    ),
    (
        "deadline passed before training",
        _state(last_round=1),
        _down(2, deadline=NOW - 1),
        RoundStep.DEADLINE_PASSED,
        {"last_round": 2, "save": True},
    ),
    (
        "train",
        _state(last_round=1, acked=1, trained=1),
        _down(2),
        RoundStep.TRAIN,
        {"last_round": 2},
    ),
    (
        "train, dropping a saved update of a closed round",
        _state(last_round=1, trained=1, pending=1),
        _down(3),
        RoundStep.TRAIN,
        {"last_round": 3, "drop_pending": True},
    ),
    (
        "first round of a fresh device: the run is adopted",
        _state(""),
        _down(1),
        RoundStep.TRAIN,
        {"adopt_run": True, "last_round": 1},
    ),
    (
        "a new run: judged on a fresh state, so round 1 trains again",
        _state("run1", last_round=9, acked=9, trained=9, pending=9),
        _down(1, run_id="run2"),
        RoundStep.TRAIN,
        {"new_run": True, "adopt_run": True, "last_round": 1},
    ),
    (
        "a new run after a finished one",
        _state("run1", finished=True, last_round=9),
        _down(1, ("other",), run_id="run2"),
        RoundStep.NOT_SAMPLED,
        {"new_run": True, "adopt_run": True, "last_round": 1, "save": True},
    ),
]


@pytest.mark.parametrize(
    ("case", "state", "down", "step", "extra"), CASES, ids=[c[0] for c in CASES]
)
def test_plan_round(case, state, down, step, extra):
    plan = plan_round(state, down, ME, NOW)
    assert plan == RoundPlan(step, down.round_id, down.run_id, **extra)
    assert plan.takes_part == (step in (RoundStep.RESEND, RoundStep.TRAIN))


def test_every_step_is_covered_by_the_table():
    assert {c[3] for c in CASES} == set(RoundStep)


def test_plan_round_is_pure():
    st = _state(last_round=1, trained=1, pending=1)
    before = replace(st)
    plan_round(st, _down(3), ME, NOW)
    assert st == before


def test_apply_plan_carries_out_the_bookkeeping():
    st = _state("", pending=None)
    apply_plan(st, plan_round(st, _down(1), ME, NOW))
    assert (st.run_id, st.last_round, st.finished) == ("run1", 1, False)

    st = _state(last_round=1, trained=1, pending=1)
    apply_plan(st, plan_round(st, _down(2, ("other",)), ME, NOW))
    assert st.pending is None and st.last_round == 2

    st = _state(last_round=2, trained=2, pending=2)
    apply_plan(st, plan_round(st, _down(2), ME, NOW))
    assert st.pending is not None  # the update to re-send stays

    st = _state(last_round=3, pending=3)
    apply_plan(st, plan_round(st, _down(4, final=True), ME, NOW))
    assert st.finished and st.pending is None and st.last_round == 4


def _ack(round_id: int = 2, accepted: bool = True, reason: str = "", answers: str = "m1"):
    return messages.Ack(
        fleet="f",
        device_id=ME,
        round_id=round_id,
        accepted=accepted,
        reason=reason,
        answers=answers,
    )


@pytest.mark.parametrize(
    ("ack", "answers", "accepted"),
    [
        (_ack(), True, True),
        (_ack(accepted=False, reason="stale_round"), True, False),
        (_ack(accepted=False, reason="duplicate"), True, True),  # an earlier send was recorded
        (_ack(answers="other"), False, True),  # answers another message: ignored
        (_ack(answers=""), False, True),
        (_ack(round_id=1), False, True),
    ],
)
def test_acks(ack, answers, accepted):
    assert answers_update(ack, 2, "m1") is answers
    assert ack_verdict(ack) is accepted


@pytest.mark.parametrize(
    ("down", "closes"),
    [
        (_down(2), False),  # the same round redelivered
        (_down(1), False),
        (_down(3), True),
        (_down(2, final=True), True),
        (_down(2, run_id="run2"), True),
    ],
)
def test_supersedes(down, closes):
    assert supersedes(down, 2, "run1") is closes


@pytest.mark.parametrize(
    ("a", "b", "replaces"),
    [
        (_down(3), _down(2), True),
        (_down(2), _down(3), False),
        (_down(2), _down(2), True),
        (_down(2, final=True), _down(2), True),
        (_down(2), _down(2, final=True), False),
        (_down(1, run_id="run2"), _down(5), True),  # another run: the latest message wins
    ],
)
def test_newer(a, b, replaces):
    assert newer(a, b) is replaces
