"""What the parts of one server process share: its configuration, the store, the open
round, the current downlink, the MQTT link, one lock and the condition that wakes the
round loop. The parts (server/ingest.py, server/round_runner.py, the aggregations) hold
one `ServerSession` each; a role (single server, sharded coordinator, worker) is a
choice of parts around it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from torch import Tensor

from wakefl.errors import ProtocolError
from wakefl.protocol import topics
from wakefl.protocol.messages import Downlink, decode_as
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.server.admission import OpenRound
from wakefl.server.round_receipts import RoundReceipts
from wakefl.server.server_config import ServerConfig
from wakefl.server.spare_files import DEFAULT_LIMIT as SPARES
from wakefl.server.state_store import StateStore

log = logging.getLogger("wakefl.server")

Progress = Callable[[str], None]


class ServerSession:
    def __init__(
        self, config: ServerConfig, progress: Progress | None = None, spare_files: int = SPARES
    ) -> None:
        self.cfg = config
        self.progress: Progress = progress or (lambda line: print(line, flush=True))
        self.store = StateStore(config.state_dir, spare_files)
        self.run_id = self.store.run_id()
        self.numel = int(config.initial_params.numel())
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        # Held while the recorder commits a batch (with its fsync) and while the round
        # closes: the round cannot close between the recorder's check and its commit, and
        # ingest's admission (under `lock`) does not wait for the disk.
        self.commit_lock = threading.Lock()
        self.open_round: OpenRound | None = None
        self.downlink: bytes | None = None  # the downlink now published
        self.republish = False  # the broker may have lost the retained downlink
        self.link: MqttLink | None = None
        self.stop_event = threading.Event()
        self.static = config.devices is not None
        self._base: tuple[bytes, Tensor] | None = None  # a downlink and its global model
        # The open round's global model (the server's float32 copy, not the downlink's)
        # and what ingest learns of each accepted update while it is decoded
        # (server/round_receipts.py): aggregation then reads the kept updates once.
        self.receipts: RoundReceipts | None = None
        for dev, typ in (config.devices or {}).items():
            topics.check_name(dev, "device id")
            topics.check_name(typ, "device type")
            self.store.register_device(dev, typ, "registry")

    def registry(self) -> dict[str, str]:
        """Registered devices and their types (only those of `--devices` when given)."""
        reg = self.store.devices()
        listed = self.cfg.devices
        if listed is not None:
            return {d: t for d, t in reg.items() if d in listed}
        return reg

    def round_base(self, payload: bytes | None = None) -> Tensor:
        """The global model of a downlink (default: the current one) exactly as the devices
        decode it, the base of packed updates; decoded once per downlink."""
        payload = payload if payload is not None else self.downlink
        assert payload is not None, "no downlink published yet"
        held = self._base  # read once: ingest's and the receipts' threads both call this
        if held is None or held[0] is not payload:
            held = (
                payload,
                decode_as(payload, Downlink, max_bytes=self.cfg.max_bytes).global_params,
            )
            self._base = held
        return held[1]

    def publish(self, topic: str, payload: bytes, what: str) -> None:
        """Publish without waiting for the broker; a failure is logged by the caller's
        `what` and never raised (acks are answers, their loss is recovered by re-sends)."""
        assert self.link is not None
        try:
            self.link.publish(topic, payload, wait=False)
        except ProtocolError as exc:
            log.warning("%s not sent: %s", what, exc)
