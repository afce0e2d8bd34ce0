"""The device side of the federation: the Python API a firmware app embeds.

A `DeviceClient` is given the device's local data (training data and a validation set),
joins a fleet over MQTT and takes part in rounds until the server announces the end of
the run:

1. The retained downlink announces a round. A device that is not among the round's
   sampled devices sits it out.
2. A sampled device runs the strategy's `client_update` on its own data (Self-FL: initial
   point, step count, local SGD, variance update), scores its new personal model and the
   baseline on its validation set (relative FA/FR at matched FR), and commits the new
   state together with the not-yet-acknowledged update to disk, atomically.
3. It publishes the uplink and waits for the server's application-level `Ack`; without
   one it re-sends (bounded). A restart after a crash re-sends the saved update instead
   of training the round a second time, which would count the round twice in the running
   variance.

This class only wires the parts together: the round policy (`round_policy.plan_round`,
pure), the transport (`device_link.DeviceLink`), the device's state folder
(`device_state`), local training and evaluation (`round_training.RoundTrainer`) and the
delivery of updates (`update_delivery.UpdateDelivery`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor
from torch.utils.data import Dataset

from wakefl.errors import AudioError, ConfigError, NonFiniteError, ProtocolError
from wakefl.sdk import messages, topics
from wakefl.sdk.device_link import DeviceLink
from wakefl.sdk.device_state import DeviceState, load_or_create, lock_folder
from wakefl.sdk.round_policy import RoundPlan, RoundStep, apply_plan, plan_round
from wakefl.sdk.round_training import RoundTrainer, personal_model, round_generator
from wakefl.sdk.selffl.strategy import LocalProblem
from wakefl.sdk.update_delivery import RoundOutcome, RunSummary, UpdateDelivery

log = logging.getLogger("wakefl.device")

DEFAULT_ACK_TIMEOUT_S = 15.0
DEFAULT_MAX_SENDS = 4

Progress = Callable[[str], None]
# Progress lines of the plans that end a downlink's handling at once.
_ANNOUNCED = {
    RoundStep.END_RUN: "the server ended run {run} after round {rid}",
    RoundStep.NOT_SAMPLED: "round {rid}: not sampled",
    RoundStep.DEADLINE_PASSED: "round {rid}: skipped, deadline passed",
}


class DeviceClient:
    """One device of a fleet.

    `train` is the device's training data: a dataset of (wave, label) (the client builds
    the model the server announces and a `TorchLocalProblem` over it) or any
    `LocalProblem`. `validation` is a dataset of (wave, label) for the local relative
    FA/FR report (None: no report). State lives in `state_dir`; one process per folder.
    """

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
    ) -> None:
        self.device_id = topics.check_name(device_id, "device id")
        self.device_type = topics.check_name(device_type, "device type")
        self.fleet = topics.check_name(fleet, "fleet")
        if max_sends < 1 or ack_timeout_s <= 0:
            raise ConfigError("need max_sends >= 1 and ack_timeout_s > 0")
        if wire_dtype is not None and wire_dtype not in messages.WIRE_DTYPES:
            raise ConfigError(f"wire dtype must be one of {sorted(messages.WIRE_DTYPES)}")
        self._progress = progress or (lambda line: log.info("%s", line))
        self._lock_fd: int | None = lock_folder(Path(state_dir))
        try:
            self.store, self.state = load_or_create(state_dir, device_id, device_type, fleet)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.trainer = RoundTrainer(
            train,
            validation,
            device_id=self.device_id,
            seed=int(seed),
            target_fr=float(target_fr),
            eval_batch_size=int(eval_batch_size),
            expected_width=expected_width,
        )
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
            # acks outside a wait are late duplicates: nothing to do

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

    def personal_params(self) -> Tensor | None:
        """The device's current personal model as a flat vector (None before any round)."""
        return self.state.personal_params

    def personal_model(self) -> Any:
        """The current personal model as a `KwsCnn` (ConfigError before the first round)."""
        return personal_model(self.state)

    def export_personal_model(self, path: str | Path) -> Path:
        """Write the personal model as a safetensors checkpoint (+ JSON config)."""
        from wakefl.models.kws_cnn import save_model

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_model(self.personal_model(), path)
        return path

    def export_onnx(self, path: str | Path, int8: bool = False) -> Path:
        """Hand the personal model to the edge runtime: an ONNX file (waveform in,
        probability out) that `wakefl.edge_runtime.OnnxScorer` loads. Written to a temp
        name and renamed, so a detector that reloads the file never sees half of it."""
        from wakefl.models.kws_cnn import export_onnx

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
        export_onnx(self.personal_model(), tmp, int8=int8)
        os.replace(tmp, path)
        return path

    # ------------------------------------------------------------------ round logic
    def handle_downlink(self, down: messages.Downlink) -> RoundOutcome | None:
        """Take part in the round `down` announces (or note the run's end). Returns None
        for a downlink that changes nothing (stale, or a round already done)."""
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
        elif plan.step is RoundStep.RUN_ALREADY_OVER and plan.run_id != self._ignored_final:
            self._ignored_final = plan.run_id
            self._progress(
                f"{self.device_id}: run {plan.run_id} is already over; waiting for a new run"
            )
        elif plan.step in _ANNOUNCED:
            line = _ANNOUNCED[plan.step].format(run=plan.run_id, rid=plan.round_id)
            self._progress(f"{self.device_id}: {line}")

    def _train(self, down: messages.Downlink, outcome: RoundOutcome) -> bool:
        """Train the round and commit it; False when the round was declined instead."""
        t0 = time.perf_counter()
        try:
            self.trainer.train(self.state, down)
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

    def _decline(self, down: messages.Downlink, reason: str) -> None:
        self.delivery.decline(self.state, down, reason)
        self._progress(f"{self.device_id}: round {down.round_id}: declined ({reason})")

    def _report(self, outcome: RoundOutcome) -> None:
        fa = "n/a" if outcome.relative_fa is None else f"{outcome.relative_fa:.3f}"
        fr = "n/a" if outcome.relative_fr is None else f"{outcome.relative_fr:.3f}"
        status = {True: "accepted", False: "refused", None: "not acknowledged"}[outcome.accepted]
        self._progress(
            f"{self.device_id}: round {outcome.round_id}: {self.trainer.describe(outcome.record)}"
            f" in {outcome.train_s:.1f} s, relative FA {fa}, relative FR {fr}, update {status} "
            f"after {outcome.sends} send(s)" + (f" ({outcome.note})" if outcome.note else "")
        )


__all__ = ["DeviceClient", "RoundOutcome", "RunSummary", "round_generator"]
