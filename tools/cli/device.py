"""`wakefl device`: run one device of a fleet over MQTT until the server ends the run."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from wakefl.protocol import topics


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "device",
        help="run one device of the fleet over MQTT",
        description="Join a fleet as device ID of type TYPE, train on the manifest's train "
        "clips of that type, report relative FA/FR on its val clips, and take "
        "part in rounds until the server announces the end of the run.",
    )
    _add_identity_options(p)
    _add_protocol_options(p)
    _add_export_options(p)
    _add_run_limit_options(p)
    p.set_defaults(func=_run)


def _add_identity_options(p: argparse.ArgumentParser) -> None:
    """Who the device is, its data, its broker, fleet and state folder."""
    p.add_argument("--id", required=True, dest="device_id", help="device id (its MQTT client id)")
    p.add_argument("--type", required=True, dest="device_type", help="device type in the manifest")
    p.add_argument("--data", required=True, help="corpus manifest.csv")
    from wakefl.tools.cli.broker_option import HELP

    p.add_argument("--broker", default=None, help=HELP)
    p.add_argument("--state", required=True, help="folder for the device's persistent state")
    p.add_argument(
        "--fleet",
        default=topics.DEFAULT_FLEET,
        help=f"fleet name (default: {topics.DEFAULT_FLEET})",
    )
    p.add_argument(
        "--width",
        type=float,
        default=None,
        help="expected model width; refuse a server that runs another one",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the local minibatches")
    p.add_argument(
        "--enrol",
        nargs="+",
        default=None,
        metavar="WAV",
        help="recordings of the user saying the wake phrase: each is checked (clipping, "
        "speech, length, likeness to the other takes) and kept in the state folder as a "
        "local positive for training and the served-model gate; a refused one says why. "
        "Kept takes never leave the device",
    )


def _add_protocol_options(p: argparse.ArgumentParser) -> None:
    """Delivery of the update and the report's operating point."""
    p.add_argument(
        "--ack-timeout",
        type=float,
        default=15.0,
        help="seconds to wait for the server's ack before re-sending (default 15; "
        "the server's ack_timeout_s wins when it sends one)",
    )
    p.add_argument(
        "--max-sends", type=int, default=4, help="sends of one update at most (default 4)"
    )
    p.add_argument(
        "--wire-dtype",
        choices=("fp32", "fp16"),
        default=None,
        help="dtype of the update on the wire (default: what the server asks for)",
    )
    p.add_argument(
        "--target-fr",
        type=float,
        default=0.05,
        help="baseline operating point for the relative FA/FR report (default 0.05)",
    )
    p.add_argument(
        "--val-streams",
        type=Path,
        default=None,
        metavar="MANIFEST",
        help="more of the device's own negative audio for the served-model gate: this "
        "manifest's validation streams of the device type join the validation data, cut "
        "every --val-stream-hop seconds (e.g. a `corpus build --profile fleet-valstreams` "
        "add-on)",
    )
    p.add_argument(
        "--val-stream-hop",
        type=float,
        default=0.5,
        help="seconds between the windows cut from the device type's validation streams, "
        "which join the validation clips as negatives for the served-model gate and the "
        "report (default 0.5; 0: clips only). A manifest without validation streams has "
        "clips only either way",
    )
    p.add_argument(
        "--train-stream-hop",
        type=float,
        default=0.0,
        help="seconds between the windows cut from the device type's training streams, "
        "which join its training clips as negatives (default 0: clips only)",
    )
    p.add_argument(
        "--gate-ties",
        choices=("keep", "switch"),
        default="keep",
        help="served-model gate on a tie with the served model (the same errors on the "
        "validation clips): keep it (default) or switch to the new model",
    )


def _add_export_options(p: argparse.ArgumentParser) -> None:
    """The models written at the end of the run."""
    p.add_argument(
        "--export",
        default=None,
        help="write the served model (the served-model gate's choice; safetensors) here at the end",
    )
    p.add_argument(
        "--export-personal",
        default=None,
        help="write the latest personalized model (safetensors) here at the end",
    )
    p.add_argument("--onnx", default=None, help="write the served model as ONNX here at the end")


def _add_run_limit_options(p: argparse.ArgumentParser) -> None:
    """When the device leaves, and logging."""
    p.add_argument("--max-rounds", type=int, default=None, help="leave after this many rounds")
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=30.0,
        help="give up when the broker cannot be reached for this long (default 30)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        help="give up after this many seconds without a message from the server",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log transport events")


def _run(args: argparse.Namespace) -> int:
    import torch

    from wakefl.log_format import configure, progress_printer
    from wakefl.sdk.device_client import DeviceClient
    from wakefl.tools.cli.broker_option import resolve_broker

    configure(args.verbose)
    torch.set_num_threads(1)

    say = progress_printer("wakefl.device")

    train, val = _load_clips(args, say)
    client = DeviceClient(
        args.device_id,
        args.device_type,
        train,
        args.state,
        validation=val,
        broker_url=resolve_broker(args.broker),
        fleet=args.fleet,
        seed=args.seed,
        ack_timeout_s=args.ack_timeout,
        max_sends=args.max_sends,
        wire_dtype=args.wire_dtype,
        target_fr=args.target_fr,
        expected_width=args.width,
        progress=say,
        gate_ties=args.gate_ties,
    )
    if args.enrol:
        _enrol(client, args.enrol, say)
    # SIGTERM leaves cleanly (state is committed at every step anyway).
    signal.signal(signal.SIGTERM, lambda *_: client.stop())
    try:
        summary = client.run(
            max_rounds=args.max_rounds,
            idle_timeout=args.idle_timeout,
            connect_timeout=args.connect_timeout,
        )
        _exports(args, client, summary, say)
    finally:
        client.close()
    say(
        f"{args.device_id}: {summary.rounds_seen} round(s) seen, {summary.rounds_trained} "
        f"trained, {summary.updates_accepted} update(s) accepted"
        + ("; run finished" if summary.finished else "")
    )
    return 0


def _enrol(client, takes: list[str], say) -> None:
    """Check and keep the enrolment takes, saying what became of each."""
    results = client.enrol(takes)
    for r in results:
        verdict = f"kept ({'training' if r.split == 'train' else 'validation'})"
        say(f"enrolment take {r.name}: " + (verdict if r.accepted else f"refused: {r.reason}"))
    kept = sum(r.accepted for r in results)
    say(
        f"{client.device_id}: {kept} of {len(results)} enrolment take(s) kept; the device "
        f"holds {client.enrolment.count('train')} training and "
        f"{client.enrolment.count('val')} validation take(s)"
    )


def _load_clips(args: argparse.Namespace, say):
    """The device type's training clips and its validation clips (None without any), each
    with the windows of its streams of that split among them where asked
    (`--train-stream-hop`, `--val-stream-hop`)."""
    from wakefl.errors import ConfigError
    from wakefl.models.kws_cnn import ModelConfig
    from wakefl.sdk.dataset import WakeWordDataset

    window = ModelConfig(width=args.width or 1.0).window_samples
    train = WakeWordDataset(args.data, args.device_type, "train", window_samples=window)
    train_note = ""
    if getattr(args, "train_stream_hop", 0.0):
        train, train_note = _with_stream_windows(args, train, "train", args.train_stream_hop)
    try:
        val = WakeWordDataset(args.data, args.device_type, "val", window_samples=window)
    except ConfigError as exc:  # a device without validation clips trains but cannot report
        say(f"{args.device_id}: no validation clips ({exc}); no relative FA/FR report")
        val = None
    val_note = ""
    if getattr(args, "val_streams", None) is not None and args.val_stream_hop == 0:
        raise ConfigError("--val-streams needs --val-stream-hop > 0 to cut its streams")
    if val is not None and args.val_stream_hop != 0:
        val, val_note = _with_stream_windows(args, val, "val", args.val_stream_hop)
        if getattr(args, "val_streams", None) is not None:
            val, more = _with_stream_windows(
                args, val, "val", args.val_stream_hop, source=args.val_streams
            )
            val_note = (
                val_note[:-1] + more + ")" if val_note else f" ({more.removeprefix(' and ')})"
            )
    say(
        f"{args.device_id} ({args.device_type}): {len(train)} training examples{train_note}, "
        f"{0 if val is None else len(val)} validation examples{val_note}; joining fleet "
        f"{args.fleet!r}"
    )
    return train, val


def _with_stream_windows(
    args: argparse.Namespace, clips, split: str, hop: float, source: Path | None = None
):
    """`clips` joined by the windows of the device type's `split` streams (of `--data`, or
    of `source`) every `hop` seconds (as they are when it has none), and the words saying
    so."""
    from wakefl.errors import ConfigError
    from wakefl.sdk.stream_windows import ADDON_UNIT_PREFIX, JoinedDataset, StreamWindows

    if hop < 0:
        raise ConfigError(f"--{split}-stream-hop must be >= 0, got {hop}")
    if source is not None and not Path(source).is_file():
        raise ConfigError(f"--val-streams {source}: no such manifest")
    windows = StreamWindows(
        source or args.data, args.device_type, split, clips.window_samples, hop,
        unit_prefix="" if source is None else ADDON_UNIT_PREFIX,
    )  # fmt: skip
    if not len(windows):
        return clips, ""
    if source is not None:
        note = f" and {len(windows)} windows of {windows.streams} stream(s) of {source}"
        return JoinedDataset(clips, windows), note
    note = f" ({len(clips)} clips and {len(windows)} windows of {windows.streams} stream(s))"
    return JoinedDataset(clips, windows), note


def _exports(args: argparse.Namespace, client, summary, say) -> None:
    """The end-of-run exports and what the device serves."""
    if summary.served:
        fa, fr = summary.served.get("relative_fa"), summary.served.get("relative_fr")
        figs = f"FA {fa:.3f}, FR {fr:.3f}" if fa is not None and fr is not None else ""
        say(
            f"{args.device_id} serves the {summary.served['model']} model of round "
            f"{summary.served['round']}"
            + (f" (relative to the baseline on its validation data: {figs})" if figs else "")
        )
    if args.export_personal and client.personal_params() is not None:
        say(f"personal model written to {client.export_personal_model(args.export_personal)}")
    if client.served_params() is None:
        return
    if args.export:
        say(f"served model written to {client.export_served_model(args.export)}")
        from wakefl.sdk.gate_record import write_gate_record

        write_gate_record(args.export, summary)
    if args.onnx:
        say(f"served model exported to {client.export_onnx(args.onnx)}")


if __name__ == "__main__":
    from wakefl.tools.cli import main

    sys.exit(main(["device", *sys.argv[1:]]))
