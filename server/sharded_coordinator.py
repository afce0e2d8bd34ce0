"""The coordinator of a sharded server (`wakefl server --role coordinator`).

It runs the rounds with the single-process server's parts (server/round_runner.py:
sampling, the retained downlink, quorum and deadline, SIGKILL resume; server/ingest.py for
hellos), but records no uplink: the
aggregation workers (server/aggregation_worker.py) do, in the state folder they share with
it. At round close it seals the round in the store (no worker can record, hence
acknowledge, an update the aggregation would miss), then merges the workers' partial sums
in three passes (server/partial_aggregate.py): each update's distance for screening,
Eqn 14's spread of the screened models, Eqn 11's weighted sum given sigma0^2. The passes
are spread over the workers online; a pass whose worker died (its will clears its status)
or does not answer within `task_timeout_s` goes to another worker, or, with none left, is
computed by the coordinator itself from the same recorded files. No acknowledged update
is lost with a worker.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable

from torch import Tensor

from wakefl.errors import ConfigError
from wakefl.protocol import topics
from wakefl.protocol.messages import Uplink
from wakefl.sdk.atomic_files import write_atomic
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.sdk.selffl.strategy import ServerState, Strategy
from wakefl.server.aggregation import Aggregated, screen_norms, screened_devices
from wakefl.server.aggregation_server import BROKER_DROPPED_TOPIC
from wakefl.server.ingest import Ingest
from wakefl.server.partial_aggregate import (
    merge_spreads,
    merge_sums,
    reported_uncertainties,
    require_shardable,
)
from wakefl.server.recorded_updates import UpdateView
from wakefl.server.round_runner import RoundRunner
from wakefl.server.server_config import RoundReport, ServerConfig
from wakefl.server.server_session import ServerSession
from wakefl.server.shard_tasks import ShardReader, ShardResult, ShardTask, downlink_file

log = logging.getLogger("wakefl.server.coordinator")

# One pass item: (recorded file, clip scale, sigma_m^2 for Eqn 11).
Item = tuple[str, float, float]


class ShardedCoordinator:
    """`run()` drives the rounds; their updates come from the workers' records, their
    aggregation from the workers' partial sums."""

    # Passes within this long of connecting wait for a worker's retained status to arrive
    # before the coordinator does them itself.
    worker_wait_s = 2.0

    def __init__(
        self,
        config: ServerConfig,
        strategy: Strategy,
        progress: Callable[[str], None] | None = None,
        task_timeout_s: float | None = None,
    ) -> None:
        self.selffl = require_shardable(strategy)
        self.cfg = config
        self.strategy = strategy
        # Its workers write the update files, each a new one (server/aggregation_worker.py):
        # spares of pruned rounds would never be written over here.
        self.session = ServerSession(config, progress, spare_files=0)
        self.store = self.session.store
        self.stop_event = self.session.stop_event
        self.ingest = Ingest(self.session, strategy, _records_nothing)
        self.runner = RoundRunner(
            self.session,
            strategy,
            self.ingest,
            self._aggregate_round,
            self._subscribe,
            seal=lambda rid: self.store.set_round_status(rid, "sealed"),
            published=self._keep_downlink,
            rejections=self._rejections,
            # Updates are recorded by other processes, which cannot wake this one's condition.
            collect_poll_s=0.05,
        )
        self.task_timeout_s = task_timeout_s or max(60.0, config.round_timeout)
        self._agg = threading.Condition()
        self._workers: set[str] = set()
        self._results: dict[str, ShardResult] = {}
        self._reader = ShardReader(
            self.store.root, self.session.numel, config.max_bytes, "coordinator"
        )
        self._connected_at = 0.0
        self.passes_reassigned = 0  # passes handed on from a dead or silent worker
        self.passes_local = 0  # passes the coordinator computed itself

    def run(self) -> ServerState:
        # A round left sealed was being aggregated when the coordinator was killed: it is
        # resumed as an open round (its recorded updates stay).
        self.store.unseal_rounds()
        return self.runner.run()

    @property
    def reports(self) -> list[RoundReport]:
        return self.runner.reports

    @property
    def rejections(self) -> Counter[str]:
        return self.ingest.rejections

    @property
    def link(self) -> MqttLink | None:
        return self.session.link

    def _rejections(self) -> Counter[str]:
        """The workers count their refusals in the shared store, not in this process."""
        self.store.flush_rejections()
        self.ingest.rejections = Counter(self.store.rejection_counts())
        return self.ingest.rejections

    # ------------------------------------------------------------------ messages
    def _subscribe(self, link: MqttLink) -> None:
        link.subscribe(topics.hello_filter(self.cfg.fleet), self.ingest.on_hello)
        link.subscribe(BROKER_DROPPED_TOPIC, self.ingest.on_broker_dropped, qos=0)
        link.subscribe(topics.agg_worker_filter(self.cfg.fleet), self._on_worker)
        link.subscribe(topics.agg_result(self.cfg.fleet), self._on_result)
        link.on_connect_hooks.append(self._connected)

    def _connected(self, session_present: bool) -> None:
        """A session kept from a single-process server still subscribes the uplinks: the
        workers take them, not the coordinator."""
        self._connected_at = time.monotonic()
        if session_present and self.link is not None:
            self.link.unsubscribe(topics.uplink_filter(self.cfg.fleet))

    def _on_worker(self, topic: str, payload: bytes) -> None:
        wid = topic.rsplit("/", 1)[-1]
        try:
            online = bool(payload) and bool(json.loads(payload).get("online"))
        except (ValueError, AttributeError):
            online = False
        with self._agg:
            (self._workers.add if online else self._workers.discard)(wid)
            self._agg.notify_all()
        log.info("aggregation worker %s %s", wid, "online" if online else "gone")

    def _on_result(self, topic: str, payload: bytes) -> None:
        try:
            result = ShardResult.decode(payload)
        except ConfigError as exc:
            log.warning("shard result refused: %s", exc)
            return
        with self._agg:
            self._results[result.task_id] = result
            self._agg.notify_all()

    def workers(self) -> list[str]:
        with self._agg:
            return sorted(self._workers)

    # ------------------------------------------------------------------ rounds
    def _keep_downlink(self, round_id: int, payload: bytes) -> None:
        """The round's downlink, kept in the state folder before it is published: the
        workers decode packed updates against it."""
        models = self.store.root / "models"
        write_atomic(models / downlink_file(round_id), payload)
        for old in models.glob("downlink_r*.wkfl"):
            if old.name < downlink_file(round_id - self.cfg.keep_update_rounds):
                old.unlink(missing_ok=True)

    def _aggregate_round(self, state: ServerState, round_id: int, view: UpdateView) -> Aggregated:
        """`LocalAggregation` (server/aggregation.py) from the workers' partial sums."""
        if not len(view):
            return self.strategy.skip_round(state), [], {}
        rows = view.rows
        ctx = (round_id, self.store.get_meta("state_file"), downlink_file(round_id))
        parts = self._gather("norms", ctx, [(r["path"], 1.0, 0.0) for r in rows])
        norms = [n for p in parts for n in p.norms]
        screening = screen_norms(
            self.session,
            self.strategy,
            round_id,
            rows,
            norms,
            state.global_params,
            self.ingest.carry_out,
        )
        kept = [
            (r, v) for r, v in zip(rows, screening.verdicts, strict=True) if v.action != "refuse"
        ]
        screened = screened_devices(rows, screening)
        if not kept:
            return self.strategy.skip_round(state), [], screened
        rate = self.strategy.activity_share(len(kept), len(self.session.registry()))
        reported = reported_uncertainties(
            [r for r, _ in kept], [v for _, v in kept], self.strategy.screened_variance
        )
        parts = self._gather("spread", ctx, [(r["path"], v.scale, 0.0) for r, v in kept])
        spread = merge_spreads(p.spread for p in parts if p.spread is not None)

        def theta_hat(sigma0_sq: float, sigmas: list[float]) -> Tensor:
            items = [(r["path"], v.scale, s) for (r, v), s in zip(kept, sigmas, strict=True)]
            sums = self._gather("sum", ctx, items, sigma0_sq)
            return merge_sums(p.psum for p in sums if p.psum is not None).mean(
                "aggregated parameters"
            )

        new_state = self.selffl.combine(state, reported, spread.value, theta_hat, rate)
        return new_state, [r for r, _ in kept], screened

    # ------------------------------------------------------------------ passes
    def _gather(
        self, phase: str, ctx: tuple[int, str, str], items: list[Item], sigma0_sq: float = 0.0
    ) -> list[ShardResult]:
        """One pass over `items`, split in contiguous chunks over the workers online; the
        chunks' results in order."""
        with self._agg:
            self._results.clear()  # late answers of earlier passes
            # Just connected, the workers' retained statuses may not be here yet.
            wait = self._connected_at + self.worker_wait_s - time.monotonic()
            self._agg.wait_for(lambda: bool(self._workers), max(0.0, wait))
        workers = self.workers()
        n = max(1, min(len(workers), len(items)))
        bounds = [len(items) * i // n for i in range(n + 1)]
        chunks = [items[bounds[i] : bounds[i + 1]] for i in range(n)]
        tasks = [self._task(phase, ctx, chunk, sigma0_sq) for chunk in chunks]
        out: list[ShardResult | None] = [None] * n
        pending: dict[int, tuple[str, float]] = {}  # chunk -> (worker, sent at)
        for i in range(n):
            self._dispatch(i, tasks, out, pending, workers[i] if workers else None)
        while pending:
            with self._agg:
                self._agg.wait(0.1)
            self._take_results(tasks, out, pending)
            self._hand_on(tasks, out, pending)
        return [r for r in out if r is not None]

    @staticmethod
    def _task(phase: str, ctx: tuple[int, str, str], chunk: list[Item], s0: float) -> ShardTask:
        return ShardTask(
            task_id=uuid.uuid4().hex,
            round_id=ctx[0],
            phase=phase,
            paths=[p for p, _, _ in chunk],
            state_file=ctx[1],
            downlink_file=ctx[2],
            scales=[s for _, s, _ in chunk],
            sigmas=[s for _, _, s in chunk],
            sigma0_sq=s0,
        )

    def _dispatch(
        self,
        i: int,
        tasks: list[ShardTask],
        out: list[ShardResult | None],
        pending: dict[int, tuple[str, float]],
        worker: str | None,
    ) -> None:
        """Send chunk `i` to `worker`, or compute it here when there is none."""
        if worker is None:
            self.passes_local += 1
            result = self._reader.run(tasks[i])
            if result.error:
                raise ConfigError(f"round {tasks[i].round_id}: {result.error}")
            out[i] = result
            return
        assert self.link is not None
        pending[i] = (worker, time.monotonic())
        self.link.publish(topics.agg_task(self.cfg.fleet, worker), tasks[i].encode())

    def _take_results(
        self,
        tasks: list[ShardTask],
        out: list[ShardResult | None],
        pending: dict[int, tuple[str, float]],
    ) -> None:
        with self._agg:
            done = {
                i: self._results.pop(tasks[i].task_id)
                for i in list(pending)
                if tasks[i].task_id in self._results
            }
        for i, result in done.items():
            if result.error:
                raise ConfigError(
                    f"round {tasks[i].round_id}: worker {result.worker}: {result.error}"
                )
            out[i] = result
            del pending[i]

    def _hand_on(
        self,
        tasks: list[ShardTask],
        out: list[ShardResult | None],
        pending: dict[int, tuple[str, float]],
    ) -> None:
        """Give the chunks of a worker that died or stays silent to another (or do them
        here): their updates are on record in the shared folder, whoever recorded them."""
        live = self.workers()
        for i, (worker, sent) in list(pending.items()):
            if worker in live and time.monotonic() - sent < self.task_timeout_s:
                continue
            del pending[i]
            if worker in live:  # silent: no more passes until it announces itself again
                with self._agg:
                    self._workers.discard(worker)
            others = [w for w in live if w != worker]
            self.passes_reassigned += 1
            log.warning(
                "round %d: %s pass of worker %s handed to %s (worker %s)",
                tasks[i].round_id,
                tasks[i].phase,
                worker,
                others[i % len(others)] if others else "the coordinator",
                "gone" if worker not in live else "silent",
            )
            tasks[i].task_id = uuid.uuid4().hex  # a late answer of the old one is ignored
            self._dispatch(i, tasks, out, pending, others[i % len(others)] if others else None)


def _records_nothing(msg: Uplink, payload: bytes, done: Callable[[str], None]) -> None:
    """The coordinator subscribes no uplinks: its workers record them."""
    raise AssertionError("the sharded coordinator records no uplink")
