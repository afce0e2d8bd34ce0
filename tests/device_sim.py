"""The device tests' shared parts: a learnable tone task, and the server's half of the
protocol played by the test against a real broker (tests/test_device_client.py,
tests/test_device_serving.py)."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import torch
from torch.utils.data import Dataset

from wakefl.models.kws_cnn import KwsCnn, ModelConfig, get_flat_params
from wakefl.protocol import messages, topics
from wakefl.protocol.round_settings import RoundSettings
from wakefl.sdk.device_client import DeviceClient
from wakefl.sdk.mqtt_link import MqttLink

WIDTH = 0.05
CFG = ModelConfig(width=WIDTH)
ARGS = {"lr": 0.05, "batch_size": 4, "l_max": 3, "warmup_steps": 2}


class ToneDataset(Dataset):
    """Wake word = a 440 Hz tone in noise, other = noise: a learnable local task, in
    clips of `samples` (the model's window by default)."""

    def __init__(self, n: int, seed: int, samples: int = CFG.window_samples) -> None:
        g = np.random.default_rng(seed)
        t = np.arange(samples) / CFG.sample_rate
        self.labels = np.array([i % 2 for i in range(n)], dtype=np.int64)
        self.waves = [
            (0.05 * g.standard_normal(t.size) + 0.3 * lab * np.sin(2 * np.pi * 440 * t)).astype(
                np.float32
            )
            for lab in self.labels
        ]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return torch.from_numpy(self.waves[i]), int(self.labels[i])


class FakeServer:
    """The server's half of docs/PROTOCOL.md, scripted by the test."""

    def __init__(self, url: str, fleet: str) -> None:
        self.fleet = fleet
        self.uplinks: queue.Queue[messages.Uplink] = queue.Queue()
        self.declines: queue.Queue[messages.Decline] = queue.Queue()
        self.last_id: dict[str, str] = {}  # device -> message_id of its latest uplink
        self.hellos: queue.Queue[messages.Hello] = queue.Queue()
        self.link = MqttLink(url, f"server-{fleet}", clean_start=True).connect()
        self.link.subscribe(topics.uplink_filter(fleet), self._up)
        self.link.subscribe(topics.hello_filter(fleet), self._hello)
        # A fixed start: with 4 validation negatives, a random start may false-accept none
        # of them while the trained model accepts one, and relative FA is then unbounded
        # (None) by design, which the round-trip test does not expect.
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.initial = get_flat_params(KwsCnn(CFG))

    def _up(self, topic, payload):
        msg = messages.decode(payload)
        self.last_id[msg.device_id] = messages.message_id(payload)
        (self.declines if isinstance(msg, messages.Decline) else self.uplinks).put(msg)

    def _hello(self, topic, payload):
        if payload:  # an empty retained message clears the topic
            self.hellos.put(messages.decode_as(payload, messages.Hello))

    def downlink(
        self,
        round_id: int,
        sampled: list[str],
        final: bool = False,
        deadline_s: float = 60.0,
        run_id: str = "run1",
        args: dict | None = None,
    ) -> None:
        msg = messages.Downlink(
            fleet=self.fleet,
            run_id=run_id,
            round_id=round_id,
            global_params=self.initial,
            model_config=CFG.to_dict(),
            instructions={d: {"sigma0_sq": 0.0, "others_precision": 0.0} for d in sampled},
            settings=RoundSettings(
                strategy="selffl", strategy_args=args or ARGS, ack_timeout_s=1.0, wire_dtype="fp32"
            ),
            deadline=time.time() + deadline_s,
            final=final,
        )
        self.link.publish(topics.downlink(self.fleet), messages.encode(msg), retain=True)

    def ack(
        self,
        device: str,
        round_id: int,
        accepted: bool = True,
        reason: str = "",
        answers: str | None = None,
    ) -> None:
        """Ack the device's latest uplink (or the message id `answers`)."""
        answers = self.last_id.get(device, "") if answers is None else answers
        self.link.publish(
            topics.ack(self.fleet, device),
            messages.encode(
                messages.Ack(
                    fleet=self.fleet,
                    device_id=device,
                    round_id=round_id,
                    accepted=accepted,
                    reason=reason,
                    answers=answers,
                )
            ),
        )

    def next_uplink(self, timeout: float = 30.0) -> messages.Uplink:
        return self.uplinks.get(timeout=timeout)

    def close(self) -> None:
        # Clear the retained downlink so the next test's fleet starts clean.
        self.link.publish(topics.downlink(self.fleet), b"", retain=True)
        self.link.close()


def start_run(client: DeviceClient, **kw):
    """`client.run(**kw)` in a thread; the summary or the error lands in the returned dict."""
    out: dict = {}

    def target():
        try:
            out["summary"] = client.run(**kw)
        except BaseException as exc:  # surfaced by the test
            out["error"] = exc

    th = threading.Thread(target=target, daemon=True)
    th.start()
    return th, out


def make_client(tmp_path, broker, fleet, device="dev1", **kw) -> DeviceClient:
    """A device of type A on `broker` training on tones, its state under `tmp_path`."""
    return DeviceClient(
        device,
        "A",
        ToneDataset(8, 1),
        tmp_path / device,
        validation=ToneDataset(8, 2),
        broker_url=broker.url,
        fleet=fleet,
        ack_timeout_s=1.0,
        **kw,
    )


def wait_until(pred, timeout: float = 20.0) -> bool:
    """Whether `pred()` came true within `timeout` s (an error in it counts as not yet)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if pred():
                return True
        except Exception:
            pass
        time.sleep(0.05)
    return False
