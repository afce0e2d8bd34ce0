"""The device's progress lines: what one downlink's plan and one round's outcome say to the
person running the device (pure string formatting, no I/O)."""

from __future__ import annotations

from typing import Any

from wakefl.protocol.messages import Downlink
from wakefl.sdk.round_policy import RoundPlan, RoundStep
from wakefl.sdk.update_delivery import RoundOutcome

# Progress lines of the plans that end a downlink's handling at once.
_ANNOUNCED = {
    RoundStep.END_RUN: "the server ended run {run} after round {rid}",
    RoundStep.NOT_SAMPLED: "round {rid}: not sampled",
    RoundStep.DEADLINE_PASSED: "round {rid}: skipped, deadline passed",
}


def plan_line(plan: RoundPlan, down: Downlink, device_id: str, ignored_final: str) -> str | None:
    """The line for `plan` (None: nothing to say). `ignored_final` is the run whose end
    was last reported as already over (said once per run)."""
    if plan.step is RoundStep.RUN_ALREADY_OVER and plan.run_id != ignored_final:
        return f"{device_id}: run {plan.run_id} is already over; waiting for a new run"
    if plan.step in _ANNOUNCED:
        return f"{device_id}: " + _ANNOUNCED[plan.step].format(run=plan.run_id, rid=plan.round_id)
    return None


def served_words(served: dict[str, Any] | None, gate: dict[str, Any] | None) -> str:
    """What the device serves after a round, for the round's line ("" when unknown)."""
    if not served:
        return ""
    fa, fr = served.get("relative_fa"), served.get("relative_fr")
    figs = (
        f" (relative to the baseline: FA {fa:.3f}, FR {fr:.3f})"
        if isinstance(fa, int | float) and isinstance(fr, int | float)
        else ""
    )
    verb = "switched to" if gate and gate.get("switched") else "serves"
    return f"; {verb} the {served.get('model')} model of round {served.get('round')}{figs}"


def round_line(device_id: str, outcome: RoundOutcome, described: str) -> str:
    """One round's line: the strategy's record (`described`), time, the personal model's
    relative FA/FR, the update's fate and the model served after the round."""
    fa = "n/a" if outcome.relative_fa is None else f"{outcome.relative_fa:.3f}"
    fr = "n/a" if outcome.relative_fr is None else f"{outcome.relative_fr:.3f}"
    status = {True: "accepted", False: "refused", None: "not acknowledged"}[outcome.accepted]
    return (
        f"{device_id}: round {outcome.round_id}: {described} in {outcome.train_s:.1f} s, "
        f"relative FA {fa}, relative FR {fr}, update {status} after {outcome.sends} send(s)"
        + (f" ({outcome.note})" if outcome.note else "")
        + served_words(outcome.served, outcome.gate)
    )


__all__ = ["plan_line", "round_line", "served_words"]
