"""The aggregation server: runs federated rounds over MQTT with a `Strategy`.

One round: sample devices (activity rate C over the registry), record the round, publish
the retained downlink, collect uplinks until every sampled device answered, the quorum
(`min_clients`) is in, or the deadline passed, aggregate with the strategy over a lazy
view of the recorded updates, persist, go on. All maths is the strategy's; this module
only moves, checks and stores messages. See docs/PROTOCOL.md.
"""

from __future__ import annotations

import json
import logging
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
    Decline,
    Downlink,
    Hello,
    MessageRejected,
    Uplink,
    decode,
    decode_as,
    encode,
    message_id,
    unpack_uplink,
)
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.sdk.selffl.rules import sampled_count
from wakefl.sdk.selffl.strategy import ClientResult, ServerState, Strategy
from wakefl.sdk.selffl.update_screening import (
    Screening,
    ScreeningRules,
    apply_scale,
    delta_norm,
    screen_updates,
)
from wakefl.sdk.served_model_gate import with_gate_schema
from wakefl.sdk.update_codec import CODECS
from wakefl.server.state_store import StateStore, UpdateView

log = logging.getLogger("wakefl.server")

# Refusal acks to one device id: a burst, then a steady rate (token bucket). A device that
# floods its topic gets no more acks than that (each refusal is still counted and logged);
# an honest device's re-send after ack_timeout_s finds the bucket refilled.
REFUSAL_ACK_BURST = 10
REFUSAL_ACKS_PER_S = 2.0
# Warning lines for refusals per device id, likewise; the rest are summarised.
REFUSAL_LOG_BURST = 20
REFUSAL_LOGS_PER_S = 1.0

# mosquitto's running count of messages dropped because a client's queue was full
# (max_queued_messages) or for other limits; readable by the server (acl.template).
BROKER_DROPPED_TOPIC = "$SYS/broker/publish/messages/dropped"


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
    wire_dtype: str = "fp32"  # the downlink's tensors (and plain uplinks, by default)
    # What devices send (announced in the downlink; sdk/update_codec.py): "" = plain in
    # wire_dtype, or fp32 / fp16 / fp16-delta / int8-delta. Any known codec is accepted.
    uplink_codec: str = ""
    max_bytes: int = DEFAULT_MAX_BYTES
    ack_timeout_s: float = 30.0
    start_timeout: float | None = None  # give up waiting for devices (None: wait forever)
    # A static registry without min_clients waits this long for every device before the
    # first round, then starts with those online (None: min(round_timeout, 60 s)).
    start_grace_s: float | None = None
    screening: ScreeningRules = field(default_factory=ScreeningRules)
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
        if self.start_grace_s is not None and self.start_grace_s < 0:
            raise ConfigError("the start grace period must be >= 0 s")
        if self.uplink_codec not in ("", *CODECS):
            raise ConfigError(f"uplink codec must be one of {CODECS}, got {self.uplink_codec!r}")
        if self.initial_params.dim() != 1 or not all_finite(self.initial_params):
            raise ConfigError("initial parameters must be a finite flat vector")


@dataclass
class RoundReport:
    round_id: int
    sampled: list[str]
    reported: dict[str, dict[str, float]]  # device -> its uplink record and num_samples
    state_summary: str  # the strategy's figures of the new state (Strategy.describe_server)
    wall_s: float
    closed_by: str  # "all" (every sampled device answered or declined), "quorum", "deadline"
    # Where the wall time went: opening (sampling, downlink encode and publish), collecting
    # (until the round closed), aggregating plus persisting the new state.
    phases_s: dict[str, float] = field(default_factory=dict)
    declined: dict[str, str] = field(default_factory=dict)  # device -> its reason
    screened: dict[str, str] = field(default_factory=dict)  # device -> clipped / refused, why


class _LazyId:
    """`message_id(payload)`, hashed only when an ack naming it is actually sent: a flood
    whose acks are withheld costs no second hash of each payload."""

    __slots__ = ("_payload", "_id")

    def __init__(self, payload: bytes) -> None:
        self._payload: bytes | None = payload
        self._id = ""

    def __str__(self) -> str:
        if self._payload is not None:
            self._id, self._payload = message_id(self._payload), None
        return self._id


class _Throttle:
    """A token bucket per key: `burst` events at once, then `rate` per second. Events
    refused are tallied per key (`take_suppressed`). Keys beyond `max_keys` share one
    bucket, so the table stays bounded whatever ids a flood uses. Thread-safe."""

    SHARED = "<other devices>"

    def __init__(self, burst: int, rate: float, max_keys: int = 1024) -> None:
        self.burst, self.rate, self.max_keys = float(burst), rate, max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)
        self._suppressed: Counter[str] = Counter()
        self._lock = threading.Lock()

    def allow(self, key: str) -> tuple[bool, int]:
        """(allowed, events suppressed for this key since its last allowed one)."""
        now = time.monotonic()
        with self._lock:
            if key not in self._buckets and len(self._buckets) >= self.max_keys:
                key = self.SHARED
            tokens, at = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            if tokens < 1.0:
                self._buckets[key] = (tokens, now)
                self._suppressed[key] += 1
                return False, 0
            self._buckets[key] = (tokens - 1.0, now)
            return True, self._suppressed.pop(key, 0)

    def take_suppressed(self) -> dict[str, int]:
        with self._lock:
            out, self._suppressed = dict(self._suppressed), Counter()
        return out


class AggregationServer:
    """`run()` drives the rounds until `config.rounds` are aggregated and announces the end.
    Thread model: paho's network thread validates and records uplinks (under `_lock`); the
    calling thread opens, closes and aggregates rounds (under the same lock)."""

    # How often the collecting loop looks at the store when no in-process event woke it.
    collect_poll_s = 0.5

    def __init__(
        self,
        config: ServerConfig,
        strategy: Strategy,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg = config
        self.strategy = strategy
        # The strategy's record plus the served-model gate's optional scalars, which a
        # device adds to its uplink (docs/SELF_FL.md, "The served-model gate").
        self._uplink_schema = with_gate_schema(strategy.uplink_schema)
        self.progress = progress or (lambda line: print(line, flush=True))
        self.store = StateStore(config.state_dir)
        self.run_id = self.store.run_id()
        self.numel = int(config.initial_params.numel())
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._open: tuple[int, set[str], float] | None = None  # round, sampled, deadline
        self._downlink: bytes | None = None
        self._base: tuple[bytes, Tensor] | None = None  # a downlink and its global model
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
        self.broker_dropped = 0  # mosquitto's $SYS count of dropped messages
        self._ack_throttle = _Throttle(REFUSAL_ACK_BURST, REFUSAL_ACKS_PER_S)
        self._log_throttle = _Throttle(REFUSAL_LOG_BURST, REFUSAL_LOGS_PER_S)
        self.acks_withheld = 0  # refusal acks not sent to a flooding device id
        self._started_rounds = False  # the start grace period applies before the first round

    # ------------------------------------------------------------------ registry
    def registry(self) -> dict[str, str]:
        reg = self.store.devices()
        if self._static:
            return {d: t for d, t in reg.items() if d in self.cfg.devices}  # type: ignore[operator]
        return reg

    # ------------------------------------------------------------------ receiving
    def _reject(
        self,
        reason: str,
        detail: str,
        device: str | None,
        round_id: int | None,
        ack_device: str | None,
        answers: str | _LazyId = "",
    ) -> None:
        """Count, log and (when the device can be identified) refuse one message. Runs on
        the network thread for every hostile message, so it never waits for the disk (the
        store commits counts in batches) and, per device id, logs and acks a flood only at
        a bounded rate: one device cannot stall the honest updates queued behind it."""
        self.rejections[reason] += 1
        try:
            self.store.count_rejection(reason, device, round_id, detail)
        except Exception:  # noqa: BLE001 - the in-memory count and the log line still stand
            log.exception("rejection of a message from %s not counted in the state store", device)
        logged, unlogged = self._log_throttle.allow(device or "<no device id>")
        if logged:
            log.warning(
                "rejected message from %s (round %s): %s: %s%s",
                device,
                round_id,
                reason,
                detail,
                f" ({unlogged} earlier refusal(s) of this device counted, not logged one by one)"
                if unlogged
                else "",
            )
        if ack_device is not None and round_id is not None:
            self._send_refusal(ack_device, round_id, False, reason, answers)

    def _send_refusal(
        self, device: str, round_id: int, accepted: bool, reason: str, answers: str | _LazyId
    ) -> None:
        """An ack that does not record anything new (a refusal, a duplicate): rate-limited
        per device id."""
        if self._ack_throttle.allow(device)[0]:
            self._send_ack(device, round_id, accepted, reason, answers)
        else:
            self.acks_withheld += 1

    def _report_throttled(self) -> None:
        unlogged = self._log_throttle.take_suppressed()
        unacked = self._ack_throttle.take_suppressed()
        if unlogged or unacked:
            log.warning(
                "refusals counted but not logged one by one: %s; refusal acks withheld "
                "from flooding device ids: %s",
                unlogged or "none",
                unacked or "none",
            )

    def _send_ack(
        self, device: str, round_id: int, accepted: bool, reason: str, answers: str | _LazyId = ""
    ) -> None:
        assert self.link is not None
        payload = encode(
            Ack(self.cfg.fleet, device, round_id, accepted, reason, answers=str(answers))
        )
        try:
            self.link.publish(topics.ack(self.cfg.fleet, device), payload, wait=False)
        except ProtocolError as exc:
            log.warning("ack to %s not sent: %s", device, exc)

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
            dev = self._topic_device(topic)
            rid = self._open[0] if self._open else None
            try:
                self._reject(
                    "internal",
                    f"{what}: {type(exc).__name__}: {str(exc)[:200]}",
                    dev,
                    rid,
                    dev if dev in self.registry() else None,
                    _LazyId(payload),
                )
            except Exception:  # noqa: BLE001 - never let the network thread die
                log.exception("could not count an internal error")

    def _topic_device(self, topic: str) -> str | None:
        try:
            _, _, dev = topics.parse(topic)
            return topics.check_name(dev or "", "device id")
        except ProtocolError:
            return None

    def _on_uplink(self, topic: str, payload: bytes) -> None:
        self._guarded("uplink", self._handle_uplink, topic, payload)

    def _on_hello(self, topic: str, payload: bytes) -> None:
        self._guarded("hello", self._handle_hello, topic, payload)

    def _handle_uplink(self, topic: str, payload: bytes) -> None:
        mid = _LazyId(payload)
        dev = self._topic_device(topic)
        registry = self.registry()
        known = dev if dev is not None and dev in registry else None
        round_hint: int | None = self._open[0] if self._open else None
        if dev is None:
            self._reject(
                "malformed",
                f"topic {topic[:200]!r} names no valid device id",
                None,
                round_hint,
                None,
            )
            return
        try:
            msg = decode(
                payload,
                max_bytes=self.cfg.max_bytes,
                expected_numel=self.numel,
                uplink_schema=self._uplink_schema,
            )
            if not isinstance(msg, Uplink | Decline):
                raise MessageRejected(
                    "wrong_kind", f"expected Uplink or Decline, got {type(msg).__name__}"
                )
        except MessageRejected as exc:
            self._reject(exc.reason, exc.detail, dev, round_hint, known, mid)
            return
        with self._lock:
            self._route_uplink(msg, payload, topic, dev, known, registry, mid)

    def _route_uplink(
        self,
        msg: Uplink | Decline,
        payload: bytes,
        topic: str,
        dev: str,
        known: str | None,
        registry: dict[str, str],
        mid: _LazyId,
    ) -> None:
        """Refuse a decoded uplink that does not belong to the open round (wrong topic,
        unknown device or device type, duplicate, stale round, not sampled), hand a decline
        to `_handle_decline`, and accept the rest. Called with the lock held."""
        rid = msg.round_id
        if msg.device_id != dev or msg.fleet != self.cfg.fleet:
            self._reject(
                "topic_mismatch",
                f"message from {msg.device_id!r} of fleet {msg.fleet!r} on topic {topic!r}",
                dev,
                rid,
                known,
                mid,
            )
        elif known is None:
            self._reject("unknown_device", f"{dev!r} is not in the registry", dev, rid, None)
        elif isinstance(msg, Decline):
            self._handle_decline(msg, mid)
        elif registry[dev] != msg.device_type:
            self._reject(
                "wrong_device_type",
                f"{dev!r} is registered as {registry[dev]!r}, sent {msg.device_type!r}",
                dev,
                rid,
                dev,
                mid,
            )
        elif msg.run_id == self.run_id and self.store.has_update(rid, dev):
            # QoS 1 redelivery or a re-send after a lost ack: on record already.
            self._reject(
                "duplicate", f"round {rid} already has an update from {dev}", dev, rid, None
            )
            self._send_refusal(dev, rid, True, "duplicate", mid)
        elif self._open is None or msg.run_id != self.run_id or rid != self._open[0]:
            open_id = self._open[0] if self._open else None
            self._reject(
                "stale_round",
                f"update for round {rid} (run {msg.run_id}); open round is {open_id}",
                dev,
                rid,
                dev,
                mid,
            )
        elif dev not in self._open[1]:
            self._reject(
                "not_sampled", f"{dev} was not sampled for round {rid}", dev, rid, dev, mid
            )
        else:
            self._accept(msg, payload, mid)

    def _accept(self, msg: Uplink, payload: bytes, mid: _LazyId) -> None:
        """Record and acknowledge an update of the open round; a packed one is first
        rebuilt from the round's global model and must match its checksum."""
        dev, rid = msg.device_id, msg.round_id
        if msg.packed is not None:
            try:
                msg = unpack_uplink(msg, self._round_base())
            except MessageRejected as exc:
                self._reject(exc.reason, exc.detail, dev, rid, dev, mid)
                return
        refused = self._record(msg, payload)
        if refused == "duplicate":
            self._reject(
                "duplicate", f"round {rid} already has an update from {dev}", dev, rid, None
            )
            self._send_refusal(dev, rid, True, "duplicate", mid)
            return
        if refused:
            self._reject(
                refused, f"round {rid} closed before the update was recorded", dev, rid, dev, mid
            )
            return
        self._send_ack(dev, rid, True, "", mid)
        log.info(
            "round %d: update from %s accepted (%s)",
            rid,
            dev,
            self.strategy.describe_result(msg.record),
        )
        self._changed.notify_all()

    def _record(self, msg: Uplink, payload: bytes) -> str:
        """Record an accepted update durably: "" once on record, else the refusal reason
        ("duplicate"). The lock already keeps the round open meanwhile."""
        return "" if self.store.record_update(msg, payload) else "duplicate"

    def _round_base(self, payload: bytes | None = None) -> Tensor:
        """The global model of a downlink (default: the current one) exactly as the devices
        decode it, the base of packed updates; decoded once per downlink."""
        payload = payload if payload is not None else self._downlink
        assert payload is not None, "no downlink published yet"
        if self._base is None or self._base[0] is not payload:
            down = decode_as(payload, Downlink, max_bytes=self.cfg.max_bytes)
            self._base = (payload, down.global_params)
        return self._base[1]

    def _handle_decline(self, msg: Decline, mid: _LazyId) -> None:
        dev, rid = msg.device_id, msg.round_id
        if self._open is None or msg.run_id != self.run_id or rid != self._open[0]:
            self._reject(
                "stale_round", f"decline for round {rid} (run {msg.run_id})", dev, rid, dev, mid
            )
        elif dev not in self._open[1]:
            self._reject(
                "not_sampled",
                f"{dev} declined round {rid} it was not sampled for",
                dev,
                rid,
                dev,
                mid,
            )
        elif self.store.has_update(rid, dev):
            self._reject(
                "duplicate",
                f"{dev} declined round {rid} after its update was recorded",
                dev,
                rid,
                None,
            )
            self._send_refusal(dev, rid, True, "duplicate", mid)
        else:
            self.store.record_decline(rid, dev, msg.reason)
            self._send_ack(dev, rid, True, "declined", mid)
            log.warning("round %d: %s declined: %s", rid, dev, msg.reason or "no reason given")
            self._changed.notify_all()

    def _handle_hello(self, topic: str, payload: bytes) -> None:
        dev = self._topic_device(topic)
        if dev is None:
            self._reject(
                "malformed",
                f"hello on topic {topic[:200]!r} names no valid device id",
                None,
                None,
                None,
            )
            return
        try:
            msg: Hello = decode_as(payload, Hello, max_bytes=1 << 20)
        except MessageRejected as exc:
            self._reject(exc.reason, f"hello: {exc.detail}", dev, None, None)
            return
        with self._lock:
            if msg.device_id != dev or msg.fleet != self.cfg.fleet:
                self._reject(
                    "topic_mismatch", f"hello from {msg.device_id!r} on {topic!r}", dev, None, None
                )
                return
            reg = self.registry()
            if dev not in reg:
                if self._static:
                    self._refuse_hello(dev, "unknown_device", f"{dev!r} is not in the fleet")
                    return
                self.store.register_device(dev, msg.device_type, "hello")
                reg[dev] = msg.device_type
            if reg[dev] != msg.device_type:
                self._refuse_hello(
                    dev,
                    "wrong_device_type",
                    f"{dev!r} says type {msg.device_type!r}, registered as {reg[dev]!r}",
                )
                return
            self.store.set_online(dev, msg.online)
            self._changed.notify_all()
        log.info("device %s (%s) %s", dev, msg.device_type, "online" if msg.online else "offline")

    def _refuse_hello(self, dev: str, reason: str, detail: str) -> None:
        """Count a refused Hello and tell the device why (an ack answering "hello", round
        0): a device the server never samples would otherwise not learn the reason."""
        self._reject(reason, f"hello: {detail}", dev, None, None)
        self._send_refusal(dev, 0, False, f"{reason}: {detail}"[:200], "hello")

    def _on_broker_dropped(self, topic: str, payload: bytes) -> None:
        """mosquitto's $SYS counter of messages it dropped (a client's queue was full, or
        its in-flight window): a dropped uplink is an update the server never sees, so the
        count is logged and kept where the operator looks."""
        try:
            total = int(payload.decode("ascii", "replace").strip() or 0)
        except ValueError:
            return
        with self._lock:
            grew = total > self.broker_dropped
            self.broker_dropped = total
        if grew:
            log.warning("the broker has dropped %d message(s) so far (queue overflow)", total)
            self.progress(
                f"warning: the broker reports {total} dropped message(s) "
                "(a client's queue overflowed; see max_queued_messages)"
            )

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

    def _build_downlink(
        self,
        state: ServerState,
        round_id: int,
        sampled: list[str],
        deadline: float,
        final: bool = False,
    ) -> bytes:
        instructions: dict[str, dict[str, float]] = {}
        shared: dict[str, Tensor] = {}
        params = state.global_params
        for dev in sampled:
            ins = self.strategy.configure_client(state, dev, round_id)
            instructions[dev] = {k: float(v) for k, v in ins.scalars.items()}
            params = ins.global_params
            for k, v in ins.tensors.items():
                if k in shared and not torch.equal(shared[k], v):
                    raise ConfigError(
                        f"strategy {self.strategy.name} sends per-device tensor "
                        f"{k!r}; protocol v1 carries shared tensors only"
                    )
                shared[k] = v
        hp = {
            "strategy": self.cfg.strategy_name,
            "strategy_args": self.cfg.strategy_args,
            "ack_timeout_s": self.cfg.ack_timeout_s,
            "wire_dtype": self.cfg.wire_dtype,
            "uplink_codec": self.cfg.uplink_codec or self.cfg.wire_dtype,
            "rounds": self.cfg.rounds,
        }
        msg = Downlink(
            fleet=self.cfg.fleet,
            run_id=self.run_id,
            round_id=round_id,
            global_params=params,
            model_config=self.cfg.model_config,
            instructions=instructions,
            hyperparameters=hp,
            deadline=deadline,
            final=final,
            strategy=self.strategy.name,
            tensors=shared,
        )
        return encode(msg, wire_dtype=self.cfg.wire_dtype, max_bytes=self.cfg.max_bytes)

    # ------------------------------------------------------------------ rounds
    def _sample(self, round_id: int, online: list[str], registry_size: int) -> list[str]:
        """The round's devices: `rules.sampled_count` (floor(C M), at least 1) of the
        registry, raised to the quorum, drawn among the devices online."""
        k = max(
            sampled_count(self.cfg.activity_rate, max(1, registry_size)), self.cfg.min_clients or 0
        )
        rng = random.Random(f"{self.run_id}:{self.cfg.seed}:{round_id}")
        return sorted(rng.sample(online, min(k, len(online))))

    def _wait_for_devices(self) -> list[str]:
        """Online registered devices, once enough are there. `--min-clients` is the number
        needed; without it a static registry waits for all its devices only during the start
        grace period before the first round (one device that never comes online must not
        stop the fleet), and otherwise one online device is enough."""
        grace = (
            self.cfg.start_grace_s
            if self.cfg.start_grace_s is not None
            else min(self.cfg.round_timeout, 60.0)
        )
        start = time.monotonic()
        last_note = 0.0
        while not self.stop_event.is_set():
            reg = self.registry()
            online = [d for d in self.store.online_devices() if d in reg]
            if self.cfg.min_clients is not None:
                need = self.cfg.min_clients
            elif self._static and not self._started_rounds and time.monotonic() - start < grace:
                need = len(reg)
            else:
                need = 1
            if len(online) >= max(1, need):
                self._started_rounds = True
                return online
            if time.monotonic() - last_note > 10:
                self.progress(f"waiting for devices: {len(online)}/{need} online")
                last_note = time.monotonic()
            if (
                self.cfg.start_timeout is not None
                and time.monotonic() - start > self.cfg.start_timeout
            ):
                raise ConfigError(
                    f"only {len(online)} of the {need} devices needed came online "
                    f"within {self.cfg.start_timeout:.0f} s"
                )
            with self._changed:
                self._changed.wait(0.5)
        return []

    def _collect(self, round_id: int, sampled: list[str], deadline: float) -> str:
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
                n = self.store.count_updates(round_id)
                declined = len(self.store.declines(round_id))
                if n + declined >= len(sampled):
                    return "all"
                # a device that declined will not send: the quorum shrinks with it
                if n >= max(1, min(self.cfg.min_clients or len(sampled), len(sampled) - declined)):
                    return "quorum"
                remaining = deadline - time.time()
                if remaining <= 0:
                    return "deadline"
                self._changed.wait(min(remaining, self.collect_poll_s))
        return "stopped"

    def _screen(
        self, round_id: int, view: UpdateView, global_params: Tensor
    ) -> tuple[list[dict], Screening]:
        """Apply docs/PROTOCOL.md's robust-aggregation rules (sdk/selffl/update_screening.py)
        to the round's recorded updates: one extra read of each update file."""
        norms = [delta_norm(res.params, global_params) for res in view]
        return view.rows, self._screen_norms(round_id, view.rows, norms, global_params)

    def _screen_norms(
        self, round_id: int, rows: list[dict], norms: list[float], global_params: Tensor
    ) -> Screening:
        """Screening from the updates' distances to the global model and the variances
        of their recorded rows; refused updates are counted and logged."""
        key = self.strategy.screened_variance
        sigmas = [
            float(json.loads(row["record"]).get(key, 0.0)) if key is not None else 0.0
            for row in rows
        ]
        prev = self.store.get_meta("screening_reference") or {}
        screening = screen_updates(
            norms,
            sigmas,
            float(torch.linalg.vector_norm(global_params.double())),
            self.cfg.screening,
            previous_norm=prev.get("norm"),
            previous_sigma_sq=prev.get("sigma_sq"),
        )
        if len(norms) >= self.cfg.screening.min_reference_updates:
            self.store.set_meta(
                screening_reference={
                    "norm": screening.reference_norm,
                    "sigma_sq": screening.reference_sigma_sq,
                }
            )
        for row, v in zip(rows, screening.verdicts, strict=True):
            if v.action == "refuse":
                self._reject("outlier", v.reason, row["device_id"], round_id, None)
            elif v.action == "clip":
                log.warning("round %d: update from %s %s", round_id, row["device_id"], v.reason)
        return screening

    def _run_round(self, state: ServerState, round_id: int, resume: bool) -> ServerState:
        t0 = time.monotonic()
        opened = self._open_round(state, round_id, resume)
        if opened is None:
            return state
        sampled, deadline = opened
        t_open = time.monotonic()
        closed_by = self._collect(round_id, sampled, deadline)
        if closed_by == "stopped":
            return state
        t_closed = time.monotonic()
        with self._lock:  # no update can be recorded for this round from here on
            self._open = None
            self._seal_round(round_id)
            downlink = self._downlink
            view = self.store.updates(
                round_id, self.numel, self.cfg.max_bytes, base=lambda: self._round_base(downlink)
            )
            declined = self.store.declines(round_id)
        new_state, rows, screened = self._aggregate_round(state, round_id, view)
        self.store.close_round(round_id, new_state)
        self.store.flush_rejections()  # the round's refusals on disk with the round
        self._report_throttled()
        t_aggregated = time.monotonic()
        self.store.prune_update_files(round_id - self.cfg.keep_update_rounds + 1)
        reported = {
            r["device_id"]: {**json.loads(r["record"]), "num_samples": r["num_samples"]}
            for r in rows
        }
        report = RoundReport(
            round_id,
            sampled,
            reported,
            self.strategy.describe_server(new_state),
            time.monotonic() - t0,
            closed_by,
            {
                "open": t_open - t0,
                "collect": t_closed - t_open,
                "aggregate": t_aggregated - t_closed,
            },
            declined,
            screened,
        )
        self.reports.append(report)
        self._report_round(report)
        return new_state

    def _seal_round(self, round_id: int) -> None:
        """Called with the lock held once the round stopped collecting, before its updates
        are read: one process needs nothing more (its lock keeps uplinks out)."""

    def _open_round(
        self, state: ServerState, round_id: int, resume: bool
    ) -> tuple[list[str], float] | None:
        """Sample (or resume) the round, record it and publish its downlink; the sampled
        devices and the deadline, None when the server was stopped meanwhile."""
        if resume:
            rec = self.store.round(round_id)
            assert rec is not None
            sampled = rec.sampled
            if self._open is not None and self._open[0] == round_id:
                deadline = self._open[2]  # reopened by run() before any message was handled
            else:
                deadline = time.time() + self.cfg.round_timeout
                self.store.extend_deadline(round_id, deadline)
            self.progress(
                f"round {round_id}/{self.cfg.rounds}: resumed with {rec.accepted}/"
                f"{len(sampled)} updates on record"
            )
        else:
            online = self._wait_for_devices()
            if self.stop_event.is_set():
                return None
            deadline = time.time() + self.cfg.round_timeout
            sampled = self._sample(round_id, online, len(self.registry()))
            self.store.open_round(round_id, sampled, deadline)
        payload = self._build_downlink(state, round_id, sampled, deadline)
        with self._lock:
            self._open = (round_id, set(sampled), deadline)
            self._downlink = payload
            self._republish = False
        self._publish_downlink(payload)
        if not resume:
            self.progress(
                f"round {round_id}/{self.cfg.rounds}: sampled {len(sampled)} "
                f"({', '.join(sampled)}), deadline in {self.cfg.round_timeout:.0f} s"
            )
        return sampled, deadline

    def _aggregate_round(
        self, state: ServerState, round_id: int, view: UpdateView
    ) -> tuple[ServerState, list[dict], dict[str, str]]:
        """Screen the round's updates and aggregate those kept: the new state, the rows of
        the updates kept, and the clipped or refused devices with why."""
        if not len(view):
            return self.strategy.skip_round(state), [], {}
        all_rows, screening = self._screen(round_id, view, state.global_params)
        keep = ScreenedUpdates(
            view, screening, state.global_params, self.strategy.screened_variance
        )
        screened = {
            r["device_id"]: f"{v.action}: {v.reason}"
            for r, v in zip(all_rows, screening.verdicts, strict=True)
            if v.action != "keep"
        }
        if not keep.rows:
            return self.strategy.skip_round(state), [], screened
        rate = self.strategy.activity_share(len(keep.rows), len(self.registry()))
        return self.strategy.aggregate(state, keep, rate), keep.rows, screened

    def _report_round(self, report: RoundReport) -> None:
        reported, declined, screened = report.reported, report.declined, report.screened
        missing = [
            d
            for d in report.sampled
            if d not in reported and d not in declined and d not in screened
        ]
        details = ", ".join(
            f"{d}: {self.strategy.describe_result(v)}" for d, v in sorted(reported.items())
        )
        summary = f"{report.state_summary}; " if report.state_summary else ""
        self.progress(
            f"round {report.round_id}/{self.cfg.rounds}: closed by {report.closed_by} "
            f"with {len(reported)}/{len(report.sampled)} updates in "
            f"{report.wall_s:.2f} s; {summary}{details}"
            + (f"; declined: {', '.join(sorted(declined))}" if declined else "")
            + (f"; screened: {screened}" if screened else "")
            + (f"; no answer from {', '.join(missing)}" if missing else "")
            + (f"; rejected so far {dict(self.rejections)}" if self.rejections else "")
        )

    def _reopen_interrupted_round(self, state: ServerState) -> None:
        """Reopen the round a killed server left open BEFORE subscribing: the broker hands
        over the updates queued in the server's session as soon as it connects, and they
        must find their round open (else they are refused as stale and the devices drop
        them)."""
        rid = state.round_id + 1
        rec = self.store.round(rid)
        if rec is None or rec.status != "open" or rid > self.cfg.rounds:
            return
        deadline = time.time() + self.cfg.round_timeout
        self.store.extend_deadline(rid, deadline)
        with self._lock:
            self._open = (rid, set(rec.sampled), deadline)

    def _subscribe(self, link: MqttLink) -> None:
        """The server's subscriptions: devices' hellos and uplinks, the broker's drops."""
        link.subscribe(topics.hello_filter(self.cfg.fleet), self._on_hello)
        link.subscribe(topics.uplink_filter(self.cfg.fleet), self._on_uplink)
        # QoS 0: a counter the broker republishes every sys_interval (10 s by default).
        link.subscribe(BROKER_DROPPED_TOPIC, self._on_broker_dropped, qos=0)

    def run(self) -> ServerState:
        state = self.store.load_server_state()
        if state is None:
            state = self.strategy.init_server(self.cfg.initial_params.float())
            self.store.save_initial_state(state)
        elif state.global_params.numel() != self.numel:
            raise ConfigError(
                f"state in {self.cfg.state_dir} holds a model of "
                f"{state.global_params.numel()} parameters, not {self.numel}"
            )
        self._reopen_interrupted_round(state)
        self.link = MqttLink(
            self.cfg.broker_url,
            f"wakefl-server-{self.cfg.fleet}",
            max_payload=self.cfg.max_bytes,
            resubscribe=True,  # the session may come from the other role (sharded or not)
        )
        self.link.on_connect_hooks.append(self._on_connect)
        self._subscribe(self.link)
        self.link.connect()
        try:
            self.progress(
                f"server for fleet '{self.cfg.fleet}' (run {self.run_id}) at "
                f"{self.link.url.redacted()}; state {self.cfg.state_dir}; "
                f"round {state.round_id}/{self.cfg.rounds} done"
            )
            while state.round_id < self.cfg.rounds and not self.stop_event.is_set():
                rid = state.round_id + 1
                rec = self.store.round(rid)
                state = self._run_round(state, rid, resume=rec is not None and rec.status == "open")
            if not self.stop_event.is_set():
                final = self._build_downlink(state, state.round_id, [], time.time(), final=True)
                with self._lock:
                    self._downlink = final
                self._publish_downlink(final)
                self.progress(
                    f"run finished after {state.round_id} rounds; end announced; "
                    f"rejections: {dict(self.rejections) or 'none'}"
                )
            return state
        finally:
            self.link.close()
            self._report_throttled()
            self.store.close()


class ScreenedUpdates:
    """A round's recorded updates after screening, as the strategy's lazy update view:
    refused updates left out, clipped ones scaled back towards the global model, every
    reported variance (the strategy's `screened_variance`) raised to the round's floor. Re-iterable, one update in memory at a time."""

    def __init__(
        self,
        view: UpdateView,
        screening: Screening,
        global_params: Tensor,
        variance: str | None = None,
    ) -> None:
        self._view = view
        self._global = global_params
        self._variance = variance  # the record entry raised to the round's floor
        pairs = list(zip(view.rows, screening.verdicts, strict=True))
        self._verdicts = {r["device_id"]: v for r, v in pairs}
        self.rows = [r for r, v in pairs if v.action != "refuse"]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        for res in self._view:
            v = self._verdicts[res.client_id]
            if v.action == "refuse":
                continue
            scalars = dict(res.scalars)
            if self._variance is not None:
                scalars[self._variance] = v.sigma_sq
            yield ClientResult(
                client_id=res.client_id,
                round_id=res.round_id,
                params=apply_scale(res.params, self._global, v.scale),
                num_samples=res.num_samples,
                scalars=scalars,
                tensors=res.tensors,
                group=res.group,
            )
