"""The device's end of the MQTT transport: one connection, its two subscriptions (the
fleet's downlink and the device's acks), the Hello with its will, and an inbox.

The network runs on paho's thread (reconnecting on its own with a persistent MQTT
session); the handlers here only decode and queue, and all work happens on the thread
that called `DeviceClient.run`, so a long training step never stalls the keepalive.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from wakefl.errors import ConfigError, ProtocolError, WakeflError
from wakefl.protocol import messages, topics
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.sdk.round_policy import newer

log = logging.getLogger("wakefl.device")

_HELLO_FIRST_REPEAT_S = 2.0
_HELLO_MAX_REPEAT_S = 60.0

# ("down", Downlink), ("ack", Ack), ("connected", session_present) or ("wake", None)
InboxItem = tuple[str, Any]


class DeviceLink:
    """Connection, subscriptions, Hello and inbox of one device. `num_samples` is asked
    for each Hello (the local problem may be built late)."""

    def __init__(
        self,
        broker_url: str,
        fleet: str,
        device_id: str,
        device_type: str,
        num_samples: Callable[[], int],
        publish_timeout_s: float,
    ) -> None:
        self.broker_url = broker_url
        self.fleet = fleet
        self.device_id = device_id
        self.device_type = device_type
        self._num_samples = num_samples
        self.publish_timeout_s = publish_timeout_s
        self._inbox: queue.Queue[InboxItem] = queue.Queue()
        self._link: MqttLink | None = None
        self._subscribed_here = False  # subscribed within this process's MQTT session
        self._heard_server = False  # a downlink arrived since the last connect
        self._last_hello = 0.0
        self._hello_interval = _HELLO_FIRST_REPEAT_S

    # ------------------------------------------------------------------ connection
    def connect(self, timeout: float) -> None:
        link = MqttLink(
            self.broker_url,
            client_id=self.device_id,
            will=(topics.hello(self.fleet, self.device_id), self._hello(False)),
        )
        self._subscribe(link)
        # The hook runs on paho's thread, which must not block on a PUBACK: the Hello is
        # sent from the main loop.
        link.on_connect_hooks.append(lambda present: self._inbox.put(("connected", present)))
        self._link = link
        link.connect(timeout)

    def disconnect(self) -> None:
        if self._link is not None:
            # Best effort: the broker publishes the will if this does not get through.
            with contextlib.suppress(WakeflError):
                self._link.publish(
                    topics.hello(self.fleet, self.device_id),
                    self._hello(False),
                    retain=True,
                    timeout=2.0,
                )
            self._link.close()
            self._link = None

    @property
    def is_open(self) -> bool:
        return self._link is not None

    def _require(self) -> MqttLink:
        if self._link is None:
            raise ConfigError(f"device {self.device_id} is not connected")
        return self._link

    def publish(self, topic: str, payload: bytes, timeout: float, retain: bool = False) -> None:
        """QoS 1, waiting for the PUBACK (ProtocolError when it does not come)."""
        self._require().publish(topic, payload, qos=1, retain=retain, timeout=timeout)

    def reconnect_wait(self, timeout: float) -> None:
        link = self._require()
        if not link.connected:
            link.wait_connected(timeout)

    def _subscribe(self, link: MqttLink) -> None:
        link.subscribe(topics.downlink(self.fleet), self._on_downlink)
        link.subscribe(topics.ack(self.fleet, self.device_id), self._on_ack)

    # ------------------------------------------------------------------ hello
    def _hello(self, online: bool = True) -> bytes:
        return messages.encode(
            messages.Hello(
                fleet=self.fleet,
                device_id=self.device_id,
                device_type=self.device_type,
                num_samples=self._num_samples(),
                online=online,
            )
        )

    def on_connected(self, session_present: bool) -> None:
        """Called on the main thread for each ("connected", session_present) item."""
        if session_present and not self._subscribed_here:
            # A session resumed from an earlier process: the broker delivers what was queued
            # while offline but not the retained downlink, so a device restarted with an
            # unacknowledged update would wait for the next round. Subscribing again fetches
            # the retained downlink (handling it twice is harmless).
            self._subscribe(self._require())
        self._subscribed_here = True
        self._heard_server = False
        self._hello_interval = _HELLO_FIRST_REPEAT_S
        self._send_hello()

    def heard_server(self) -> None:
        """A downlink arrived: the server is there, the Hello need not be repeated."""
        self._heard_server = True

    def maybe_repeat_hello(self) -> None:
        """Repeat the Hello (backing off) until a downlink shows the server is there: the
        retained copy reaches a server that subscribes later, but a broker restarted
        without persistence has lost it, and a server that waits for its devices would
        wait for this one forever."""
        if self._heard_server or self._link is None or not self._link.connected:
            return
        if self._last_hello == 0.0:
            return  # the connection's first Hello is on_connected's: one Hello, one answer
        if time.monotonic() - self._last_hello >= self._hello_interval:
            self._hello_interval = min(self._hello_interval * 2, _HELLO_MAX_REPEAT_S)
            self._send_hello()

    def _send_hello(self) -> None:
        self._last_hello = time.monotonic()
        try:
            # Retained, like the offline will: the broker re-sends the retained Hello to a
            # server that subscribes again (after its own reconnect), and a live Hello it
            # read before would be overwritten by an older will still retained there.
            self.publish(
                topics.hello(self.fleet, self.device_id),
                self._hello(True),
                timeout=self.publish_timeout_s,
                retain=True,
            )
        except ProtocolError as exc:
            log.warning("hello not delivered: %s", exc)

    # ------------------------------------------------------------------ inbox
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

    def put(self, item: InboxItem) -> None:
        self._inbox.put(item)

    def wake(self) -> None:
        """Make a waiting `next` return at once (thread-safe)."""
        self._inbox.put(("wake", None))

    def next(self, timeout: float) -> InboxItem | None:
        """Next inbox item; of several queued downlinks only the newest counts."""
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if item[0] != "down":
            return item
        newest = item
        others: list[InboxItem] = []
        while True:
            try:
                nxt = self._inbox.get_nowait()
            except queue.Empty:
                break
            if nxt[0] == "down" and newer(nxt[1], newest[1]):
                newest = nxt
            elif nxt[0] != "down":
                others.append(nxt)
        for o in others:
            self._inbox.put(o)
        return newest


__all__ = ["DeviceLink", "InboxItem"]
