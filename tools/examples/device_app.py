"""Embedding the wakefl SDK in a device app: take part in federated rounds, report the
personal model's relative FA/FR, then serve wake-word detections with the edge runtime.

    .venv/bin/python tools/examples/device_app.py --type A

Its data is `--data MANIFEST`, by default the demo corpus that `bash scripts/demo.sh`
builds (~/.cache/wakefl/corpus/demo-seed0/manifest.csv); `wakefl corpus build --profile
tiny --out corpus` makes one in about 40 s (`--data corpus/manifest.csv`). With `--broker URL` the app joins
a fleet whose server runs elsewhere (`wakefl server`). Without it, the example starts what
a real deployment runs elsewhere: a managed mosquitto on 127.0.0.1 and an aggregation
server for `--rounds` rounds that starts the fleet from the shipped model (`--model`).
The served model is exported to `--out` (default runs/device-app/served.onnx) and kept;
detections run at the threshold it carries.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from wakefl.cache_location import cache_root
from wakefl.edge_runtime import OnnxScorer, StreamingDetector, load_audio
from wakefl.sdk import DeviceClient, WakeWordDataset, read_manifest


def start_demo_fleet(workdir: Path, model: str, rounds: int, device_id: str, device_type: str):
    """A local broker and server, standing in for the fleet's infrastructure; the fleet
    starts from the shipped model `model`."""
    from wakefl.models.kws_cnn import get_flat_params
    from wakefl.models.kws_cnn.pretrained import load_pretrained
    from wakefl.sdk.selffl.registry import make_strategy
    from wakefl.server.aggregation_server import AggregationServer, ServerConfig
    from wakefl.server.broker import ManagedBroker

    # Its own folder directly under /tmp: mosquitto started as root runs as the mosquitto
    # user and must reach its persistence folder.
    broker = ManagedBroker(tempfile.mkdtemp(prefix="wakefl-demo-broker-")).start()
    shipped = load_pretrained(model)
    args = {"lr": 0.05, "batch_size": 8, "l_max": 5, "warmup_steps": 3}
    server = AggregationServer(
        ServerConfig(
            broker_url=broker.url,
            state_dir=workdir / "server",
            initial_params=get_flat_params(shipped),
            model_config=shipped.cfg.to_dict(),
            rounds=rounds,
            round_timeout=120,
            devices={device_id: device_type},
            strategy_args=args,
            ack_timeout_s=5,
        ),
        make_strategy("selffl", **args),
        progress=lambda line: print(f"  [server] {line}"),
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    return broker, server, thread


def serve_detections(onnx_path: Path, manifest: Path, device_type: str) -> None:
    """Serve detections: stream a recording chunk by chunk (here: clips of the test split
    played back to back, as a microphone would deliver them), at the threshold the model
    carries in its metadata."""
    scorer = OnnxScorer(onnx_path, threads=1)
    detector = StreamingDetector(scorer, hop_s=0.1)
    print(f"detecting at threshold {detector.threshold:.4f}: {detector.threshold_source}")
    rows = [
        r
        for r in read_manifest(manifest)
        if r.device_type == device_type and r.split == "test" and r.kind == "clip"
    ][:8]
    audio = np.concatenate([load_audio(r.resolve(manifest), scorer.sample_rate) for r in rows])
    truth = [i * 1.5 for i, r in enumerate(rows) if r.label == 1]
    chunk = scorer.sample_rate // 10  # 100 ms of audio at a time
    detections = []
    for start in range(0, audio.size, chunk):
        detections += detector.push(audio[start : start + chunk])
    print(
        f"streamed {audio.size / scorer.sample_rate:.1f} s of audio; wake word spoken in "
        f"the clips starting at {truth} s"
    )
    for d in detections:
        print(f"  detection at {d.time_s:.1f} s (score {d.score:.2f})")
    if not detections:
        print("  no detection")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--data",
        type=Path,
        default=cache_root() / "corpus" / "demo-seed0" / "manifest.csv",
        help="corpus manifest.csv (default: the demo corpus scripts/demo.sh builds)",
    )
    ap.add_argument("--type", default="A", help="this device's type")
    ap.add_argument("--id", default="kitchen-speaker-1", help="this device's id")
    ap.add_argument(
        "--broker", default=None, help="join this broker's fleet (default: a local demo fleet)"
    )
    ap.add_argument("--state", default=None, help="state folder (default: a temporary one)")
    ap.add_argument(
        "--model",
        choices=("full", "small"),
        default="full",
        help="the shipped model the demo fleet starts from (default full)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the demo fleet (default 2)")
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("runs/device-app/served.onnx"),
        help="where the served model is exported, and kept (default runs/device-app/served.onnx)",
    )
    add_enrolment_option(ap)
    args = ap.parse_args()
    if not args.data.is_file():
        sys.exit(
            f"device_app: error: no manifest at {args.data}: make a small corpus in about "
            "40 s, `wakefl corpus build --profile tiny --out corpus`, and pass --data "
            "corpus/manifest.csv (or build the demo's with `bash scripts/demo.sh`)"
        )
    return args


# ----------------------------------------------------------------------------- enrolment
def add_enrolment_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--enrol",
        nargs="+",
        type=Path,
        default=None,
        metavar="WAV",
        help="recordings of the user saying the wake phrase, taken at set-up: the good ones "
        "become the device's own positives (they never leave it)",
    )


def enrol_user(device: DeviceClient, takes: list[Path]) -> None:
    """Set-up: "say the wake word three times". Each take is checked (clipping, speech,
    length, likeness to the other takes); a refused one says why, so the app can ask the
    user again. Kept takes stay in the device's state folder and join its training and
    validation data from the next round on."""
    for r in device.enrol(takes):
        if r.accepted:
            print(
                f"  enrolment: {r.name} kept for {'training' if r.split == 'train' else 'validation'}"
            )
        else:
            print(f"  enrolment: {r.name} refused: {r.reason}; please say the phrase again")


# ----------------------------------------------------------------------------- reporting
def gate_line(gate: dict, served: str) -> str:
    """The served-model gate's last decision in words. The gate names the model served
    before the decision "served"; here it is named."""
    reason = str(gate.get("reason", ""))
    if gate.get("switched"):
        return f"switched to it: {reason}"
    reason = reason.removeprefix("the served model is kept: ")
    reason = re.sub(r"\b(than|vs|as) served\b", rf"\1 the {served} model", reason)
    return f"kept it: {reason}" if reason else "kept it"


def print_rounds(summary) -> None:
    """What the device's rounds gave: updates accepted, and the relative FA/FR of each
    round's personalized model on the local validation clips."""
    print(
        f"took part in {summary.rounds_trained} round(s); "
        f"{summary.updates_accepted} update(s) accepted by the server"
    )
    for o in summary.outcomes:
        if o.relative_fa is not None:
            print(
                f"  round {o.round_id}: relative FA {o.relative_fa:.3f} at relative "
                f"FR {o.relative_fr:.3f} against the baseline (local validation clips)"
            )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)

    # 1. The device's local data: its own training clips, and validation clips for the
    #    relative FA/FR report. 1.5 s windows at 16 kHz, as the model expects.
    train = WakeWordDataset(args.data, args.type, "train", window_samples=24000)
    val = WakeWordDataset(args.data, args.type, "val", window_samples=24000)

    # The fleet's and the device's working state: temporary (the demo fleet is new each
    # run); what the device exports goes to --out and stays.
    work = Path(tempfile.mkdtemp(prefix="wakefl-device-app-"))
    state_dir = Path(args.state) if args.state else work / "state"
    broker = server = thread = None
    try:
        if args.broker is None:
            broker, server, thread = start_demo_fleet(
                work, args.model, args.rounds, args.id, args.type
            )
        url = args.broker if broker is None else broker.url

        # 2. Join the fleet and take part in rounds until the server ends the run. State
        #    (personal model, variance, pending update) survives a power cut at any point.
        with DeviceClient(
            args.id,
            args.type,
            train,
            state_dir,
            validation=val,
            broker_url=url,
            progress=lambda line: print(f"  [device] {line}"),
        ) as device:
            # 2a. Enrolment (optional): the user's own takes of the phrase.
            if args.enrol:
                enrol_user(device, args.enrol)
            summary = device.run()
            print_rounds(summary)

            # 3. Hand the served model to the edge runtime (ONNX; the runtime turns audio into its input):
            #    the served-model gate's choice among the model served so far, the new
            #    personalized model and the global one (the baseline until one is better).
            if summary.served:
                model = summary.served["model"]
                print(f"serving the {model} model; the gate {gate_line(summary.gate or {}, model)}")
            onnx_path = device.export_onnx(args.out)
            print(f"served model exported: {onnx_path} ({onnx_path.stat().st_size / 1e6:.2f} MB)")

        # 4. Serve detections from the served model.
        serve_detections(onnx_path, args.data, args.type)
    finally:
        if thread is not None:
            thread.join(timeout=30)
        if broker is not None:
            broker.stop()
            shutil.rmtree(broker.state_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
