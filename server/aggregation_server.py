"""The aggregation server in one process: runs federated rounds over MQTT with a `Strategy`.

One round: sample devices (activity rate C over the registry), record the round, publish
the retained downlink, collect uplinks until every sampled device answered, the quorum
(`min_clients`) is in, or the deadline passed, aggregate with the strategy over a lazy
view of the recorded updates, persist, go on. All maths is the strategy's. See
docs/PROTOCOL.md.

The server is a composition of parts that the sharded roles share (server/ingest.py
receives and records, server/round_runner.py runs the rounds, server/aggregation.py
screens and aggregates, server/state_store.py keeps it all): here every part runs in one
process around one `ServerSession`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from wakefl.protocol import topics
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.sdk.selffl.strategy import ServerState, Strategy
from wakefl.server.aggregation import LocalAggregation, ScreenedUpdates
from wakefl.server.ingest import REFUSAL_ACK_BURST, REFUSAL_ACKS_PER_S, Ingest
from wakefl.server.receipt_worker import ReceiptWorker
from wakefl.server.round_runner import RoundRunner
from wakefl.server.server_config import RoundReport, ServerConfig
from wakefl.server.server_session import ServerSession
from wakefl.server.update_batches import BatchRecorder

__all__ = [
    "AggregationServer",
    "BROKER_DROPPED_TOPIC",
    "REFUSAL_ACK_BURST",
    "REFUSAL_ACKS_PER_S",
    "RoundReport",
    "ScreenedUpdates",
    "ServerConfig",
]

# mosquitto's running count of messages dropped because a client's queue was full
# (max_queued_messages) or for other limits; readable by the server (acl.template).
BROKER_DROPPED_TOPIC = "$SYS/broker/publish/messages/dropped"


# How long a round's close waits for the recorder's last acknowledgements, then for their
# receipts; past it, the updates not yet in the receipts are read from their files.
SETTLE_S = 10.0


class AggregationServer:
    """`run()` drives the rounds until `config.rounds` are aggregated and announces the end;
    uplinks are received, admitted, recorded and acknowledged on paho's thread."""

    def __init__(
        self,
        config: ServerConfig,
        strategy: Strategy,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg = config
        self.strategy = strategy
        self.session = ServerSession(config, progress)
        self.store = self.session.store
        self.recorder = BatchRecorder(self.session)
        self.folding = ReceiptWorker()
        self.ingest = Ingest(self.session, strategy, self.recorder, fold=self.folding.submit)
        self.runner = RoundRunner(
            self.session,
            strategy,
            self.ingest,
            LocalAggregation(self.session, strategy, self.ingest.carry_out, settle=self._settle),
            self._subscribe,
            on_close=self._close_threads,
        )

    def _settle(self) -> None:
        """Until the updates recorded so far are acknowledged and in the receipts (bounded:
        past it, the round's close reads the others from their files)."""
        self.recorder.flush(SETTLE_S)
        self.folding.flush(SETTLE_S)

    def _close_threads(self) -> None:
        self.recorder.close()
        self.folding.close()

    def _subscribe(self, link: MqttLink) -> None:
        """Devices' hellos and uplinks, and the broker's count of dropped messages."""
        link.subscribe(topics.hello_filter(self.cfg.fleet), self.ingest.on_hello)
        link.subscribe(topics.uplink_filter(self.cfg.fleet), self.ingest.on_uplink)
        # QoS 0: a counter the broker republishes every sys_interval (10 s by default).
        link.subscribe(BROKER_DROPPED_TOPIC, self.ingest.on_broker_dropped, qos=0)

    def run(self) -> ServerState:
        return self.runner.run()

    def registry(self) -> dict[str, str]:
        return self.session.registry()

    def _sample(self, round_id: int, online: list[str], registry_size: int) -> list[str]:
        return self.runner._sample(round_id, online, registry_size)

    @property
    def run_id(self) -> str:
        return self.session.run_id

    @property
    def stop_event(self) -> threading.Event:
        return self.session.stop_event

    @property
    def link(self) -> MqttLink | None:
        return self.session.link

    @property
    def reports(self) -> list[RoundReport]:
        return self.runner.reports

    @property
    def rejections(self) -> Counter[str]:
        return self.ingest.rejections

    @property
    def acks_withheld(self) -> int:
        return self.ingest.acks_withheld

    @property
    def broker_dropped(self) -> int:
        return self.ingest.broker_dropped
