"""The device side of the federation: the Python API a firmware app embeds.

A `DeviceClient` is given the device's local data (training and validation sets, and the
user's enrolment takes: `enrol`), joins a fleet over MQTT and takes part in rounds until
the server ends the run: a sampled device trains on its own data, lets the served-model
gate choose the model it serves, commits state, served model and the unacknowledged update
to disk atomically, then publishes the update and waits for the `Ack`, re-sending
(bounded). A restart re-sends the saved update instead of training the round again.

This class only wires the parts together: the round policy (`round_policy`), the transport
(`device_link`), the state folder (`device_state`), local training (`round_training`),
enrolment (`enrolment`), delivery (`update_delivery`), the served model (`serving`) and
progress lines (`device_progress`). A device whose state folder cannot be read still
joins: it declines the first round it is sampled for, then raises the error.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from torch.utils.data import Dataset

from wakefl.errors import AudioError, ConfigError, NonFiniteError, ProtocolError
from wakefl.protocol import messages, topics
from wakefl.sdk import device_progress, serving, update_delivery
from wakefl.sdk.device_link import DeviceLink
from wakefl.sdk.device_state import DeviceState, open_state_folder
from wakefl.sdk.enrolment import ENROLMENT_DIR, Enrolment, Take, TakeResult, enrolled_data
from wakefl.sdk.round_policy import RoundPlan, RoundStep, apply_plan, plan_round
from wakefl.sdk.round_training import RoundTrainer, round_generator
from wakefl.sdk.selffl.strategy import LocalProblem
from wakefl.sdk.update_delivery import RoundOutcome, RunSummary, UpdateDelivery

log = logging.getLogger("wakefl.device")

DEFAULT_ACK_TIMEOUT_S = 15.0
DEFAULT_MAX_SENDS = 4

Progress = Callable[[str], None]


class DeviceClient(serving.ModelAccess):
    """One device of a fleet.

    `train`: a dataset of (wave, label) (trained through a `TorchLocalProblem` over the
    model the server announces) or any `LocalProblem`. `validation`: a dataset of (wave,
    label) for the relative FA/FR report and the served-model gate (None: no report, and
    the device keeps serving the model it shipped with). State lives in `state_dir`, one
    process per folder."""

    def __init__(
        self,
        device_id: str,
        device_type: str,
        train: Dataset | LocalProblem,
        state_dir: str | Path,
        *,
        validation: Dataset | None = None,
        broker_url: str = "mqtt://127.0.0.1:1883",
        fleet: str = topics.DEFAULT_FLEET,
        seed: int = 0,
        ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
        max_sends: int = DEFAULT_MAX_SENDS,
        wire_dtype: str | None = None,
        target_fr: float = 0.05,
        eval_batch_size: int = 32,
        expected_width: float | None = None,
        progress: Progress | None = None,
        gate_ties: str = "keep",
    ) -> None:
        self.device_id = topics.check_name(device_id, "device id")
        self.device_type = topics.check_name(device_type, "device type")
        self.fleet = topics.check_name(fleet, "fleet")
        update_delivery.check_delivery_settings(max_sends, ack_timeout_s, wire_dtype)
        self._progress = progress or (lambda line: log.info("%s", line))
        # A folder in use by another process is an error at once; one that cannot be read
        # is kept as `_state_error` (see `handle_downlink`).
        self._lock_fd, self.store, self.state, self._state_error = open_state_folder(
            Path(state_dir), self.device_id, self.device_type, self.fleet
        )
        self.enrolment, self._data = Enrolment(Path(state_dir) / ENROLMENT_DIR), (train, validation)
        self.trainer = RoundTrainer(
            *enrolled_data(train, validation, self.enrolment, self.device_type),
            device_id=self.device_id,
            seed=int(seed),
            target_fr=float(target_fr),
            eval_batch_size=int(eval_batch_size),
            expected_width=expected_width,
        )
        tr = self.trainer
        self.gate = serving.ServingGate(tr, target_fr=tr.target_fr, seed=tr.seed, ties=gate_ties)
        self._stop = threading.Event()
        self.link = DeviceLink(
            broker_url,
            self.fleet,
            self.device_id,
            self.device_type,
            lambda: self.num_samples,
            float(ack_timeout_s),
        )
        self.delivery = UpdateDelivery(
            self.link,
            self.store,
            device_type=self.device_type,
            wire_dtype=wire_dtype,
            ack_timeout_s=float(ack_timeout_s),
            max_sends=int(max_sends),
            stop=self._stop,
        )
        self._ignored_final = ""

    # ------------------------------------------------------------------ public API
    @property
    def num_samples(self) -> int:
        return self.trainer.num_samples

    def enrol(self, takes: Sequence[Take]) -> list[TakeResult]:
        """Keep recordings of the user saying the wake phrase (WAV paths or 16 kHz waves)
        that pass sdk/take_check.py as local positives for the next rounds' training and
        gate; each result says whether a take was kept, and why not."""
        results = self.enrolment.add(takes)
        self.trainer.replace_data(*enrolled_data(*self._data, self.enrolment, self.device_type))
        return results

    def stop(self) -> None:
        """Ask `run` to return (thread-safe)."""
        self._stop.set()
        self.link.wake()

    def run(
        self,
        *,
        max_rounds: int | None = None,
        connect_timeout: float = 30.0,
        idle_timeout: float | None = None,
    ) -> RunSummary:
        """Join the fleet and take part in rounds until the server announces the end of
        the run (or `max_rounds` rounds were seen, or `stop()`, or `idle_timeout` seconds
        without any message). Returns a summary."""
        summary = RunSummary()
        if self.state.finished:
            # The retained end-of-run message returns us at once; a new run is joined.
            self._progress(
                f"{self.device_id}: run {self.state.run_id} already ended; waiting for the server"
            )
        self.link.connect(connect_timeout)
        try:
            resent = self.delivery.resend_after_restart(self.state, self._progress)
            if resent is not None:
                summary.outcomes.append(resent)
                summary.updates_accepted += int(bool(resent.accepted))
            self._loop(summary, max_rounds, idle_timeout)
        finally:
            self.link.disconnect()
        return summary

    def _loop(
        self, summary: RunSummary, max_rounds: int | None, idle_timeout: float | None
    ) -> None:
        last_activity = time.monotonic()
        while not self._stop.is_set():
            item = self.link.next(timeout=1.0)
            self.link.maybe_repeat_hello()
            if item is None:
                if idle_timeout is not None and time.monotonic() - last_activity > idle_timeout:
                    raise ProtocolError(f"no message from the server for {idle_timeout:.0f} s")
                continue
            last_activity = time.monotonic()
            kind, payload = item
            if kind == "connected":
                self.link.on_connected(payload)
            elif kind == "down":
                self.link.heard_server()
                outcome = self.handle_downlink(payload)
                if outcome is not None:
                    summary.add(outcome)
                if self.state.finished:
                    summary.finished = True
                    return
                if max_rounds is not None and summary.rounds_seen >= max_rounds:
                    return
            elif kind == "ack" and payload.answers == "hello" and not payload.accepted:
                # The server refuses this device's Hello: it will never sample it.
                raise ProtocolError(f"the server refuses device {self.device_id}: {payload.reason}")
            # other acks outside a wait are late duplicates: nothing to do

    def close(self) -> None:
        """Leave the fleet and release the state folder."""
        self.link.disconnect()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def __enter__(self) -> DeviceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ round logic
    def handle_downlink(self, down: messages.Downlink) -> RoundOutcome | None:
        """Take part in the round `down` announces (or note the run's end). Returns None
        for a downlink that changes nothing (stale, or a round already done)."""
        if self._state_error is not None:
            return self._decline_unreadable(down)
        plan = plan_round(self.state, down, self.device_id, time.time())
        if plan.new_run:
            self._progress(
                f"{self.device_id}: new run {down.run_id} (was {self.state.run_id}); "
                "starting from a fresh personal state"
            )
            self.state = DeviceState(
                device_id=self.state.device_id,
                device_type=self.state.device_type,
                fleet=self.state.fleet,
            )
            self.trainer.new_run()
        apply_plan(self.state, plan)
        if plan.save:
            self.store.save(self.state, tensors_changed=False)
        self._announce(plan, down)
        if plan.step is RoundStep.NOT_SAMPLED:
            return RoundOutcome(plan.round_id, sampled=False)
        if plan.step is RoundStep.DEADLINE_PASSED:
            return RoundOutcome(plan.round_id, sampled=True, note="deadline already passed")
        if not plan.takes_part:
            return None
        outcome = RoundOutcome(round_id=down.round_id, sampled=True)
        if plan.step is RoundStep.RESEND:
            outcome.note = "re-sent the saved update"
        elif not self._train(down, outcome):
            return outcome
        assert self.state.pending is not None
        outcome.take_pending(self.state.pending)
        self.delivery.deliver(self.state, down, outcome)
        self._report(outcome)
        return outcome

    def _announce(self, plan: RoundPlan, down: messages.Downlink) -> None:
        if plan.step is RoundStep.OTHER_FLEET:
            log.warning("ignoring a downlink for fleet %r", down.fleet)
        line = device_progress.plan_line(plan, down, self.device_id, self._ignored_final)
        if plan.step is RoundStep.RUN_ALREADY_OVER:
            self._ignored_final = plan.run_id
        if line:
            self._progress(line)

    def _train(self, down: messages.Downlink, outcome: RoundOutcome) -> bool:
        """Train the round and commit it; False when the round was declined instead."""
        t0 = time.perf_counter()
        try:
            self.trainer.train(self.state, down)
            self.gate.after_round(self.state, down.global_params, down.round_id)
            self.store.save(self.state)
        except (NonFiniteError, RuntimeError, ValueError) as exc:
            # The strategy refused before replacing anything (or the local problem failed):
            # the previous personal model and variance state stay, no update is sent this
            # round, and the server is told so it need not wait for one.
            outcome.note = f"training refused: {exc}"
            self._decline(down, outcome.note)
            return False
        except (ConfigError, AudioError) as exc:
            # Broken local data or a model this device cannot run: it never will, so it
            # declines the round and stops.
            self._decline(down, f"cannot train: {exc}")
            raise
        outcome.train_s = time.perf_counter() - t0
        return True

    def _decline_unreadable(self, down: messages.Downlink) -> RoundOutcome | None:
        """With a state folder that cannot be read: the first round that samples this
        device gets a Decline (published only), then the saved error is raised; the end of
        a run raises it at once."""
        assert self._state_error is not None
        if down.fleet != self.fleet:
            return None
        if not down.final and self.device_id not in down.instructions:
            return RoundOutcome(down.round_id, sampled=False)
        if not down.final:
            reason = f"state unreadable: {self._state_error}"
            self.delivery.publish_decline(self.fleet, self.device_id, down, reason)
            self._progress(f"{self.device_id}: round {down.round_id}: declined ({reason})")
        raise self._state_error

    def _decline(self, down: messages.Downlink, reason: str) -> None:
        self.delivery.decline(self.state, down, reason)
        self._progress(f"{self.device_id}: round {down.round_id}: declined ({reason})")

    def _report(self, outcome: RoundOutcome) -> None:
        described = self.trainer.describe(outcome.record, outcome.round_id)
        self._progress(device_progress.round_line(self.device_id, outcome, described))


__all__ = ["DeviceClient", "RoundOutcome", "RunSummary", "round_generator"]
