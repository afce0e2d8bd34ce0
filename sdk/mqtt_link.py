"""A thin paho-mqtt 2.x wrapper that both the server and the device use.

What it adds to paho: broker URLs (`mqtt://user:pass@host:port`, `mqtts://...?ca=/path`),
MQTT v5 persistent sessions (clean_start=False + a session expiry), automatic reconnect,
re-subscription when the broker did not keep the session, a publish that waits for the
PUBACK and checks its v5 reason code (an ACL-denied publish is acknowledged with 0x87 and
paho's own `wait_for_publish()` would still report success), and a size check before a
message leaves (mosquitto drops a v5 connection on an oversized packet).

Handlers run on paho's network thread, one message at a time; the PUBACK of a QoS 1
message is sent only after its handler returns, so a handler that records the message
durably before returning gives at-least-once delivery across crashes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from wakefl.errors import ConfigError, ProtocolError

log = logging.getLogger("wakefl.mqtt")

# keepalive must exceed half the worst-case upload time of one model, or paho drops its
# own connection mid-upload: 12 MB over a 1 Mbit/s uplink takes ~100 s.
DEFAULT_KEEPALIVE_S = 300
DEFAULT_SESSION_EXPIRY_S = 7 * 24 * 3600
DEFAULT_MAX_PAYLOAD = 64 * 1024 * 1024
# What an MQTT PUBLISH adds to its payload: fixed header, topic, packet id, v5 properties.
# The wakefl topics are short; 64 KiB leaves room for any topic the broker accepts.
PACKET_OVERHEAD = 64 * 1024
MQTT_MAX_PACKET = 268_435_455  # the largest packet MQTT's length field can describe

Handler = Callable[[str, bytes], None]
_MAX_ACK_RECORDS = 10000


class PublishError(ProtocolError):
    """The broker refused a publish (v5 reason code >= 0x80, e.g. 0x87 not authorized)."""

    def __init__(self, topic: str, code: int, text: str) -> None:
        super().__init__(f"broker refused publish to {topic!r}: reason 0x{code:02x} ({text})")
        self.code = code


@dataclass(frozen=True)
class BrokerURL:
    """A parsed broker address. `ca_file` switches on server verification for mqtts."""

    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def redacted(self) -> str:
        user = f"{self.username}:***@" if self.username else ""
        return f"{'mqtts' if self.tls else 'mqtt'}://{user}{self.host}:{self.port}"


def parse_broker_url(
    url: str,
    *,
    username: str | None = None,
    password: str | None = None,
    ca_file: str | None = None,
) -> BrokerURL:
    """`mqtt://[user[:pass]@]host[:port]` or `mqtts://...[?ca=PATH&cert=PATH&key=PATH]`.
    Explicit arguments override what the URL carries."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"bad broker URL {url!r}: {exc}") from exc
    if parts.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
        raise ConfigError(f"broker URL {url!r} must start with mqtt:// or mqtts://")
    if not parts.hostname:
        raise ConfigError(f"broker URL {url!r} has no host")
    tls = parts.scheme in ("mqtts", "ssl")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"ca", "cert", "key"}
    if unknown:
        raise ConfigError(f"broker URL {url!r}: unknown options {sorted(unknown)}")
    ca = ca_file or query.get("ca")
    if ca and not tls:
        raise ConfigError(f"broker URL {url!r}: a CA file needs mqtts://")
    return BrokerURL(
        host=parts.hostname,
        port=port or (8883 if tls else 1883),
        tls=tls,
        username=username or (unquote(parts.username) if parts.username else None),
        password=password or (unquote(parts.password) if parts.password else None),
        ca_file=ca,
        cert_file=query.get("cert"),
        key_file=query.get("key"),
    )


def diagnose_connection(url: BrokerURL, timeout: float = 5.0) -> tuple[str | None, bool]:
    """Why a connection to the broker fails, found by a plain TCP connection and, for
    mqtts, a TLS handshake with the same CA and client certificate: (the cause in words
    or None when both succeed, whether retrying cannot help)."""
    import socket
    import ssl

    try:
        sock = socket.create_connection((url.host, url.port), timeout=timeout)
    except OSError as exc:
        return f"cannot reach {url.host}:{url.port} ({exc.strerror or exc})", False
    if not url.tls:
        sock.close()
        return None, False
    try:
        ctx = ssl.create_default_context(cafile=url.ca_file)
        if url.cert_file:
            ctx.load_cert_chain(url.cert_file, url.key_file)
        with ctx.wrap_socket(sock, server_hostname=url.host):
            return None, False
    except ssl.SSLCertVerificationError as exc:
        hint = "" if url.ca_file else "; pass the CA that signed it: ?ca=ca.crt in the URL"
        return (
            f"TLS handshake failed: the broker's certificate is not trusted "
            f"({exc.verify_message}){hint}",
            True,
        )
    except (ssl.SSLError, OSError) as exc:
        return f"TLS handshake failed: {exc}", False
    finally:
        sock.close()


class MqttLink:
    """One MQTT v5 connection with a persistent session.

    `subscribe` registers a handler (topic filter -> handler); `publish` blocks until the
    broker acknowledged the message (QoS 1) and raises PublishError on refusal."""

    def __init__(
        self,
        url: str | BrokerURL,
        client_id: str,
        *,
        keepalive: int = DEFAULT_KEEPALIVE_S,
        session_expiry: int = DEFAULT_SESSION_EXPIRY_S,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        will: tuple[str, bytes] | None = None,
        will_retain: bool = True,
        clean_start: bool = False,
        resubscribe: bool = False,
        manual_ack: bool = False,
    ) -> None:
        """`resubscribe`: subscribe again on every connection, even when the broker kept the
        session: a session another role of the same client id left behind (one server
        process, then a sharded coordinator) may lack this role's subscriptions.
        `manual_ack`: a handler may take a received QoS 1 message's PUBACK with
        `defer_ack()` and send it later (once what the message carries is durable); the
        PUBACK of any other message goes out when its handlers return, as without it."""
        self.url = parse_broker_url(url) if isinstance(url, str) else url
        self.client_id = client_id
        self.keepalive = keepalive
        self.max_payload = max_payload
        self._session_expiry = session_expiry
        self._clean_start = clean_start
        self._resubscribe = resubscribe
        self._subs: dict[str, tuple[int, Handler]] = {}
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # mid -> reason code of the PUBACK, newest last (message ids repeat every 65535
        # publishes; at most _MAX_ACK_RECORDS are kept, so a stale entry cannot be taken
        # for a new publish's acknowledgement)
        self._acked: OrderedDict[int, int] = OrderedDict()
        self._pub_lock = threading.Lock()
        self._connected = False
        self._connect_error: str | None = None
        self._fatal = False  # a retry cannot help: `connect` stops waiting and says why
        self.connects = 0  # number of successful (re)connections
        self.on_connect_hooks: list[Callable[[bool], None]] = []
        self._manual_ack = manual_ack
        self._delivery = threading.local()  # the message paho's thread is handing over

        self._client = self._paho_client(will, will_retain)

    def _paho_client(self, will: tuple[str, bytes] | None, will_retain: bool) -> paho.Client:
        c = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=paho.MQTTv5,
            reconnect_on_failure=True,
            manual_ack=self._manual_ack,
        )
        if self.url.username:
            c.username_pw_set(self.url.username, self.url.password)
        if self.url.tls:
            c.tls_set(
                ca_certs=self.url.ca_file, certfile=self.url.cert_file, keyfile=self.url.key_file
            )
        if will is not None:
            c.will_set(will[0], will[1], qos=1, retain=will_retain)
        c.reconnect_delay_set(min_delay=1, max_delay=10)
        c.max_queued_messages_set(0)
        c.on_connect = self._on_connect
        c.on_connect_fail = self._on_connect_fail
        c.on_disconnect = self._on_disconnect
        c.on_publish = self._on_publish
        c.on_message = self._on_message
        return c

    # ------------------------------------------------------------------ connection
    def connect(self, timeout: float = 30.0) -> MqttLink:
        """Start the network loop and wait for the first CONNACK.

        The CONNECT announces a maximum packet size of `max_payload` plus the header: an
        MQTT 5 broker then never delivers a larger message to this client (it drops it),
        so a broker configured without `max_packet_size` cannot make this process read an
        oversized message whole before refusing it."""
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self._session_expiry
        props.MaximumPacketSize = min(self.max_payload + PACKET_OVERHEAD, MQTT_MAX_PACKET)
        started = time.monotonic()
        self._client.connect_async(
            self.url.host,
            self.url.port,
            keepalive=self.keepalive,
            clean_start=self._clean_start,
            properties=props,
        )
        self._client.loop_start()
        if not self.wait_connected(timeout):
            err = self._connect_error or "no answer"
            waited = time.monotonic() - started
            self.close()
            raise ProtocolError(
                connect_failure(self.url, self.client_id, err, waited, gave_up=self._fatal)
            )
        return self

    def wait_connected(self, timeout: float) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._connected or self._fatal, timeout)
            return self._connected

    @property
    def connected(self) -> bool:
        return self._connected

    def close(self) -> None:
        try:
            self._client.disconnect()
        finally:
            self._client.loop_stop()
            with self._cond:
                self._connected = False
                self._cond.notify_all()

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            self._connect_error = f"the broker refused the connection: {reason_code}"
            log.warning("connection to %s refused: %s", self.url.redacted(), reason_code)
            if reason_code.value in (0x86, 0x87, 0x85):  # bad credentials / not authorized
                self._connect_error += (
                    f" (user {self.url.username!r}: check the password or the credentials file)"
                )
                client.disconnect()
                with self._cond:  # the same credentials would be refused again
                    self._fatal = True
                    self._cond.notify_all()
            return
        present = bool(flags.session_present)
        with self._lock:
            subs = list(self._subs.items())
        if not present or self._resubscribe:
            for topic, (qos, _) in subs:
                client.subscribe(topic, qos=qos)
        with self._cond:
            self._connected = True
            self.connects += 1
            self._cond.notify_all()
        log.info(
            "connected to %s as %s (session %s)",
            self.url.redacted(),
            self.client_id,
            "resumed" if present else "new",
        )
        for hook in list(self.on_connect_hooks):
            try:
                hook(present)
            except Exception:
                log.exception("on-connect hook failed")

    def _on_connect_fail(self, client, userdata) -> None:
        """paho gives no reason for a failed attempt; the diagnosis finds it once, and an
        untrusted certificate ends the waiting."""
        if self._connect_error is not None:
            return
        why, fatal = diagnose_connection(self.url)
        self._connect_error = why or "no answer"
        if why:
            log.warning("cannot connect to %s: %s", self.url.redacted(), why)
        if fatal:
            with self._cond:
                self._fatal = True
                self._cond.notify_all()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        with self._cond:
            self._connected = False
            self._cond.notify_all()
        log.info("disconnected from %s: %s", self.url.redacted(), reason_code)

    # ------------------------------------------------------------------ messages
    def subscribe(self, topic: str, handler: Handler, qos: int = 1) -> None:
        with self._lock:
            self._subs[topic] = (qos, handler)
        if self._connected:
            self._client.subscribe(topic, qos=qos)

    def unsubscribe(self, topic: str) -> None:
        """Drop a subscription (also one a kept session holds that this link never made)."""
        with self._lock:
            self._subs.pop(topic, None)
        if self._connected:
            self._client.unsubscribe(topic)

    def _on_message(self, client, userdata, message) -> None:
        with self._lock:
            handlers = [
                h
                for f, (_, h) in self._subs.items()
                if paho.topic_matches_sub(_without_share(f), message.topic)
            ]
        self._delivery.current = (message.mid, message.qos)
        self._delivery.deferred = False
        self._delivery.retained = bool(message.retain)
        for h in handlers:
            try:
                h(message.topic, message.payload)
            except Exception:
                # An exception escaping here would stop paho's network thread.
                log.exception("handler for %s failed", message.topic)
        self._delivery.current = None
        self._delivery.retained = False
        if self._manual_ack and not self._delivery.deferred:
            self._client.ack(message.mid, message.qos)

    def delivered_retained(self) -> bool:
        """Called by a handler (on paho's thread): the message being handled is the copy
        the broker retained, sent because this client subscribed, not one published while
        it listened. The broker clears the flag on live deliveries (this link subscribes
        without MQTT 5's retain-as-published), so a sender cannot set it."""
        return bool(getattr(self._delivery, "retained", False))

    def defer_ack(self) -> Callable[[], None]:
        """Called by a handler (on paho's thread, with `manual_ack`): the message being
        handled is not acknowledged to the broker when the handler returns; calling the
        returned function (from any thread) acknowledges it. The broker re-delivers a
        message never acknowledged to this session when it reconnects."""
        current = getattr(self._delivery, "current", None)
        if not self._manual_ack or current is None:
            return lambda: None
        self._delivery.deferred = True
        mid, qos = current

        def acknowledge() -> None:
            self._client.ack(mid, qos)

        return acknowledge

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        # paho calls this holding its own message lock, which `publish` also needs: the
        # code is recorded for every mid (publish may not have registered it yet), and
        # the oldest entries are dropped, so publishes that nobody waits for cost nothing.
        with self._cond:
            self._acked[mid] = int(getattr(reason_code, "value", reason_code))
            while len(self._acked) > _MAX_ACK_RECORDS:
                self._acked.popitem(last=False)
            self._cond.notify_all()

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        timeout: float = 60.0,
        wait: bool = True,
    ) -> None:
        """Publish and, for QoS >= 1, wait for the broker's acknowledgement.
        Raises ProtocolError when too large or not acknowledged in time, PublishError
        when the broker refused it (e.g. 0x87 not authorized by the ACL).
        `wait=False` only queues the message: required inside a handler, which runs on the
        network thread that would deliver the acknowledgement."""
        if len(payload) > self.max_payload:
            raise ProtocolError(
                f"message of {len(payload)} bytes exceeds the {self.max_payload}-byte limit"
            )
        # Not under self._cond: paho's network thread holds its message lock while it calls
        # _on_publish (which takes self._cond), and paho's publish takes that message lock;
        # holding self._cond here deadlocked both threads under a fast stream of publishes.
        with self._pub_lock:
            info = self._client.publish(topic, payload, qos=qos, retain=retain)
        if info.rc not in (paho.MQTT_ERR_SUCCESS, paho.MQTT_ERR_NO_CONN):
            raise ProtocolError(f"publish to {topic!r} failed: {paho.error_string(info.rc)}")
        if qos == 0 or not wait:
            return
        with self._cond:
            done = self._cond.wait_for(lambda: info.mid in self._acked, timeout)
            code = self._acked.pop(info.mid, None)
        if not done:
            raise ProtocolError(f"publish to {topic!r} not acknowledged within {timeout:.0f} s")
        if code is not None and code >= 0x80:
            text = {
                0x87: "not authorized",
                0x97: "quota exceeded",
                0x95: "packet too large",
                0x90: "topic name invalid",
            }.get(code, "error")
            raise PublishError(topic, code, text)


def connect_failure(
    url: BrokerURL, client_id: str, error: str, waited: float, *, gave_up: bool
) -> str:
    """The one line a failed connection ends with, saying how long it really waited
    (`waited` seconds): a refusal a retry cannot help (`gave_up`) ends the wait at once."""
    if gave_up:
        when = f"gave up after {waited:.1f} s, a retry cannot help"
    else:
        when = f"no connection after {waited:.0f} s of retrying"
    return f"cannot connect to {url.redacted()} as {client_id!r}: {when}: {error}"


def _without_share(topic_filter: str) -> str:
    """The filter a shared subscription `$share/<group>/<filter>` matches topics with."""
    if topic_filter.startswith("$share/"):
        return topic_filter.split("/", 2)[2]
    return topic_filter


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Poll `predicate` until true or `timeout` seconds passed."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
