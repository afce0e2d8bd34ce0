"""server/process_settings.py: with the server's settings, receiving update-sized messages
through a real broker stops faulting in fresh pages for every message on paho's network
thread, and the GIL changes hands at the set interval."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from wakefl.server.process_settings import GIL_SWITCH_S

MESSAGE_BYTES = 3_000_000  # an int8-delta update of the full-size model
PAGES_PER_MESSAGE = MESSAGE_BYTES // 4096

# Run in a child: the setting is process-wide and would outlive this test.
_RECEIVER = """
import json, resource, sys, threading
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.server.process_settings import apply_server_settings
keep, SIZE = sys.argv[2] == "keep", int(sys.argv[3])
took = apply_server_settings() if keep else None
n = 30
faults, done = [], threading.Event()
def on_message(topic, payload):
    assert len(payload) == SIZE
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)
    if len(faults) == n:
        done.set()
sub = MqttLink(sys.argv[1], "heap-sub").connect()
sub.subscribe("heap/t", on_message)
pub = MqttLink(sys.argv[1], "heap-pub").connect()
payload = bytes(range(256)) * (SIZE // 256) + bytes(SIZE % 256)
for _ in range(n):
    pub.publish("heap/t", payload)
ok = done.wait(60)
pub.close(); sub.close()
# The first messages size the heap; count the faults of the last 20.
print(json.dumps({"took": took, "ok": ok, "per_message": (faults[-1] - faults[-21]) / 20}))
"""


def _receive(url: str, mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _RECEIVER, url, mode, str(MESSAGE_BYTES)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kept_heap_receives_update_sized_messages_without_fresh_pages(mqtt_broker) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("mallopt is glibc's")
    kept = _receive(mqtt_broker.url, "keep")
    default = _receive(mqtt_broker.url, "default")
    assert kept["took"] == {"keep_freed_heap": True, "gil_switch_s": pytest.approx(GIL_SWITCH_S)}
    assert kept["ok"] and default["ok"]
    # Each copy of a message into fresh pages faults ~730 of them; with the heap kept, the
    # buffers of one message are those the previous one freed.
    assert kept["per_message"] < PAGES_PER_MESSAGE / 4, (kept, default)
    assert kept["per_message"] <= default["per_message"], (kept, default)
