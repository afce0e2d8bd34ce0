"""Hostile-fleet benchmark: a flood of hostile uplinks against a real server and mosquitto
on 127.0.0.1, with honest devices taking part in rounds meanwhile.

    python -m wakefl.tools.fleet.bench_hostile_fleet [--devices 3] [--width 0.25]
                                               [--messages 10000] [--timeout 600]

Two runs on fresh state: with the flood, then without it for as many rounds. The server
is `wakefl server` in its own process (its peak RSS is its VmHWM); the honest devices
answer every round with a deterministic update after a short pause (standing in for
training); the registered device `evil` (a device whose credentials an attacker holds, or
a broken one) and anonymous clients send the flood: every kind below in turn, each kind's
messages paced so that the server's broker queue never overflows (`not_sampled` in bursts
right after a round opens, so that its round is still open when the server reads them),
and each kind's refusals read back from the server's SQLite store (where they are
committed in batches) before the next kind starts. Bounded in count (`--messages`) and
time (`--timeout`, and each wait has its own limit).

Prints: messages sent per kind and counted as refused per kind (with the reasons),
tracebacks in the server's log (must be 0), honest updates accepted (must be all), round
wall times, and the server's peak memory, with and without the flood, and whether each
target is met: the round median with the flood within 2x of without, no round above 5 s,
peak memory within 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from wakefl.protocol import frames, topics
from wakefl.protocol import messages as M
from wakefl.sdk.mqtt_link import MqttLink
from wakefl.server.broker import ManagedBroker

FLEET = "hostile"
TRAIN_S = 0.3  # an honest device's pause before answering a round
# Kinds refused as such only while their round is still open when the server reads them
# (rounds close every ~TRAIN_S): sent in bursts of ROUND_BURST right after a round opens,
# small enough to be read well within TRAIN_S, one burst per round.
PER_ROUND_KINDS = {"not_sampled"}
ROUND_BURST = 25


class HonestDevice:
    """Answers each round it is sampled for with global + a small deterministic step and
    counts the acks that answer its own messages."""

    def __init__(self, url: str, dev: str, typ: str) -> None:
        self.dev, self.typ = dev, typ
        self.sent: dict[int, str] = {}  # round -> message id
        self.open_round = 0  # the round of the latest downlink
        self.accepted: set[int] = set()
        self.refused: list[str] = []
        self.final = threading.Event()
        self._todo: list[M.Downlink] = []
        self._cond = threading.Condition()
        self.link = MqttLink(
            url,
            dev,
            will=(topics.hello(FLEET, dev), M.encode(M.Hello(FLEET, dev, typ, 10, online=False))),
        )
        self.link.subscribe(topics.downlink(FLEET), self._down)
        self.link.subscribe(topics.ack(FLEET, dev), self._ack)
        self.link.connect(20)
        self.link.publish(
            topics.hello(FLEET, dev), M.encode(M.Hello(FLEET, dev, typ, 10)), retain=True
        )
        self._thread = threading.Thread(target=self._work, daemon=True)
        self._thread.start()

    def _down(self, topic: str, payload: bytes) -> None:
        down = M.decode_as(payload, M.Downlink)
        if down.final:
            self.final.set()
            return
        self.open_round = max(self.open_round, down.round_id)
        if self.dev in down.instructions and down.round_id not in self.sent:
            with self._cond:
                self._todo.append(down)
                self._cond.notify()

    def _ack(self, topic: str, payload: bytes) -> None:
        ack = M.decode_as(payload, M.Ack)
        if self.sent.get(ack.round_id) != ack.answers:
            return  # answers someone else's message on our topic
        if ack.accepted:
            self.accepted.add(ack.round_id)
        else:
            self.refused.append(ack.reason)

    def _work(self) -> None:
        while not self.final.is_set():
            with self._cond:
                self._cond.wait_for(lambda: self._todo or self.final.is_set(), 1.0)
                todo, self._todo = self._todo, []
            for down in todo:
                if down.round_id in self.sent:
                    continue
                time.sleep(TRAIN_S)
                g = torch.Generator().manual_seed(hash((self.dev, down.round_id)) & 0xFFFF)
                params = down.global_params + 1e-3 * torch.randn(
                    down.global_params.numel(), generator=g
                )
                payload = M.encode(
                    M.Uplink(
                        FLEET,
                        down.run_id,
                        self.dev,
                        self.typ,
                        down.round_id,
                        params,
                        10,
                        dict(RECORD),
                    )
                )
                self.sent[down.round_id] = M.message_id(payload)
                self.link.publish(topics.uplink(FLEET, self.dev), payload, timeout=30)

    def close(self) -> None:
        self.final.set()
        self._thread.join(5)
        self.link.close()


# A Self-FL uplink record (what SelfFL.uplink_schema asks for).
RECORD = {"sigma_sq": 0.1, "has_variance": 1.0, "local_steps": 1.0}


def raw_uplink(
    down: tuple[str, str, int],
    device: tuple[str, str],
    params: torch.Tensor,
    extra: str,
    nonce: int | None = None,
) -> bytes:
    """An uplink frame whose JSON fields are written by hand, with the JSON text `extra`
    appended verbatim (what `encode` would never write: 5000-digit numbers, 20000-deep
    arrays). `down` is (fleet, run id, round), `device` (device id, device type); `nonce`
    makes each payload distinct. The tests of the server's refusals send these too."""
    fleet, run_id, round_id = down
    device_id, device_type = device
    fields: dict[str, Any] = {
        "v": M.PROTOCOL_VERSION,
        "kind": "up",
        "fleet": fleet,
        "run_id": run_id,
        "device_id": device_id,
        "device_type": device_type,
        "round_id": round_id,
        "record": RECORD,
    }
    if nonce is not None:
        fields["nonce"] = nonce
    meta = json.dumps(fields)[:-1] + "," + extra + "}"
    return frames.seal(st_save({"params": params}, metadata={"wakefl": meta}))


def with_nan_entry(frame: bytes) -> bytes:
    """`frame` (an fp32 message) with its last tensor entry set to NaN behind a valid hash."""
    body = bytearray(frame[frames.PREFIX_LEN :])
    body[-4:] = torch.tensor([float("nan")]).numpy().tobytes()
    return frames.seal(bytes(body))


def with_flipped_bit(frame: bytes) -> bytes:
    """`frame` with one bit of its tensor data flipped under the prefix's hash."""
    b = bytearray(frame)
    b[-1] ^= 1
    return bytes(b)


def server_command(
    broker_url: str, state: Path, fleet: str, devices: str, *options: str
) -> list[str]:
    """`wakefl server` as its own process on a fleet (`devices`: "id:type,..."), with
    further `options`; the tests of a killed and restarted server start it this way too."""
    return [
        sys.executable, "-m", "wakefl.tools.cli", "server", "--broker", broker_url,
        "--state", str(state), "--fleet", fleet, "--devices", devices, *options,
    ]  # fmt: skip


def _uplink_maker(
    run_id: str, current_round: Callable[[], int], zeros: torch.Tensor
) -> Callable[..., bytes]:
    """up(i, **fields): a well-formed uplink from "evil" for the round open now, with
    `fields` overriding its defaults."""

    def up(i: int, **kw: Any) -> bytes:
        fields: dict[str, Any] = dict(
            fleet=FLEET,
            run_id=run_id,
            device_id="evil",
            device_type="t0",
            round_id=current_round(),
            params=zeros,
            num_samples=1 + i % 7,
            record=dict(RECORD),
        )
        fields.update(kw)
        return M.encode(M.Uplink(**fields))

    return up


def hostile_kinds(
    run_id: str, current_round: Callable[[], int], d: int
) -> dict[str, tuple[str, Callable[[int], bytes]]]:
    """Kind -> (topic, payload maker by index). The payloads mirror the probe's kinds;
    `current_round` is the round open now (the latest downlink's), so that the checks after
    decoding (type, sampling) are what refuses them rather than the round id: `not_sampled`
    is refused as such while its round is still open when the server reads it."""
    up_evil = topics.uplink(FLEET, "evil")
    zeros = torch.zeros(d)

    up = _uplink_maker(run_id, current_round, zeros)

    def raw(extra: str) -> Callable[[int], bytes]:
        return lambda i: raw_uplink(
            (FLEET, run_id, current_round()), ("evil", "t0"), zeros, extra, nonce=i
        )

    nested = '"num_samples":1,"scalars":' + "[" * 20000 + "]" * 20000
    return {
        "garbage": (up_evil, lambda i: os.urandom(64)),
        "bad_hash": (up_evil, lambda i: with_flipped_bit(up(i))),
        "pickle": (up_evil, lambda i: pickle.dumps({"i": i})),
        "version": (up_evil, lambda i: up(i, version=99)),
        "wrong_kind": (up_evil, lambda i: M.encode(M.Ack(FLEET, "evil", i + 1, True))),
        "shape": (up_evil, lambda i: up(i, params=torch.zeros(d + 1))),
        "non_finite": (up_evil, lambda i: with_nan_entry(up(i))),
        "topic_mismatch": (up_evil, lambda i: up(i, device_id="d0")),
        "unknown_device": (topics.uplink(FLEET, "ghost"), lambda i: up(i, device_id="ghost")),
        "wrong_device_type": (up_evil, lambda i: up(i, device_type="t9")),
        "stale_round": (up_evil, lambda i: up(i, round_id=current_round() + 1000 + i)),
        "not_sampled": (up_evil, up),
        "num_samples_2^63": (up_evil, raw(f'"num_samples":{2**63}')),
        "int_4300_digits": (up_evil, raw('"num_samples":' + "9" * 5000)),
        "int_1e309": (up_evil, raw('"num_samples":1,"relative_fa":1' + "0" * 309)),
        "nested_json": (up_evil, raw(nested)),
        "empty_device_topic": (f"wakefl/{FLEET}/up/", lambda i: b"x" * (i % 50 + 1)),
        "forged_decline": (
            up_evil,
            lambda i: M.encode(M.Decline(FLEET, run_id, "d0", current_round(), "forged")),
        ),
        "garbage_hello": (topics.hello(FLEET, "evil"), lambda i: os.urandom(32)),
    }


def _rejections(db: Path) -> Counter[str]:
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return Counter(dict(con.execute("SELECT reason, count FROM rejections").fetchall()))
        finally:
            con.close()
    except sqlite3.Error:
        return Counter()


def _round_past(devices: Sequence[Any], opened: int) -> bool:
    """Whether a device has opened a round after `opened`."""
    return max(dv.open_round for dv in devices) > opened


def _rejected_since(db: Any, before: int, count: int) -> bool:
    """Whether the server has rejected at least `count` uplinks since it had `before`."""
    return sum(_rejections(db).values()) - before >= count


def _wait(pred: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


class _PeakRss:
    """Follows a process's peak resident memory (VmHWM) on a thread until `stop()`."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            try:
                for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.peak_kb = max(self.peak_kb, int(line.split()[1]))
            except OSError:
                pass
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _server_command(
    broker_url: str, state: Path, registry: str, n_devices: int, width: float
) -> list[str]:
    """`wakefl server` for the fleet: a quorum of every honest device, rounds until stopped."""
    return server_command(
        broker_url, state, FLEET, registry,
        "--min-clients", str(n_devices), "--rounds", "100000", "--round-timeout", "120",
        "--random-weights", "--width", str(width), "-v",
    )  # fmt: skip


def _run_figures(log_path: Path, devices: list[HonestDevice], target: int, peak_kb: int) -> dict:
    """What the server's log and the honest devices show after a run."""
    text = log_path.read_text(errors="replace")
    times = [
        float(line.split(" updates in ")[1].split(" s")[0])
        for line in text.splitlines()
        if "closed by" in line and " updates in " in line
    ]
    return dict(
        tracebacks=text.count("Traceback (most recent call last)"),
        # updates of rounds up to `target` (the run stops while round target+1 is open)
        honest_sent=sum(sum(1 for r in dv.sent if r <= target) for dv in devices),
        honest_accepted=sum(sum(1 for r in dv.accepted if r <= target) for dv in devices),
        honest_refused=sum(len(dv.refused) for dv in devices),
        round_times=times,
        peak_rss_mb=peak_kb / 1024,
        log=str(log_path),
    )


def run_once(
    workdir: Path, n_devices: int, width: float, flood: int, rounds: int, deadline: float
) -> dict:
    """One server run; with `flood` > 0 the flood runs from round 1 until it is sent and
    counted, and the run then ends after the next round; otherwise after `rounds` rounds."""
    workdir.mkdir(parents=True)
    broker = ManagedBroker(workdir / "broker").start()
    state = workdir / "server"
    honest = {f"d{i}": "t0" for i in range(n_devices)}
    registry = ",".join(f"{d}:{t}" for d, t in {**honest, "evil": "t0"}.items())
    log_path = workdir / "server.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = _server_command(broker.url, state, registry, n_devices, width)
    devices: list[HonestDevice] = []
    result: dict = {"sent": Counter(), "refused": {}, "reasons": {}}
    target = rounds
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    rss = _PeakRss(proc)
    try:
        devices = [HonestDevice(broker.url, d, t) for d, t in honest.items()]
        if not _wait(lambda: any(dv.sent for dv in devices), 120):
            raise RuntimeError(f"round 1 never started; see {log_path}")
        if flood:
            _flood(broker.url, state / "server.sqlite", devices, width, flood, deadline, result)
            target = max(dv_round for dv_round in (max(dv.sent) for dv in devices)) + 1
        _wait(lambda: all(target in dv.accepted for dv in devices), 300, 0.1)
        # the next round must close too, so the last accepted updates are aggregated
        _wait(lambda: _closed_rounds(log_path) >= target, 60, 0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        rss.stop()
        for dv in devices:
            dv.close()
        broker.stop()
    result.update(_run_figures(log_path, devices, target, rss.peak_kb))
    return result


def _flood(
    broker_url: str,
    db: Path,
    devices: list[HonestDevice],
    width: float,
    flood: int,
    deadline: float,
    result: dict,
) -> None:
    """Every hostile kind in turn, `flood` messages in all, each kind counted on the
    server's side before the next begins; sent and refused counts go into `result`."""
    run_id = json.loads(
        sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        .execute("SELECT value FROM meta WHERE key='run_id'")
        .fetchone()[0]
    )
    d = 190154 if abs(width - 0.25) < 1e-9 else None
    if d is None:
        from wakefl.models.kws_cnn import KwsCnn, ModelConfig, get_flat_params

        d = get_flat_params(KwsCnn(ModelConfig(width=width))).numel()
    kinds = hostile_kinds(run_id, lambda: max(max(dv.open_round for dv in devices), 1), d)
    per_kind = -(-flood // len(kinds))
    attacker = MqttLink(broker_url, "flood-attacker", clean_start=True).connect(20)
    try:
        for kind, (topic, make) in kinds.items():
            before = sum(_rejections(db).values())
            before_by = _rejections(db)
            for i in range(per_kind):
                if time.monotonic() > deadline:
                    break
                if kind in PER_ROUND_KINDS and i % ROUND_BURST == 0:
                    opened = max(dv.open_round for dv in devices)
                    _wait(partial(_round_past, devices, opened), 30, 0.002)
                attacker.publish(topic, make(i), wait=False)
                result["sent"][kind] += 1
                if i % 200 == 199:  # keep the server's queue far below its limit
                    _wait(
                        partial(_rejected_since, db, before, result["sent"][kind] - 1000), 60, 0.1
                    )
            _wait(
                partial(_rejected_since, db, before, result["sent"][kind]),
                120,
                0.1,
            )
            after = _rejections(db)
            result["refused"][kind] = sum(after.values()) - before
            result["reasons"][kind] = dict(after - before_by)
    finally:
        attacker.close()


def _closed_rounds(log_path: Path) -> int:
    return sum(
        1 for line in log_path.read_text(errors="replace").splitlines() if "closed by" in line
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=3, help="honest devices")
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--messages", type=int, default=10000, help="hostile messages in all (>= 1000)")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the whole benchmark")
    args = p.parse_args(argv)
    if args.messages < 1000 or args.devices < 1:
        p.error("need --messages >= 1000 and --devices >= 1")
    deadline = time.monotonic() + args.timeout
    with tempfile.TemporaryDirectory(prefix="wakefl-hostile-") as tmp:
        flood = run_once(Path(tmp) / "flood", args.devices, args.width, args.messages, 0, deadline)
        rounds = min(max(3, len(flood["round_times"])), 40)
        calm = run_once(Path(tmp) / "calm", args.devices, args.width, 0, rounds, deadline)
        print(
            f"hostile flood: {sum(flood['sent'].values())} messages of {len(flood['sent'])} kinds, "
            f"{args.devices} honest devices, width {args.width}"
        )
        print(f"{'kind':<22}{'sent':>7}{'refused':>9}  reasons")
        for kind, n in flood["sent"].items():
            print(
                f"{kind:<22}{n:>7}{flood['refused'].get(kind, 0):>9}  {flood['reasons'].get(kind, {})}"
            )
        total_sent, total_refused = sum(flood["sent"].values()), sum(flood["refused"].values())
        print(f"{'total':<22}{total_sent:>7}{total_refused:>9}")
        for name, r in (("without flood", calm), ("with flood", flood)):
            t = r["round_times"]
            print(
                f"{name}: {len(t)} rounds, round wall time median {statistics.median(t):.2f} s, "
                f"max {max(t):.2f} s; honest updates accepted {r['honest_accepted']}/"
                f"{r['honest_sent']} (refused {r['honest_refused']}); tracebacks {r['tracebacks']}; "
                f"server peak RSS {r['peak_rss_mb']:.0f} MB"
            )
        ratio = flood["peak_rss_mb"] / max(calm["peak_rss_mb"], 1e-9)
        print(f"server peak memory with/without flood: {ratio:.3f}")
        slowdown = statistics.median(flood["round_times"]) / statistics.median(calm["round_times"])
        print(f"round wall time median with/without flood: {slowdown:.2f}")
        targets = {
            "0 tracebacks": flood["tracebacks"] == 0 and calm["tracebacks"] == 0,
            "0 honest updates lost": flood["honest_accepted"] == flood["honest_sent"]
            and calm["honest_accepted"] == calm["honest_sent"],
            "every hostile message counted": total_refused == total_sent,
            "round median within 2x of without flood": slowdown <= 2.0,
            "no round above 5 s": max(flood["round_times"]) <= 5.0,
            "peak memory within 10%": ratio <= 1.10,
        }
        for name, met in targets.items():
            print(f"target {name}: {'met' if met else 'NOT MET'}")
        ok = all(targets.values())
        print("RESULT:", "ok" if ok else "FAILED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
