"""Round running: sample, record the round, publish its retained downlink, collect until
every sampled device answered, the quorum is in or the deadline passed, aggregate (with
the role's aggregation), persist, report; resume a round a killed server left open.

The single-process server and the sharded coordinator run rounds with this same part;
they differ in how a round is aggregated (`aggregate`), whether it is sealed in the store
before its updates are read (`seal`), and what they subscribe to (`subscribe`).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Mapping

from wakefl.errors import ConfigError, ProtocolError
from wakefl.protocol import topics
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.sdk.selffl.rules import sampled_count
from wakefl.sdk.selffl.strategy import ServerState, Strategy
from wakefl.server.admission import OpenRound
from wakefl.server.aggregation import Aggregated
from wakefl.server.downlink import build_downlink
from wakefl.server.ingest import Ingest
from wakefl.server.recorded_updates import UpdateView
from wakefl.server.round_receipts import RoundReceipts
from wakefl.server.server_config import RoundReport
from wakefl.server.server_session import ServerSession

log = logging.getLogger("wakefl.server")

Aggregate = Callable[[ServerState, int, UpdateView], Aggregated]


class RoundRunner:
    """`run()` drives the rounds until `config.rounds` are aggregated and announces the end.
    Thread model: paho's network thread validates and records uplinks (`Ingest`, under the
    session's lock); the calling thread opens, closes and aggregates rounds (same lock)."""

    def __init__(
        self,
        session: ServerSession,
        strategy: Strategy,
        ingest: Ingest,
        aggregate: Aggregate,
        subscribe: Callable[[MqttLink], None],
        *,
        seal: Callable[[int], None] | None = None,
        published: Callable[[int, bytes], None] | None = None,
        rejections: Callable[[], Mapping[str, int]] | None = None,
        collect_poll_s: float = 0.5,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.s = session
        self.strategy = strategy
        self.ingest = ingest
        self._aggregate = aggregate
        self._subscribe = subscribe
        self._seal = seal  # no update may be recorded for the round once this returned
        self._published = published  # called with each round's downlink before publishing
        self._rejections = rejections or (lambda: ingest.rejections)
        # How often the collecting loop looks at the store when no in-process event woke it.
        self.collect_poll_s = collect_poll_s
        self._on_close = on_close  # before the link and the store close
        self.reports: list[RoundReport] = []
        self._started_rounds = False  # the start grace period applies before the first round
        self._waited_s = 0.0  # the open round's wait for devices to come online

    def _on_connect(self, session_present: bool) -> None:
        with self.s.lock:
            self.s.republish = True  # the broker may have lost the retained downlink
            self.s.changed.notify_all()

    # ------------------------------------------------------------------ sending
    def _publish_downlink(self, payload: bytes) -> None:
        """Retained, QoS 1, retried until the broker took it (it may be restarting)."""
        assert self.s.link is not None
        while not self.s.stop_event.is_set():
            try:
                self.s.link.publish(
                    topics.downlink(self.s.cfg.fleet), payload, retain=True, timeout=30
                )
                return
            except ProtocolError as exc:
                log.warning("downlink not published yet (%s); retrying", exc)
                self.s.link.wait_connected(5)

    def _build_downlink(
        self,
        state: ServerState,
        round_id: int,
        sampled: list[str],
        deadline: float,
        final: bool = False,
    ) -> bytes:
        payload = build_downlink(self.s, self.strategy, state, round_id, sampled, deadline, final)
        if not final and self._published is not None:
            self._published(round_id, payload)
        return payload

    # ------------------------------------------------------------------ rounds
    def _sample(self, round_id: int, online: list[str], registry_size: int) -> list[str]:
        """The round's devices: `rules.sampled_count` (floor(C M), at least 1) of the
        registry, raised to the quorum, drawn among the devices online."""
        k = max(
            sampled_count(self.s.cfg.activity_rate, max(1, registry_size)),
            self.s.cfg.min_clients or 0,
        )
        rng = random.Random(f"{self.s.run_id}:{self.s.cfg.seed}:{round_id}")
        return sorted(rng.sample(online, min(k, len(online))))

    def _wait_for_devices(self) -> list[str]:
        """Online registered devices, once enough are there. `--min-clients` is the number
        needed; without it a static registry waits for all its devices only during the start
        grace period before the first round (one device that never comes online must not
        stop the fleet), and otherwise one online device is enough."""
        grace = (
            self.s.cfg.start_grace_s
            if self.s.cfg.start_grace_s is not None
            else min(self.s.cfg.round_timeout, 60.0)
        )
        start = time.monotonic()
        last_note = 0.0
        while not self.s.stop_event.is_set():
            reg = self.s.registry()
            online = [d for d in self.s.store.online_devices() if d in reg]
            if self.s.cfg.min_clients is not None:
                need = self.s.cfg.min_clients
            elif self.s.static and not self._started_rounds and time.monotonic() - start < grace:
                need = len(reg)
            else:
                need = 1
            if len(online) >= max(1, need):
                self._started_rounds = True
                return online
            if time.monotonic() - last_note > 10:
                self.s.progress(f"waiting for devices: {len(online)}/{need} online")
                last_note = time.monotonic()
            if (
                self.s.cfg.start_timeout is not None
                and time.monotonic() - start > self.s.cfg.start_timeout
            ):
                raise ConfigError(
                    f"only {len(online)} of the {need} devices needed came online "
                    f"within {self.s.cfg.start_timeout:.0f} s"
                )
            with self.s.changed:
                self.s.changed.wait(0.5)
        return []

    def _collect(self, round_id: int, sampled: list[str], deadline: float) -> str:
        with self.s.changed:
            while not self.s.stop_event.is_set():
                if self.s.republish and self.s.downlink is not None:
                    self.s.republish = False
                    payload = self.s.downlink
                    self.s.changed.release()
                    try:
                        self._publish_downlink(payload)
                    finally:
                        self.s.changed.acquire()
                # Counted without the session's lock: the store's waits for a commit's fsync.
                self.s.changed.release()
                try:
                    n = self.s.store.count_updates(round_id)
                    declined = len(self.s.store.declines(round_id))
                finally:
                    self.s.changed.acquire()
                if n + declined >= len(sampled):
                    return "all"
                # a device that declined will not send: the quorum shrinks with it
                if n >= max(
                    1, min(self.s.cfg.min_clients or len(sampled), len(sampled) - declined)
                ):
                    return "quorum"
                remaining = deadline - time.time()
                if remaining <= 0:
                    return "deadline"
                self.s.changed.wait(min(remaining, self.collect_poll_s))
        return "stopped"

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
        # No update can be admitted (lock) or committed (commit_lock) for this round from here on.
        with self.s.lock, self.s.commit_lock:
            self.s.open_round = None
            if self._seal is not None:
                self._seal(round_id)
            downlink = self.s.downlink
            view = self.s.store.updates(
                round_id,
                self.s.numel,
                self.s.cfg.max_bytes,
                base=lambda: self.s.round_base(downlink),
            )
            declined = self.s.store.declines(round_id)
        new_state, rows, screened = self._aggregate(state, round_id, view)
        self.s.store.close_round(round_id, new_state)
        self.s.store.flush_rejections()  # the round's refusals on disk with the round
        self.ingest.report_throttled()
        t_aggregated = time.monotonic()
        self.s.store.prune_update_files(round_id - self.s.cfg.keep_update_rounds + 1)
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
                "wait": self._waited_s,
                "open": t_open - t0 - self._waited_s,
                "collect": t_closed - t_open,
                "aggregate": t_aggregated - t_closed,
            },
            declined,
            screened,
        )
        self.reports.append(report)
        self._report_round(report)
        return new_state

    def _open_round(
        self, state: ServerState, round_id: int, resume: bool
    ) -> tuple[list[str], float] | None:
        """Sample (or resume) the round, record it and publish its downlink; the sampled
        devices and the deadline, None when the server was stopped meanwhile."""
        self._waited_s = 0.0
        if resume:
            rec = self.s.store.round(round_id)
            assert rec is not None
            sampled = rec.sampled
            held = self.s.open_round
            if held is not None and held.round_id == round_id:
                deadline = held.deadline  # reopened by run() before any message was handled
            else:
                deadline = time.time() + self.s.cfg.round_timeout
                self.s.store.extend_deadline(round_id, deadline)
            self.s.progress(
                f"round {round_id}/{self.s.cfg.rounds}: resumed with {rec.accepted}/"
                f"{len(sampled)} updates on record"
            )
        else:
            t_wait = time.monotonic()
            online = self._wait_for_devices()
            self._waited_s = time.monotonic() - t_wait
            if self.s.stop_event.is_set():
                return None
            deadline = time.time() + self.s.cfg.round_timeout
            sampled = self._sample(round_id, online, len(self.s.registry()))
            self.s.store.open_round(round_id, sampled, deadline)
        payload = self._build_downlink(state, round_id, sampled, deadline)
        with self.s.lock:
            self.s.open_round = OpenRound.of(round_id, sampled, deadline)
            self.s.receipts = RoundReceipts(round_id, state.global_params)
            self.s.downlink = payload
            self.s.republish = False
        self._publish_downlink(payload)
        if not resume:
            self.s.progress(
                f"round {round_id}/{self.s.cfg.rounds}: sampled {len(sampled)} "
                f"({', '.join(sampled)}), deadline in {self.s.cfg.round_timeout:.0f} s"
            )
        return sampled, deadline

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
        self.s.progress(
            f"round {report.round_id}/{self.s.cfg.rounds}: closed by {report.closed_by} "
            f"with {len(reported)}/{len(report.sampled)} updates {report.time_words()}; "
            f"{summary}{details}"
            + (f"; declined: {', '.join(sorted(declined))}" if declined else "")
            + (f"; screened: {screened}" if screened else "")
            + (f"; no answer from {', '.join(missing)}" if missing else "")
            + (f"; rejected so far {dict(self._rejections())}" if self._rejections() else "")
        )

    def _reopen_interrupted_round(self, state: ServerState) -> None:
        """Reopen the round a killed server left open BEFORE subscribing: the broker hands
        over the updates queued in the server's session as soon as it connects, and they
        must find their round open (else they are refused as stale and the devices drop
        them)."""
        rid = state.round_id + 1
        rec = self.s.store.round(rid)
        if rec is None or rec.status != "open" or rid > self.s.cfg.rounds:
            return
        deadline = time.time() + self.s.cfg.round_timeout
        self.s.store.extend_deadline(rid, deadline)
        with self.s.lock:
            self.s.open_round = OpenRound.of(rid, rec.sampled, deadline)
            self.s.receipts = RoundReceipts(rid, state.global_params)

    def run(self) -> ServerState:
        state = self.s.store.load_server_state()
        if state is None:
            state = self.strategy.init_server(self.s.cfg.initial_params.float())
            self.s.store.save_initial_state(state)
        elif state.global_params.numel() != self.s.numel:
            raise ConfigError(
                f"state in {self.s.cfg.state_dir} holds a model of "
                f"{state.global_params.numel()} parameters, not {self.s.numel}"
            )
        self._reopen_interrupted_round(state)
        self.s.link = MqttLink(
            self.s.cfg.broker_url,
            f"wakefl-server-{self.s.cfg.fleet}",
            max_payload=self.s.cfg.max_bytes,
            resubscribe=True,  # the session may come from the other role (sharded or not)
            manual_ack=True,  # an update's PUBACK waits until it is on record
        )
        self.s.link.on_connect_hooks.append(self._on_connect)
        self._subscribe(self.s.link)
        self.s.link.connect()
        try:
            self.s.progress(
                f"server for fleet '{self.s.cfg.fleet}' (run {self.s.run_id}) at "
                f"{self.s.link.url.redacted()}; state {self.s.cfg.state_dir}; "
                f"round {state.round_id}/{self.s.cfg.rounds} done"
            )
            while state.round_id < self.s.cfg.rounds and not self.s.stop_event.is_set():
                rid = state.round_id + 1
                rec = self.s.store.round(rid)
                state = self._run_round(state, rid, resume=rec is not None and rec.status == "open")
            if not self.s.stop_event.is_set():
                final = self._build_downlink(state, state.round_id, [], time.time(), final=True)
                with self.s.lock:
                    self.s.downlink = final
                self._publish_downlink(final)
                self.s.progress(
                    f"run finished after {state.round_id} rounds; end announced; "
                    f"rejections: {dict(self._rejections()) or 'none'}"
                )
            return state
        finally:
            if self._on_close is not None:
                self._on_close()
            self.s.link.close()
            self.ingest.report_throttled()
            self.s.store.close()
