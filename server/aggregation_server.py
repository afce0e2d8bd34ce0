"""The aggregation server: runs federated rounds over MQTT with a `Strategy`.

One round: sample devices (activity rate C over the registry), record the round, publish
the retained downlink, collect uplinks until every sampled device answered, the quorum
(`min_clients`) is in, or the deadline passed, aggregate with the strategy over a lazy
view of the recorded updates, persist, go on. All maths is the strategy's; this module
only moves, checks and stores messages. See docs/PROTOCOL.md.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from wakefl.errors import ConfigError, ProtocolError
from wakefl.finite import all_finite
from wakefl.sdk import topics
from wakefl.sdk.messages import (
    DEFAULT_MAX_BYTES,
    Ack,
    Downlink,
    Hello,
    MessageRejected,
    Uplink,
    decode_as,
    encode,
)
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.sdk.selffl.strategy import ServerState, Strategy
from wakefl.server.state_store import StateStore

log = logging.getLogger("wakefl.server")


@dataclass
class ServerConfig:
    broker_url: str
    state_dir: Path
    initial_params: Tensor
    model_config: dict[str, Any] = field(default_factory=dict)
    fleet: str = topics.DEFAULT_FLEET
    rounds: int = 10
    activity_rate: float = 1.0
    min_clients: int | None = None  # quorum; default: every sampled device
    round_timeout: float = 600.0
    devices: dict[str, str] | None = None  # static registry id -> type; None: Hello registers
    strategy_name: str = "selffl"
    strategy_args: dict[str, Any] = field(default_factory=dict)
    wire_dtype: str = "fp32"
    max_bytes: int = DEFAULT_MAX_BYTES
    ack_timeout_s: float = 30.0
    start_timeout: float | None = None  # give up waiting for devices (None: wait forever)
    keep_update_rounds: int = 2  # tensor files of older rounds are deleted after aggregation
    seed: int = 0

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir)
        topics.check_name(self.fleet, "fleet")
        if not 0.0 < self.activity_rate <= 1.0:
            raise ConfigError(f"activity rate must be in (0, 1], got {self.activity_rate}")
        if self.rounds < 0 or self.round_timeout <= 0:
            raise ConfigError("rounds must be >= 0 and the round timeout > 0")
        if self.min_clients is not None and self.min_clients < 1:
            raise ConfigError("--min-clients must be >= 1")
        if self.initial_params.dim() != 1 or not all_finite(self.initial_params):
            raise ConfigError("initial parameters must be a finite flat vector")


@dataclass
class RoundReport:
    round_id: int
    sampled: list[str]
    reported: dict[str, dict[str, float]]  # device -> {sigma_m_sq, local_steps, num_samples}
    sigma0_sq: float
    wall_s: float
    closed_by: str  # "all", "quorum", "deadline"
    # Where the wall time went: opening (sampling, downlink encode and publish), collecting
    # (until the round closed), aggregating plus persisting the new state.
    phases_s: dict[str, float] = field(default_factory=dict)


class AggregationServer:
    """`run()` drives the rounds until `config.rounds` are aggregated and announces the end.
    Thread model: paho's network thread validates and records uplinks (under `_lock`); the
    calling thread opens, closes and aggregates rounds (under the same lock)."""

    def __init__(self, config: ServerConfig, strategy: Strategy,
                 progress: Callable[[str], None] | None = None) -> None:
        self.cfg = config
        self.strategy = strategy
        self.progress = progress or (lambda line: print(line, flush=True))
        self.store = StateStore(config.state_dir)
        self.run_id = self.store.run_id()
        self.numel = int(config.initial_params.numel())
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._open: tuple[int, set[str], float] | None = None  # round, sampled, deadline
        self._downlink: bytes | None = None
        self._republish = False
        self.rejections: Counter[str] = Counter(self.store.rejection_counts())
        self.reports: list[RoundReport] = []
        self._static = config.devices is not None
        for dev, typ in (config.devices or {}).items():
            topics.check_name(dev, "device id")
            topics.check_name(typ, "device type")
            self.store.register_device(dev, typ, "registry")
        self.link: MqttLink | None = None
        self.stop_event = threading.Event()

    # ------------------------------------------------------------------ registry
    def registry(self) -> dict[str, str]:
        reg = self.store.devices()
        if self._static:
            return {d: t for d, t in reg.items() if d in self.cfg.devices}  # type: ignore[operator]
        return reg

    # ------------------------------------------------------------------ receiving
    def _reject(self, reason: str, detail: str, device: str | None, round_id: int | None,
                ack_device: str | None) -> None:
        self.rejections[reason] += 1
        self.store.count_rejection(reason, device, round_id, detail)
        log.warning("rejected update from %s (round %s): %s: %s", device, round_id, reason, detail)
        if ack_device is not None and round_id is not None:
            self._send_ack(ack_device, round_id, False, reason)

    def _send_ack(self, device: str, round_id: int, accepted: bool, reason: str) -> None:
        assert self.link is not None
        payload = encode(Ack(self.cfg.fleet, device, round_id, accepted, reason))
        try:
            self.link.publish(topics.ack(self.cfg.fleet, device), payload, wait=False)
        except ProtocolError as exc:
            log.warning("ack to %s not sent: %s", device, exc)

    def _on_uplink(self, topic: str, payload: bytes) -> None:
        _, _, dev = topics.parse(topic)
        registry = self.registry()
        known = dev if dev in registry else None
        round_hint: int | None = self._open[0] if self._open else None
        try:
            msg: Uplink = decode_as(payload, Uplink, max_bytes=self.cfg.max_bytes,
                                    expected_numel=self.numel)
        except MessageRejected as exc:
            self._reject(exc.reason, exc.detail, dev, round_hint, known)
            return
        rid = msg.round_id
        with self._lock:
            if msg.device_id != dev or msg.fleet != self.cfg.fleet:
                self._reject("topic_mismatch", f"message from {msg.device_id!r} of fleet "
                             f"{msg.fleet!r} on topic {topic!r}", dev, rid, known)
            elif known is None:
                self._reject("unknown_device", f"{dev!r} is not in the registry", dev, rid, None)
            elif registry[dev] != msg.device_type:
                self._reject("wrong_device_type", f"{dev!r} is registered as {registry[dev]!r}, "
                             f"sent {msg.device_type!r}", dev, rid, dev)
            elif msg.run_id == self.run_id and self.store.has_update(rid, dev):
                # QoS 1 redelivery or a re-send after a lost ack: on record already.
                self._reject("duplicate", f"round {rid} already has an update from {dev}", dev, rid, None)
                self._send_ack(dev, rid, True, "duplicate")
            elif self._open is None or msg.run_id != self.run_id or rid != self._open[0]:
                open_id = self._open[0] if self._open else None
                self._reject("stale_round", f"update for round {rid} (run {msg.run_id}); open "
                             f"round is {open_id}", dev, rid, dev)
            elif dev not in self._open[1]:
                self._reject("not_sampled", f"{dev} was not sampled for round {rid}", dev, rid, dev)
            else:
                self.store.record_update(msg, payload)
                self._send_ack(dev, rid, True, "")
                log.info("round %d: update from %s accepted (%d steps, sigma_m^2=%.4g)",
                         rid, dev, msg.local_steps, msg.sigma_m_sq)
                self._changed.notify_all()

    def _on_hello(self, topic: str, payload: bytes) -> None:
        _, _, dev = topics.parse(topic)
        try:
            msg: Hello = decode_as(payload, Hello, max_bytes=1 << 20)
        except MessageRejected as exc:
            self._reject(exc.reason, f"hello: {exc.detail}", dev, None, None)
            return
        with self._lock:
            if msg.device_id != dev or msg.fleet != self.cfg.fleet:
                self._reject("topic_mismatch", f"hello from {msg.device_id!r} on {topic!r}", dev, None, None)
                return
            reg = self.registry()
            if dev not in reg:
                if self._static:
                    self._reject("unknown_device", f"hello from unregistered {dev!r}", dev, None, None)
                    return
                self.store.register_device(dev, msg.device_type, "hello")
                reg[dev] = msg.device_type
            if reg[dev] != msg.device_type:
                self._reject("wrong_device_type", f"hello from {dev!r} as {msg.device_type!r}, "
                             f"registered as {reg[dev]!r}", dev, None, None)
                return
            self.store.set_online(dev, msg.online)
            self._changed.notify_all()
        log.info("device %s (%s) %s", dev, msg.device_type, "online" if msg.online else "offline")

    def _on_connect(self, session_present: bool) -> None:
        with self._lock:
            self._republish = True  # the broker may have lost the retained downlink
            self._changed.notify_all()

    # ------------------------------------------------------------------ sending
    def _publish_downlink(self, payload: bytes) -> None:
        """Retained, QoS 1, retried until the broker took it (it may be restarting)."""
        assert self.link is not None
        while not self.stop_event.is_set():
            try:
                self.link.publish(topics.downlink(self.cfg.fleet), payload, retain=True, timeout=30)
                return
            except ProtocolError as exc:
                log.warning("downlink not published yet (%s); retrying", exc)
                self.link.wait_connected(5)

    def _build_downlink(self, state: ServerState, round_id: int, sampled: list[str],
                        deadline: float, final: bool = False) -> bytes:
        instructions: dict[str, dict[str, float]] = {}
        shared: dict[str, Tensor] = {}
        params = state.global_params
        for dev in sampled:
            ins = self.strategy.configure_client(state, dev, round_id)
            instructions[dev] = {k: float(v) for k, v in ins.scalars.items()}
            params = ins.global_params
            for k, v in ins.tensors.items():
                if k in shared and not torch.equal(shared[k], v):
                    raise ConfigError(f"strategy {self.strategy.name} sends per-device tensor "
                                      f"{k!r}; protocol v1 carries shared tensors only")
                shared[k] = v
        hp = {"strategy": self.cfg.strategy_name, "strategy_args": self.cfg.strategy_args,
              "ack_timeout_s": self.cfg.ack_timeout_s, "wire_dtype": self.cfg.wire_dtype,
              "rounds": self.cfg.rounds}
        msg = Downlink(fleet=self.cfg.fleet, run_id=self.run_id, round_id=round_id,
                       global_params=params, model_config=self.cfg.model_config,
                       sigma0_sq=float(state.scalars.get("sigma0_sq", 0.0)),
                       instructions=instructions, hyperparameters=hp, deadline=deadline,
                       final=final, strategy=self.strategy.name, tensors=shared)
        return encode(msg, wire_dtype=self.cfg.wire_dtype, max_bytes=self.cfg.max_bytes)

    # ------------------------------------------------------------------ rounds
    def _sample(self, round_id: int, online: list[str], registry_size: int) -> list[str]:
        k = max(1, math.ceil(self.cfg.activity_rate * registry_size), self.cfg.min_clients or 0)
        rng = random.Random(f"{self.run_id}:{self.cfg.seed}:{round_id}")
        return sorted(rng.sample(online, min(k, len(online))))

    def _wait_for_devices(self) -> list[str]:
        need = self.cfg.min_clients or (len(self.cfg.devices) if self._static else 1)  # type: ignore[arg-type]
        start = time.monotonic()
        last_note = 0.0
        while not self.stop_event.is_set():
            reg = self.registry()
            online = [d for d in self.store.online_devices() if d in reg]
            if len(online) >= max(1, need):
                return online
            if time.monotonic() - last_note > 10:
                self.progress(f"waiting for devices: {len(online)}/{need} online")
                last_note = time.monotonic()
            if self.cfg.start_timeout is not None and time.monotonic() - start > self.cfg.start_timeout:
                raise ConfigError(f"only {len(online)} of the {need} devices needed came online "
                                  f"within {self.cfg.start_timeout:.0f} s")
            with self._changed:
                self._changed.wait(0.5)
        return []

    def _collect(self, round_id: int, sampled: list[str], deadline: float) -> str:
        quorum = min(self.cfg.min_clients or len(sampled), len(sampled))
        with self._changed:
            while not self.stop_event.is_set():
                if self._republish and self._downlink is not None:
                    self._republish = False
                    payload = self._downlink
                    self._changed.release()
                    try:
                        self._publish_downlink(payload)
                    finally:
                        self._changed.acquire()
                n = len(self.store.update_rows(round_id))
                if n >= len(sampled):
                    return "all"
                if n >= quorum:
                    return "quorum"
                remaining = deadline - time.time()
                if remaining <= 0:
                    return "deadline"
                self._changed.wait(min(remaining, 0.5))
        return "stopped"

    def _run_round(self, state: ServerState, round_id: int, resume: bool) -> ServerState:
        t0 = time.monotonic()
        deadline = time.time() + self.cfg.round_timeout
        if resume:
            rec = self.store.round(round_id)
            assert rec is not None
            sampled = rec.sampled
            self.store.extend_deadline(round_id, deadline)
            self.progress(f"round {round_id}/{self.cfg.rounds}: resumed with {rec.accepted}/"
                          f"{len(sampled)} updates on record")
        else:
            online = self._wait_for_devices()
            if self.stop_event.is_set():
                return state
            sampled = self._sample(round_id, online, len(self.registry()))
            self.store.open_round(round_id, sampled, deadline)
        payload = self._build_downlink(state, round_id, sampled, deadline)
        with self._lock:
            self._open = (round_id, set(sampled), deadline)
            self._downlink = payload
            self._republish = False
        self._publish_downlink(payload)
        t_open = time.monotonic()
        if not resume:
            self.progress(f"round {round_id}/{self.cfg.rounds}: sampled {len(sampled)} "
                          f"({', '.join(sampled)}), deadline in {self.cfg.round_timeout:.0f} s")
        closed_by = self._collect(round_id, sampled, deadline)
        if closed_by == "stopped":
            return state
        t_closed = time.monotonic()
        with self._lock:  # no update can be recorded for this round from here on
            self._open = None
            view = self.store.updates(round_id, self.numel, self.cfg.max_bytes)
            n = len(view)
            if n == 0:
                new_state = ServerState(round_id=state.round_id + 1,
                                        global_params=state.global_params, tensors=state.tensors,
                                        scalars=state.scalars, clients=state.clients)
            else:
                # C = |A| / M: the share of the registry whose update is aggregated.
                rate = min(1.0, n / max(1, len(self.registry())))
                new_state = self.strategy.aggregate(state, view, rate)
            self.store.close_round(round_id, new_state)
        t_aggregated = time.monotonic()
        self.store.prune_update_files(round_id - self.cfg.keep_update_rounds + 1)
        reported = {r["device_id"]: {"sigma_m_sq": r["sigma_m_sq"], "local_steps": r["local_steps"],
                                     "num_samples": r["num_samples"]} for r in view.rows}
        report = RoundReport(round_id, sampled, reported, float(new_state.scalars.get("sigma0_sq", 0.0)),
                             time.monotonic() - t0, closed_by,
                             {"open": t_open - t0, "collect": t_closed - t_open,
                              "aggregate": t_aggregated - t_closed})
        self.reports.append(report)
        missing = [d for d in sampled if d not in reported]
        details = ", ".join(f"{d}: {int(v['local_steps'])} steps, sigma_m^2={v['sigma_m_sq']:.4g}"
                            for d, v in sorted(reported.items()))
        self.progress(f"round {round_id}/{self.cfg.rounds}: closed by {closed_by} with {n}/"
                      f"{len(sampled)} updates in {report.wall_s:.2f} s; sigma0^2="
                      f"{report.sigma0_sq:.4g}; {details}"
                      + (f"; no answer from {', '.join(missing)}" if missing else "")
                      + (f"; rejected so far {dict(self.rejections)}" if self.rejections else ""))
        return new_state

    def run(self) -> ServerState:
        state = self.store.load_server_state()
        if state is None:
            state = self.strategy.init_server(self.cfg.initial_params.float())
            self.store.save_initial_state(state)
        elif state.global_params.numel() != self.numel:
            raise ConfigError(f"state in {self.cfg.state_dir} holds a model of "
                              f"{state.global_params.numel()} parameters, not {self.numel}")
        self.link = MqttLink(self.cfg.broker_url, f"wakefl-server-{self.cfg.fleet}",
                             max_payload=self.cfg.max_bytes)
        self.link.on_connect_hooks.append(self._on_connect)
        self.link.subscribe(topics.hello_filter(self.cfg.fleet), self._on_hello)
        self.link.subscribe(topics.uplink_filter(self.cfg.fleet), self._on_uplink)
        self.link.connect()
        try:
            self.progress(f"server for fleet '{self.cfg.fleet}' (run {self.run_id}) at "
                          f"{self.link.url.redacted()}; state {self.cfg.state_dir}; "
                          f"round {state.round_id}/{self.cfg.rounds} done")
            while state.round_id < self.cfg.rounds and not self.stop_event.is_set():
                rid = state.round_id + 1
                rec = self.store.round(rid)
                state = self._run_round(state, rid, resume=rec is not None and rec.status == "open")
            if not self.stop_event.is_set():
                final = self._build_downlink(state, state.round_id, [], time.time(), final=True)
                with self._lock:
                    self._downlink = final
                self._publish_downlink(final)
                self.progress(f"run finished after {state.round_id} rounds; end announced; "
                              f"rejections: {dict(self.rejections) or 'none'}")
            return state
        finally:
            self.link.close()
            self.store.close()
