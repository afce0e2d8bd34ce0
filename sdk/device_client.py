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

The network runs on paho's thread (reconnecting on its own with a persistent MQTT
session); message handlers only decode and queue, and all work happens on the thread
that called `run`, so a long training step never stalls the keepalive.

The baseline for relative FA/FR is the first global model the device receives in a run
(round 1's global model is the warm-start model; a device that joins later takes the
global model of the round it joined in and says so in `baseline_round`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from wakefl.errors import AudioError, ConfigError, NonFiniteError, ProtocolError, WakeflError
from wakefl.sdk import messages, topics
from wakefl.sdk.device_state import DeviceState, PendingUpdate, load_or_create
from wakefl.sdk.selffl.strategy import ClientInstructions, ClientState, LocalProblem, Strategy

log = logging.getLogger("wakefl.device")

DEFAULT_ACK_TIMEOUT_S = 15.0
DEFAULT_MAX_SENDS = 4
# Keys of the downlink's hyperparameters that configure the transport or the device, not
# the strategy's constructor.
_NON_STRATEGY_KEYS = frozenset({
    "wire_dtype", "ack_timeout_s", "strategy", "rounds", "target_fr", "max_bytes",
})

_HELLO_FIRST_REPEAT_S = 2.0
_HELLO_MAX_REPEAT_S = 60.0

Progress = Callable[[str], None]


@dataclass
class RoundOutcome:
    """What the device did in one round (for progress output and the run summary)."""

    round_id: int
    sampled: bool
    accepted: bool | None = None  # None: not sent or no acknowledgement
    local_steps: int = 0
    sigma_m_sq: float = 0.0
    relative_fa: float | None = None
    relative_fr: float | None = None
    sends: int = 0
    train_s: float = 0.0
    note: str = ""


@dataclass
class RunSummary:
    rounds_seen: int = 0
    rounds_trained: int = 0
    updates_accepted: int = 0
    finished: bool = False
    outcomes: list[RoundOutcome] = field(default_factory=list)


def _looks_like_problem(obj: Any) -> bool:
    return isinstance(obj, LocalProblem) and not isinstance(obj, Dataset)


def round_generator(seed: int, device_id: str, round_id: int) -> torch.Generator:
    """The minibatch generator of one round: the same (seed, device, round) draws the same
    batches, different devices different ones."""
    import zlib

    mix = zlib.crc32(f"{seed}:{device_id}:{round_id}".encode())
    return torch.Generator().manual_seed(mix)


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
        self.train_data = train
        self.validation = validation
        self.broker_url = broker_url
        self.seed = int(seed)
        self.ack_timeout_s = float(ack_timeout_s)
        self.max_sends = int(max_sends)
        self.wire_dtype = wire_dtype
        self.target_fr = float(target_fr)
        self.eval_batch_size = int(eval_batch_size)
        self.expected_width = expected_width
        self._progress = progress or (lambda line: log.info("%s", line))

        self._lock_fd: int | None = _lock_folder(Path(state_dir))
        try:
            self.store, self.state = load_or_create(state_dir, device_id, device_type, fleet)
        except BaseException:
            os.close(self._lock_fd)
            raise

        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._link = None
        self._model = None
        self._model_key: str | None = None
        self._problem: LocalProblem | None = train if _looks_like_problem(train) else None
        self._strategy: Strategy | None = None
        self._strategy_key: str | None = None
        self._baseline_scores: tuple[int, np.ndarray, np.ndarray] | None = None
        self._stop = threading.Event()
        self._subscribed_here = False  # subscribed within this process's MQTT session
        self._heard_server = False  # a downlink arrived since the last connect
        self._last_hello = 0.0
        self._ignored_final = ""
        self._hello_interval = _HELLO_FIRST_REPEAT_S

    # ------------------------------------------------------------------ public API
    @property
    def num_samples(self) -> int:
        if self._problem is not None:
            return int(self._problem.num_samples)
        return len(self.train_data)  # type: ignore[arg-type]

    def stop(self) -> None:
        """Ask `run` to return (thread-safe)."""
        self._stop.set()
        self._inbox.put(("wake", None))

    def run(self, *, max_rounds: int | None = None, connect_timeout: float = 30.0,
            idle_timeout: float | None = None) -> RunSummary:
        """Join the fleet and take part in rounds until the server announces the end of
        the run (or `max_rounds` rounds were seen, or `stop()`, or `idle_timeout` seconds
        without any message). Returns a summary."""
        summary = RunSummary()
        if self.state.finished:
            # The retained end-of-run message returns us at once; a new run is joined.
            self._progress(f"{self.device_id}: run {self.state.run_id} already ended; "
                           "waiting for the server")
        self._connect(connect_timeout)
        try:
            self._resend_pending_after_restart(summary)
            last_activity = time.monotonic()
            while not self._stop.is_set():
                item = self._next(timeout=1.0)
                self._maybe_repeat_hello()
                if item is None:
                    if idle_timeout is not None and time.monotonic() - last_activity > idle_timeout:
                        raise ProtocolError(
                            f"no message from the server for {idle_timeout:.0f} s")
                    continue
                last_activity = time.monotonic()
                kind, payload = item
                if kind == "connected":
                    self._on_connected(payload)
                elif kind == "down":
                    self._heard_server = True
                    outcome = self.handle_downlink(payload)
                    if outcome is not None:
                        summary.rounds_seen += 1
                        summary.outcomes.append(outcome)
                        summary.rounds_trained += int(outcome.sampled and outcome.sends > 0)
                        summary.updates_accepted += int(bool(outcome.accepted))
                    if self.state.finished:
                        summary.finished = True
                        break
                    if max_rounds is not None and summary.rounds_seen >= max_rounds:
                        break
                # acks outside a wait are late duplicates: nothing to do
        finally:
            self._disconnect()
        return summary

    def close(self) -> None:
        """Leave the fleet and release the state folder."""
        self._disconnect()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def __enter__(self) -> DeviceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _disconnect(self) -> None:
        if self._link is not None:
            # Best effort: the broker publishes the will if this does not get through.
            with contextlib.suppress(WakeflError):
                self._link.publish(topics.hello(self.fleet, self.device_id), self._hello(False),
                                   timeout=2.0)
            self._link.close()
            self._link = None

    def personal_params(self) -> Tensor | None:
        """The device's current personal model as a flat vector (None before any round)."""
        return self.state.personal_params

    def personal_model(self):
        """The current personal model as a `KwsCnn` (ConfigError before the first round)."""
        from wakefl.models.kws_cnn import KwsCnn, ModelConfig, set_flat_params

        if self.state.personal_params is None or self.state.model_config is None:
            raise ConfigError(f"device {self.device_id} has no personal model yet: "
                              "it has not taken part in a round")
        model = KwsCnn(ModelConfig.from_dict(self.state.model_config))
        set_flat_params(model, self.state.personal_params)
        model.eval()
        return model

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
        st = self.state
        if down.fleet != self.fleet:
            log.warning("ignoring a downlink for fleet %r", down.fleet)
            return None
        if st.run_id and down.run_id != st.run_id:
            self._progress(f"{self.device_id}: new run {down.run_id} (was {st.run_id}); "
                           "starting from a fresh personal state")
            self._reset_for_new_run()
        st = self.state
        if down.final and not st.run_id:
            # The end of a run this device never took part in (retained on the broker from
            # an earlier run): wait for the next run instead of leaving.
            if down.run_id != self._ignored_final:
                self._ignored_final = down.run_id
                self._progress(f"{self.device_id}: run {down.run_id} is already over; "
                               "waiting for a new run")
            return None
        if not st.run_id:
            st.run_id = down.run_id
        if down.final:
            if st.finished:
                return None
            st.finished = True
            st.last_round = max(st.last_round, down.round_id)
            st.pending = None
            self.store.save(st, tensors_changed=False)
            self._progress(f"{self.device_id}: the server ended run {down.run_id} "
                           f"after round {down.round_id}")
            return None
        if down.round_id < st.last_round or down.round_id <= st.last_acked_round:
            return None
        st.last_round = down.round_id
        if st.pending is not None and st.pending.round_id < down.round_id:
            st.pending = None  # its round is closed: the server would call it stale
        outcome = RoundOutcome(round_id=down.round_id, sampled=self.device_id in down.instructions)
        if not outcome.sampled:
            self.store.save(st, tensors_changed=False)
            self._progress(f"{self.device_id}: round {down.round_id}: not sampled")
            return outcome
        if st.pending is not None and st.pending.round_id == down.round_id:
            outcome.note = "re-sent the saved update"
        elif down.round_id <= st.last_trained_round:
            # Trained already and the update was refused or given up on: training again
            # would count the round twice in the running variance.
            self.store.save(st, tensors_changed=False)
            return None
        else:
            if time.time() > down.deadline:
                outcome.note = "deadline already passed"
                self.store.save(st, tensors_changed=False)
                self._progress(f"{self.device_id}: round {down.round_id}: skipped, deadline passed")
                return outcome
            t0 = time.perf_counter()
            try:
                self._train_round(down)
            except (NonFiniteError, RuntimeError, ValueError) as exc:
                # The strategy refused before replacing anything (or the local problem
                # failed): the previous personal model and variance state stay, no update is
                # sent this round, and the server is told so it need not wait for one.
                outcome.note = f"training refused: {exc}"
                self._decline(down, outcome.note)
                return outcome
            except (ConfigError, AudioError) as exc:
                # Broken local data or a model this device cannot run: it never will, so
                # it declines the round and stops.
                self._decline(down, f"cannot train: {exc}")
                raise
            outcome.train_s = time.perf_counter() - t0
        pending = self.state.pending
        assert pending is not None
        outcome.local_steps = int(pending.scalars.get("local_steps", 0))
        outcome.sigma_m_sq = float(pending.scalars.get("sigma_sq", 0.0))
        outcome.relative_fa = pending.report.get("relative_fa")
        outcome.relative_fr = pending.report.get("relative_fr")
        self._deliver(down, outcome)
        fa = "n/a" if outcome.relative_fa is None else f"{outcome.relative_fa:.3f}"
        fr = "n/a" if outcome.relative_fr is None else f"{outcome.relative_fr:.3f}"
        status = {True: "accepted", False: "refused", None: "not acknowledged"}[outcome.accepted]
        self._progress(
            f"{self.device_id}: round {down.round_id}: {outcome.local_steps} local steps in "
            f"{outcome.train_s:.1f} s, sigma_m^2={outcome.sigma_m_sq:.3g}, relative FA {fa}, "
            f"relative FR {fr}, update {status} after {outcome.sends} send(s)"
            + (f" ({outcome.note})" if outcome.note else ""))
        return outcome

    def _decline(self, down: messages.Downlink, reason: str) -> None:
        """Say on the uplink topic that this round gets no update from us (docs/PROTOCOL.md:
        `decline`), so the server closes the round once the others answered instead of
        waiting out the deadline. Sent once: the round is marked done here either way."""
        st = self.state
        st.pending = None
        # a declined round is not tried again when its downlink is redelivered
        st.last_trained_round = max(st.last_trained_round, down.round_id)
        self.store.save(st, tensors_changed=False)
        self._progress(f"{self.device_id}: round {down.round_id}: declined ({reason})")
        if self._link is None:
            return
        payload = messages.encode(messages.Decline(
            fleet=self.fleet, run_id=down.run_id, device_id=self.device_id,
            round_id=down.round_id, reason=reason[: messages.MAX_REASON_LEN]))
        try:
            self._link.publish(topics.uplink(self.fleet, self.device_id), payload, qos=1,
                               timeout=self.ack_timeout_s)
        except ProtocolError as exc:
            log.warning("round %d: decline not delivered: %s", down.round_id, exc)

    def _reset_for_new_run(self) -> None:
        old = self.state
        self.state = DeviceState(device_id=old.device_id, device_type=old.device_type,
                                 fleet=old.fleet)
        self._baseline_scores = None

    def _ensure_model(self, model_config: dict[str, Any]):
        from wakefl.models.kws_cnn import KwsCnn, ModelConfig

        key = json.dumps(model_config, sort_keys=True)
        if self._model is not None and key == self._model_key:
            return self._model
        cfg = ModelConfig.from_dict(model_config)
        if self.expected_width is not None and not math.isclose(cfg.width, self.expected_width):
            raise ConfigError(f"the server runs model width {cfg.width}, this device was "
                              f"configured for width {self.expected_width}")
        for name, data in (("training", self.train_data), ("validation", self.validation)):
            window = getattr(data, "window_samples", None)
            if window is not None and int(window) != cfg.window_samples:
                raise ConfigError(f"the {name} data has {window}-sample windows, the server's "
                                  f"model expects {cfg.window_samples}")
        self._model = KwsCnn(cfg)
        self._model_key = key
        if not _looks_like_problem(self.train_data):
            self._problem = None  # rebuilt over the new model
        return self._model

    def _strategy_for(self, down: messages.Downlink) -> Strategy:
        """The strategy the server runs: `hyperparameters["strategy"]` with
        `hyperparameters["strategy_args"]` (docs/PROTOCOL.md); a flat hyperparameter dict
        without `strategy_args` is taken as the arguments themselves."""
        from wakefl.sdk.selffl.registry import make_strategy

        hp = down.hyperparameters
        name = str(hp.get("strategy", down.strategy))
        if isinstance(hp.get("strategy_args"), dict):
            args = dict(hp["strategy_args"])
        else:
            args = {k: v for k, v in hp.items() if k not in _NON_STRATEGY_KEYS}
        key = json.dumps([name, args], sort_keys=True, default=str)
        if self._strategy is None or key != self._strategy_key:
            try:
                self._strategy = make_strategy(name, **args)
            except TypeError as exc:
                raise ConfigError(f"strategy {name!r} refuses the server's arguments "
                                  f"{args}: {exc}") from exc
            self._strategy_key = key
        return self._strategy

    def _local_problem(self, strategy: Strategy) -> LocalProblem:
        # The minibatch size is the strategy's B (it enters Self-FL's step-count rule).
        batch = int(getattr(strategy, "batch_size", 16))
        if self._problem is not None and (
                _looks_like_problem(self.train_data)
                or getattr(self._problem, "batch_size", batch) == batch):
            return self._problem
        from wakefl.sdk.local_training import TorchLocalProblem

        self._problem = TorchLocalProblem(self._model, self.train_data, batch_size=batch)
        return self._problem

    def _train_round(self, down: messages.Downlink) -> None:
        st = self.state
        model = self._ensure_model(down.model_config)
        strategy = self._strategy_for(down)
        problem = self._local_problem(strategy)
        d = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if down.global_params.numel() != d:
            raise ProtocolError(f"the global model has {down.global_params.numel()} parameters, "
                                f"the announced model config has {d}")
        if st.baseline_params is None:
            st.baseline_params = down.global_params.clone()
            st.baseline_round = down.round_id
        scalars = dict(down.instructions.get(self.device_id, {}))
        scalars.setdefault("sigma0_sq", down.sigma0_sq)
        instructions = ClientInstructions(
            client_id=self.device_id, round_id=down.round_id, global_params=down.global_params,
            scalars=scalars, tensors=dict(down.tensors))
        result, new_client = strategy.client_update(
            instructions, st.client, problem,
            round_generator(self.seed, self.device_id, down.round_id))
        personal = new_client.tensors.get("personal", result.params)
        report = self._relative_report(personal, st)
        # Commit point of the round: new variance state, personal model and the update to
        # send, all or nothing.
        st.client = ClientState(tensors=dict(new_client.tensors), scalars=dict(new_client.scalars))
        st.personal_params = personal
        st.model_config = dict(down.model_config)
        st.participations += 1
        st.last_trained_round = down.round_id
        st.pending = PendingUpdate(
            round_id=down.round_id, num_samples=int(result.num_samples),
            scalars=dict(result.scalars), tensors={"params": result.params, **result.tensors},
            report=report, wire_dtype=_known_wire_dtype(down.hyperparameters.get("wire_dtype")))
        self.store.save(st)

    def _relative_report(self, personal: Tensor, st: DeviceState) -> dict[str, Any]:
        """Local relative FA/FR of the personal model against the baseline on the
        validation set, at the baseline's operating point (target FR) and matched FR."""
        if self.validation is None or len(self.validation) == 0:
            return {}
        from wakefl.sdk.local_training import load_flat_trainable, predict_scores
        from wakefl.sdk.wake_metrics import local_relative_report

        model = self._model
        if self._baseline_scores is None or self._baseline_scores[0] != st.baseline_round:
            load_flat_trainable(model, st.baseline_params)
            base = predict_scores(model, self.validation, batch_size=self.eval_batch_size)
            labels = getattr(self.validation, "labels", None)
            if labels is None:
                labels = [int(self.validation[i][1]) for i in range(len(self.validation))]
            labels = np.asarray(labels, dtype=np.int64)
            self._baseline_scores = (st.baseline_round, base, labels)
        _, base, labels = self._baseline_scores
        load_flat_trainable(model, personal)
        cand = predict_scores(model, self.validation, batch_size=self.eval_batch_size)
        try:
            rep = local_relative_report(base, cand, labels, target_fr=self.target_fr)
        except (WakeflError, ValueError) as exc:
            log.warning("no relative FA/FR this round: %s", exc)
            return {"error": str(exc)}
        return _json_safe(rep)

    # ------------------------------------------------------------------ delivery
    def _uplink_payload(self, down: messages.Downlink | None, pending: PendingUpdate) -> bytes:
        st = self.state
        tensors = dict(pending.tensors)
        params = tensors.pop("params", None)
        if params is None:
            params = st.personal_params
        sc = pending.scalars
        wire = (self.wire_dtype or (down.hyperparameters.get("wire_dtype") if down else None)
                or pending.wire_dtype or "fp32")
        up = messages.Uplink(
            fleet=self.fleet, run_id=st.run_id, device_id=self.device_id,
            device_type=self.device_type, round_id=pending.round_id, params=params,
            sigma_m_sq=float(sc.get("sigma_sq", sc.get("sigma_m_sq", 0.0))),
            num_samples=int(pending.num_samples), local_steps=int(sc.get("local_steps", 0)),
            relative_fa=pending.report.get("relative_fa"),
            relative_fr=pending.report.get("relative_fr"),
            scalars=messages.scalars_only(sc), tensors=tensors)
        return messages.encode(up, wire_dtype=wire)

    def _deliver(self, down: messages.Downlink | None, outcome: RoundOutcome) -> None:
        """Publish the pending update and wait for the server's Ack, re-sending on timeout.
        A newer round or the end of the run stops the wait (the round is closed). Only an
        ack that answers these very bytes (`Ack.answers`) counts: anyone able to publish on
        our uplink topic (or garbage) gets acks too, and those say nothing about ours."""
        st = self.state
        pending = st.pending
        assert pending is not None
        payload = self._uplink_payload(down, pending)
        mid = messages.message_id(payload)
        topic = topics.uplink(self.fleet, self.device_id)
        ack_timeout = self.ack_timeout_s
        deadline = math.inf
        if down is not None:
            ack_timeout = float(down.hyperparameters.get("ack_timeout_s", ack_timeout))
            deadline = down.deadline
        while outcome.sends < self.max_sends and not self._stop.is_set():
            if outcome.sends > 0 and time.time() > deadline:
                outcome.note = "deadline passed before an acknowledgement"
                return
            outcome.sends += 1
            pending.attempts += 1
            self.store.save(st, tensors_changed=False)
            try:
                self._link.publish(topic, payload, qos=1, timeout=ack_timeout)
            except messages.MessageRejected:
                raise
            except ProtocolError as exc:
                log.warning("round %d: publish failed (%s); will retry", pending.round_id, exc)
                if not self._link.connected:
                    self._link.wait_connected(ack_timeout)
                continue
            ack = self._wait_ack(pending.round_id, ack_timeout, mid)
            if ack == "superseded":
                outcome.note = "round closed before the acknowledgement"
                return
            if ack is None:
                log.info("round %d: no acknowledgement within %.0f s; re-sending",
                         pending.round_id, ack_timeout)
                continue
            # A 'duplicate' refusal means an earlier send was already recorded.
            accepted = ack.accepted or ack.reason.startswith("duplicate")
            outcome.accepted = accepted
            if not accepted:
                outcome.note = f"refused: {ack.reason}"
            st.pending = None
            if accepted:
                st.last_acked_round = max(st.last_acked_round, pending.round_id)
            self.store.save(st, tensors_changed=False)
            return
        outcome.note = outcome.note or f"no acknowledgement after {outcome.sends} send(s)"

    def _wait_ack(self, round_id: int, timeout: float, answers: str) -> messages.Ack | str | None:
        end = time.monotonic() + timeout
        while not self._stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return None
            item = self._next(timeout=left)
            if item is None:
                continue
            kind, payload = item
            if kind == "ack" and payload.round_id == round_id:
                if payload.answers == answers:
                    return payload
                log.info("round %d: ignoring an ack (%s) that answers another message",
                         round_id, payload.reason or "accepted")
                continue
            if kind == "down" and (payload.final or payload.round_id > round_id
                                   or payload.run_id != self.state.run_id):
                # Handled by the main loop once this wait returns.
                self._inbox.put(item)
                return "superseded"
            if kind == "connected":
                self._on_connected(payload)
        return None

    def _resend_pending_after_restart(self, summary: RunSummary) -> None:
        """A process that died with an unacknowledged update re-sends it at once: the
        retained downlink would trigger it too, but a broker that lost the retained
        message (or a server between rounds) would leave it unsent until the next round.
        The server answers stale_round for a round that closed meanwhile, and the update
        is dropped; a newer downlink ends the wait (superseded)."""
        pending = self.state.pending
        if pending is None or not self.state.run_id or self.state.finished:
            return
        self._progress(f"{self.device_id}: re-sending the unacknowledged update for round "
                       f"{pending.round_id} (sent {pending.attempts} time(s) before the restart)")
        outcome = RoundOutcome(round_id=pending.round_id, sampled=True,
                               note="re-sent after a restart")
        outcome.local_steps = int(pending.scalars.get("local_steps", 0))
        outcome.sigma_m_sq = float(pending.scalars.get("sigma_sq", 0.0))
        self._deliver(None, outcome)
        summary.outcomes.append(outcome)
        summary.updates_accepted += int(bool(outcome.accepted))

    # ------------------------------------------------------------------ transport
    def _hello(self, online: bool = True) -> bytes:
        return messages.encode(messages.Hello(
            fleet=self.fleet, device_id=self.device_id, device_type=self.device_type,
            num_samples=self.num_samples, online=online))

    def _on_connected(self, session_present: bool) -> None:
        if session_present and not self._subscribed_here:
            # A session resumed from an earlier process: the broker delivers what was queued
            # while offline but not the retained downlink, so a device restarted with an
            # unacknowledged update would wait for the next round. Subscribing again fetches
            # the retained downlink (handling it twice is harmless).
            self._link.subscribe(topics.downlink(self.fleet), self._on_downlink)
            self._link.subscribe(topics.ack(self.fleet, self.device_id), self._on_ack)
        self._subscribed_here = True
        self._heard_server = False
        self._hello_interval = _HELLO_FIRST_REPEAT_S
        self._send_hello()

    def _maybe_repeat_hello(self) -> None:
        """Repeat the Hello (backing off) until a downlink shows the server is there: a
        Hello sent before the server first subscribed is lost, and a server that waits
        for its devices would wait for this one forever."""
        if self._heard_server or self._link is None or not self._link.connected:
            return
        if time.monotonic() - self._last_hello >= self._hello_interval:
            self._hello_interval = min(self._hello_interval * 2, _HELLO_MAX_REPEAT_S)
            self._send_hello()

    def _send_hello(self) -> None:
        self._last_hello = time.monotonic()
        try:
            self._link.publish(topics.hello(self.fleet, self.device_id), self._hello(True),
                               timeout=self.ack_timeout_s)
        except ProtocolError as exc:
            log.warning("hello not delivered: %s", exc)

    def _connect(self, timeout: float) -> None:
        from wakefl.sdk.mqtt_link import MqttLink

        link = MqttLink(self.broker_url, client_id=self.device_id,
                        will=(topics.hello(self.fleet, self.device_id), self._hello(False)))
        link.subscribe(topics.downlink(self.fleet), self._on_downlink)
        link.subscribe(topics.ack(self.fleet, self.device_id), self._on_ack)
        # The hook runs on paho's thread, which must not block on a PUBACK: the Hello is
        # sent from the main loop.
        link.on_connect_hooks.append(lambda present: self._inbox.put(("connected", present)))
        self._link = link
        link.connect(timeout)

    def _on_downlink(self, topic: str, payload: bytes) -> None:
        try:
            down = messages.decode_as(payload, messages.Downlink)
        except messages.MessageRejected as exc:
            log.warning("rejected a downlink: %s", exc)
            return
        self._inbox.put(("down", down))

    def _on_ack(self, topic: str, payload: bytes) -> None:
        try:
            ack = messages.decode_as(payload, messages.Ack)
        except messages.MessageRejected as exc:
            log.warning("rejected an ack: %s", exc)
            return
        if ack.device_id == self.device_id:
            self._inbox.put(("ack", ack))

    def _next(self, timeout: float) -> tuple[str, Any] | None:
        """Next inbox item; of several queued downlinks only the newest counts."""
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if item[0] != "down":
            return item
        newest = item
        others: list[tuple[str, Any]] = []
        while True:
            try:
                nxt = self._inbox.get_nowait()
            except queue.Empty:
                break
            if nxt[0] == "down" and _newer(nxt[1], newest[1]):
                newest = nxt
            elif nxt[0] != "down":
                others.append(nxt)
        for o in others:
            self._inbox.put(o)
        return newest


def _json_safe(value: Any) -> Any:
    """The report as plain JSON values; non-finite numbers become None."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float | np.integer | np.floating):
        v = float(value)
        return v if math.isfinite(v) else None
    return str(value)


def _known_wire_dtype(value: Any) -> str:
    return value if isinstance(value, str) and value in messages.WIRE_DTYPES else ""


def _newer(a: messages.Downlink, b: messages.Downlink) -> bool:
    if a.run_id != b.run_id:
        return True  # the latest message on the retained topic wins
    return (a.round_id, a.final) >= (b.round_id, b.final)


def _lock_folder(directory: Path) -> int:
    """An exclusive lock on the state folder for the life of the process: two processes
    writing one device's state would undo each other's rounds."""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ConfigError(f"state folder {directory} is in use by another process") from None
    return fd


__all__ = ["DeviceClient", "RoundOutcome", "RunSummary", "round_generator"]
