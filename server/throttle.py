"""Rate limits for what a flooding device id can cost the server: a token bucket per key
(`Throttle`) and a message id hashed only when an ack naming it is sent (`LazyId`)."""

from __future__ import annotations

import threading
import time
from collections import Counter

from wakefl.protocol.messages import message_id


class LazyId:
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


class Throttle:
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
