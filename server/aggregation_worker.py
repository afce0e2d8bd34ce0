"""An aggregation worker of a sharded server (`wakefl server --role worker`).

Several workers share the uplinks through an MQTT v5 shared subscription
(`$share/<group>/wakefl/<fleet>/up/+`): the broker hands each uplink to one of them. A
worker validates it exactly as the single-process server does (the same part,
server/ingest.py, with its own recorder and its round read from the store), records it in the state folder it shares
with the coordinator (server/state_store.py: the row only while the round is open, in the
same transaction) and acknowledges it. When the coordinator closes a round it sends each
worker a pass over some recorded updates (server/shard_tasks.py); the worker answers with
partial sums, O(d) whatever the number of updates.

The open round, its sampled devices and its downlink come from the shared state folder,
not from the retained downlink: a device's uplink may reach a worker before the broker
delivered it the downlink, never before the coordinator recorded the round. The worker's
session is clean and expires at once, so the broker keeps no uplinks for a dead worker;
a device whose uplink went to a worker killed before acknowledging it re-sends it after
its ack timeout, and the broker hands it to a live worker.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import time
from collections.abc import Callable
from pathlib import Path

from torch import Tensor

from wakefl.errors import ConfigError
from wakefl.protocol import topics
from wakefl.protocol.messages import MessageRejected, Uplink
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.sdk.selffl.strategy import ServerState, Strategy
from wakefl.server.admission import OpenRound
from wakefl.server.ingest import Ingest
from wakefl.server.partial_aggregate import require_shardable
from wakefl.server.server_config import ServerConfig
from wakefl.server.server_session import ServerSession
from wakefl.server.shard_tasks import ShardReader, ShardTask, downlink_file
from wakefl.server.state_store import StateStore

log = logging.getLogger("wakefl.server.worker")

DEFAULT_SHARE_GROUP = topics.DEFAULT_SHARE_GROUP


def wait_for_store(state_dir: Path, timeout: float | None = None) -> ServerState:
    """The server state a coordinator initialised in `state_dir`, once it is there: a
    worker must not create the run's id or its first state itself."""
    start = time.monotonic()
    while True:
        if (Path(state_dir) / "server.sqlite").exists():
            store = StateStore(state_dir)
            try:
                state = store.load_server_state()
            finally:
                store.close()
            if state is not None:
                return state
        if timeout is not None and time.monotonic() - start > timeout:
            raise ConfigError(f"no coordinator initialised {state_dir} within {timeout:.0f} s")
        time.sleep(0.2)


class AggregationWorker:
    """`run()` records and acknowledges uplinks and answers the coordinator's shard tasks
    until the run's last round is aggregated or `stop_event` is set."""

    def __init__(
        self,
        config: ServerConfig,
        strategy: Strategy,
        worker_id: str,
        *,
        group: str = DEFAULT_SHARE_GROUP,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        require_shardable(strategy)
        wait_for_store(config.state_dir, config.start_timeout)
        self.cfg = config
        self.session = ServerSession(config, progress)
        self.store = self.session.store
        self.stop_event = self.session.stop_event
        self.worker_id = topics.check_name(worker_id, "worker id")
        self.group = topics.check_name(group, "share group")
        self.ingest = Ingest(
            self.session, strategy, self._record, base=self._round_base, refresh=self._refresh
        )
        self.reader = ShardReader(
            self.store.root, self.session.numel, config.max_bytes, self.worker_id
        )
        self._tasks: queue.Queue[bytes] = queue.Queue()
        self._base_round: tuple[int, Tensor] | None = None
        self.recorded = 0  # updates this worker recorded and acknowledged
        self.tasks_done = 0

    @property
    def link(self) -> MqttLink | None:
        return self.session.link

    # ------------------------------------------------------------------ uplinks
    def _refresh(self) -> None:
        """The open round as the coordinator recorded it in the shared store."""
        rec = self.store.open_round_record()
        with self.session.lock:
            self.session.open_round = (
                None if rec is None else OpenRound.of(rec.round_id, rec.sampled, rec.deadline)
            )

    def _round_base(self) -> Tensor:
        """The open round's global model as the devices decoded it, from the downlink the
        coordinator wrote before publishing it."""
        held = self.session.open_round
        assert held is not None
        rid = held.round_id
        if self._base_round is None or self._base_round[0] != rid:
            try:
                base = self.reader.base(downlink_file(rid))
            except FileNotFoundError as exc:
                raise MessageRejected("stale_round", f"round {rid} is not published yet") from exc
            self._base_round = (rid, base)
        return self._base_round[1]

    def _record(self, msg: Uplink, payload: bytes, done: Callable[[str], None]) -> None:
        refused = self.store.record_update_if_open(msg, payload, self.worker_id)
        if not refused:
            self.recorded += 1
        done(refused)

    # ------------------------------------------------------------------ shard tasks
    def _on_task(self, topic: str, payload: bytes) -> None:
        self._tasks.put(payload)  # answered on the calling thread, never on paho's

    def _answer(self, payload: bytes) -> None:
        try:
            task = ShardTask.decode(payload)
        except ConfigError as exc:
            log.warning("shard task refused: %s", exc)
            return
        t0 = time.monotonic()
        result = self.reader.run(task)
        if result.error:
            log.warning("shard task %s failed: %s", task.task_id, result.error)
        assert self.link is not None
        self.link.publish(topics.agg_result(self.cfg.fleet), result.encode(), timeout=120)
        self.tasks_done += 1
        log.info(
            "round %d: %s pass over %d update(s) in %.2f s",
            task.round_id,
            task.phase,
            len(task.paths),
            time.monotonic() - t0,
        )

    def _announce(self, session_present: bool) -> None:
        assert self.link is not None
        status = json.dumps({"worker": self.worker_id, "online": True, "pid": os.getpid()})
        self.link.publish(
            topics.agg_worker(self.cfg.fleet, self.worker_id),
            status.encode(),
            retain=True,
            wait=False,
        )

    def _finished(self) -> bool:
        """The run's last round is aggregated: the coordinator needs nothing more."""
        name = self.store.get_meta("state_file") or "state_r000000.st"
        done = int(name.removeprefix("state_r").removesuffix(".st"))  # StateStore's naming
        return done >= self.cfg.rounds and self.store.open_round_record() is None

    def run(self) -> None:
        status_topic = topics.agg_worker(self.cfg.fleet, self.worker_id)
        link = self.session.link = MqttLink(
            self.cfg.broker_url,
            f"wakefl-agg-{self.cfg.fleet}-{self.worker_id}",
            max_payload=self.cfg.max_bytes,
            clean_start=True,
            session_expiry=0,
            # A dead worker's status is cleared: the coordinator hands its passes on.
            will=(status_topic, b""),
        )
        link.on_connect_hooks.append(self._announce)
        link.subscribe(topics.agg_task(self.cfg.fleet, self.worker_id), self._on_task)
        link.subscribe(
            topics.shared_uplink_filter(self.cfg.fleet, self.group), self.ingest.on_uplink
        )
        link.connect()
        self.session.progress(
            f"aggregation worker {self.worker_id} for fleet '{self.cfg.fleet}' (run "
            f"{self.session.run_id}) at {link.url.redacted()}; state {self.cfg.state_dir}"
        )
        try:
            self._serve()
            link.publish(status_topic, b"", retain=True, timeout=10)
        finally:
            link.close()
            self.ingest.report_throttled()
            self.store.close()
        self.session.progress(
            f"aggregation worker {self.worker_id} done: {self.recorded} update(s) recorded, "
            f"{self.tasks_done} pass(es) computed"
        )

    def _serve(self) -> None:
        while not self.stop_event.is_set():
            try:
                self._answer(self._tasks.get(timeout=0.5))
            except queue.Empty:
                if self._finished():
                    return
