"""`wakefl server`: the aggregation server over MQTT (see docs/PROTOCOL.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wakefl.errors import ConfigError, WakeflError
from wakefl.protocol import topics
from wakefl.protocol.codec_names import CODECS, WIRE_DTYPE_NAMES


def parse_devices(spec: str) -> dict[str, str]:
    """`id:type,id:type` or a fleet file (JSON {"devices": {id: type}} as written by
    `wakefl provision`)."""
    path = Path(spec)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            devices = data["devices"] if isinstance(data, dict) and "devices" in data else data
            return {str(k): str(v) for k, v in devices.items()}
        except (json.JSONDecodeError, AttributeError, KeyError) as exc:
            raise ConfigError(f"fleet file {path} is not valid: {exc}") from exc
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if ":" not in item:
            raise ConfigError(f"--devices entry {item!r} must be ID:TYPE (or pass a fleet file)")
        dev, typ = item.split(":", 1)
        out[dev] = typ
    if not out:
        raise ConfigError("--devices is empty")
    return out


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _strategy_args(args: argparse.Namespace) -> dict[str, Any]:
    strategy_args = {}
    for item in args.strategy_arg:
        if "=" not in item:
            raise ConfigError(f"--strategy-arg {item!r} must be KEY=VALUE")
        k, v = item.split("=", 1)
        strategy_args[k] = _parse_value(v)
    if args.group_by == "device_type":
        strategy_args["cluster_by_group"] = True
    return strategy_args


def build_strategy(name: str, strategy_args: dict[str, Any]) -> Any:
    """The strategy `--strategy NAME --strategy-arg K=V ... --group-by G` asks for; every
    way those can be wrong ends in one ConfigError line, never a traceback."""
    from wakefl.sdk.selffl.registry import make_strategy

    try:
        return make_strategy(name, **strategy_args)
    except TypeError as exc:
        if "keyword argument" not in str(exc):  # a value of the wrong type
            raise ConfigError(f"strategy {name!r}: bad --strategy-arg value: {exc}") from None
        given = ", ".join(
            "--group-by device_type" if k == "cluster_by_group" else f"--strategy-arg {k}"
            for k in strategy_args
        )
        raise ConfigError(
            f"strategy {name!r} does not take one of {given}: {str(exc).split('.', 1)[-1].strip()}"
        ) from None
    except WakeflError:
        raise  # already one line (a hyperparameter out of range, not finite...)
    except (ValueError, OverflowError) as exc:
        raise ConfigError(f"strategy {name!r}: bad --strategy-arg value: {exc}") from None


def starting_model(init_model: str | None, random_weights: bool, width: float) -> str | None:
    """What `--init-model`, `--random-weights` and `--width` ask the fleet to start from:
    a checkpoint or shipped model as given, None for a random model of `width` (only when
    asked for), and by default the shipped model of `width`."""
    from wakefl.tools.training.warm_start import PRETRAINED_BY_WIDTH

    if init_model is not None and random_weights:
        raise ConfigError("give --init-model or --random-weights, not both")
    if random_weights:
        return None
    if init_model is not None:
        return init_model
    if width not in PRETRAINED_BY_WIDTH:
        widths = ", ".join(f"{w:g} ({n})" for w, n in sorted(PRETRAINED_BY_WIDTH.items()))
        raise ConfigError(
            f"no shipped model of width {width:g} (shipped: {widths}): give --init-model "
            "CHECKPOINT, or --random-weights to start from a random model"
        )
    return f"pretrained:{PRETRAINED_BY_WIDTH[width]}"


def describe_start(spec: str | None, width: float, seed: int) -> str:
    """The first line of the server's output: which model the fleet starts from."""
    if spec is None:
        return f"the fleet starts from a random model of width {width:g} (seed {seed})"
    if spec.startswith("pretrained:"):
        return f"the fleet starts from the shipped model {spec}"
    return f"the fleet starts from {spec}"


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP stop the server as Ctrl-C (SIGINT) does: the exception unwinds
    through every `finally`, so the server closes its link and state and stops the
    broker it started (Python's default for them ends the process at once, leaving the
    broker behind). A second signal during that unwinding is ignored."""
    caught: list[int] = []

    def stop(signum: int, frame: object) -> None:
        if not caught:
            caught.append(signum)
            raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _handler(args: argparse.Namespace) -> int:
    import torch

    from wakefl.log_format import configure, progress_printer
    from wakefl.models.kws_cnn import load_initial_model
    from wakefl.server.embedded_fleet import EMBEDDED, EMBEDDED_ANONYMOUS
    from wakefl.tools.cli.broker_option import resolve_broker

    torch.set_num_threads(1)
    configure(args.verbose)
    strategy_args = _strategy_args(args)
    strategy = build_strategy(args.strategy, strategy_args)
    state = Path(args.state)
    args.broker = resolve_broker(args.broker)
    if args.role == "worker" and args.broker in (EMBEDDED, EMBEDDED_ANONYMOUS):
        raise ConfigError("--role worker joins a coordinator's broker: pass its --broker URL")
    say = progress_printer("wakefl.server")
    if args.role == "worker":
        from wakefl.server.aggregation_worker import wait_for_store

        # The coordinator's model, once it initialised the shared state folder.
        params = wait_for_store(state, args.start_timeout).global_params
        model_config: dict[str, Any] = {}
        say(f"the fleet's model is the coordinator's, in {state}")
    else:
        spec = starting_model(args.init_model, args.random_weights, args.width)
        params, model_config = load_initial_model(spec, args.width, args.seed)
        say(describe_start(spec, args.width, args.seed))
    with stopped_by_signals():
        return _serve(args, state, params, model_config, strategy, strategy_args)


def _serve(
    args: argparse.Namespace,
    state: Path,
    params: Any,
    model_config: dict[str, Any],
    strategy: Any,
    strategy_args: dict[str, Any],
) -> int:
    """Start the embedded broker when asked for, run the server's role, and stop that
    broker however the run ends."""
    from wakefl.server.aggregation_server import ServerConfig

    devices = parse_devices(args.devices) if args.devices else None
    broker, url = _embedded_broker(args, state, devices)
    try:
        cfg = ServerConfig(
            broker_url=url,
            state_dir=state,
            initial_params=params,
            model_config=model_config,
            fleet=args.fleet,
            rounds=args.rounds,
            activity_rate=args.activity_rate,
            min_clients=args.min_clients,
            round_timeout=args.round_timeout,
            devices=devices,
            strategy_name=args.strategy,
            strategy_args=strategy_args,
            wire_dtype=args.wire_dtype,
            uplink_codec=args.uplink_codec,
            ack_timeout_s=args.ack_timeout,
            start_timeout=args.start_timeout,
            start_grace_s=args.start_grace,
            seed=args.seed,
        )
        _run_role(args, cfg, strategy)
    finally:
        if broker is not None:
            broker.stop()
    return 0


def _embedded_broker(
    args: argparse.Namespace, state: Path, devices: dict[str, str] | None
) -> tuple[Any, str]:
    """(the started embedded broker or None, the URL the server connects with). The
    embedded broker is provisioned as production is, one account per device, unless the
    anonymous one is asked for by name."""
    from wakefl.log_format import progress_printer
    from wakefl.server.broker import ManagedBroker
    from wakefl.server.embedded_fleet import EMBEDDED, EMBEDDED_ANONYMOUS, provision_embedded

    say = progress_printer("wakefl.server")
    if args.broker == EMBEDDED_ANONYMOUS:
        folder = state / "broker-anonymous"  # never the provisioned broker's files
        broker = ManagedBroker(folder, port=args.embedded_port).start()
        say(
            f"embedded broker: {broker.url}, ANONYMOUS (chosen): any local process may "
            f"publish as any device or as this server (persistence in {folder})"
        )
        return broker, broker.url
    if args.broker != EMBEDDED:
        return None, args.broker
    folder = state / "broker"
    fleet = provision_embedded(folder, devices or {}, args.fleet, args.embedded_port)
    fleet.broker.start()
    say(
        f"embedded broker: mqtts://127.0.0.1:{fleet.broker.port} with one account per device "
        f"(TLS, passwords, ACL) in {folder}; a device joins with "
        f"wakefl device --broker @{folder / 'devices'}/<id>.json ..."
    )
    return fleet.broker, fleet.server_url


def _run_role(args: argparse.Namespace, cfg: Any, strategy: Any) -> None:
    """One process (the default), or one of the processes of a sharded server sharing
    `--state` (docs/SCALE.md, "Sharded aggregation")."""
    from wakefl.log_format import progress_printer
    from wakefl.server.process_settings import apply_server_settings

    say = progress_printer("wakefl.server")
    apply_server_settings()  # every role handles model-sized updates on two threads
    if args.role == "single":
        from wakefl.server.aggregation_server import AggregationServer

        AggregationServer(cfg, strategy, progress=say).run()
    elif args.role == "coordinator":
        from wakefl.server.sharded_coordinator import ShardedCoordinator

        ShardedCoordinator(cfg, strategy, progress=say).run()
    else:
        from wakefl.server.aggregation_worker import AggregationWorker

        if not args.worker_id:
            raise ConfigError("--role worker needs --worker-id (unique among the workers)")
        worker = AggregationWorker(
            cfg, strategy, args.worker_id, group=args.share_group, progress=say
        )
        worker.run()


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "server", help="run the aggregation server over MQTT", description=__doc__
    )
    _add_fleet_options(p)
    _add_round_options(p)
    _add_model_options(p)
    _add_wire_options(p)
    _add_start_options(p)
    p.set_defaults(func=_handler)


def _add_fleet_options(p: argparse.ArgumentParser) -> None:
    """The broker, the state folder, the fleet and how its devices are grouped."""
    from wakefl.tools.cli.broker_option import HELP

    p.add_argument(
        "--broker",
        default=None,
        help=HELP + "; 'embedded': a managed mosquitto on 127.0.0.1, provisioned as "
        "production is (TLS, one password per --devices entry, the ACL) under "
        "STATE/broker, each device's credentials in STATE/broker/devices/<id>.json; "
        "'embedded-anonymous': a broker without accounts (under STATE/broker-anonymous), "
        "which any local process can use to pose as any device",
    )
    p.add_argument("--state", required=True, help="state directory (SQLite + models + updates)")
    p.add_argument(
        "--fleet",
        default=topics.DEFAULT_FLEET,
        help=f"fleet name, the topics' prefix (default {topics.DEFAULT_FLEET!r})",
    )
    p.add_argument(
        "--role",
        choices=["single", "coordinator", "worker"],
        default="single",
        help="single: one process does everything (default). A sharded server is one "
        "coordinator (runs the rounds, merges partial sums) and workers (record and "
        "acknowledge uplinks through a shared subscription, compute partial sums), all "
        "with the same --state folder, --fleet, --devices and strategy options",
    )
    p.add_argument("--worker-id", default=None, help="with --role worker: this worker's id")
    p.add_argument(
        "--share-group",
        default=topics.DEFAULT_SHARE_GROUP,
        help="with --role worker: the MQTT shared-subscription group of the workers",
    )
    p.add_argument(
        "--group-by",
        choices=["none", "device_type"],
        default="none",
        help="device_type: cluster-level aggregation with one representative per type",
    )


def _add_round_options(p: argparse.ArgumentParser) -> None:
    """Quorum, deadline, number of rounds and the share of devices sampled."""
    p.add_argument(
        "--min-clients",
        type=int,
        default=None,
        help="quorum: close a round once this many updates are in (default: all sampled "
        "that did not decline); also the number of devices that must be online "
        "before a round starts (default: see --start-grace)",
    )
    p.add_argument(
        "--round-timeout",
        type=float,
        default=600.0,
        help="seconds per round, its deadline (default 600)",
    )
    p.add_argument("--rounds", type=int, default=10, help="rounds in the run (default 10)")
    p.add_argument(
        "--activity-rate",
        type=float,
        default=1.0,
        help="share C of the devices sampled per round (default 1.0)",
    )


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """The starting model, the device registry and the strategy."""
    p.add_argument(
        "--init-model",
        default=None,
        help="the model the fleet starts from: a checkpoint (.safetensors with its .json) or "
        "a shipped model, pretrained:full or pretrained:small (default: the shipped model "
        "of --width, pretrained:full at 1.0, pretrained:small at 0.25)",
    )
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="start the fleet from a randomly initialised model of --width (seeded by "
        "--seed) instead of a shipped one",
    )
    p.add_argument(
        "--width",
        type=float,
        default=1.0,
        help="model width without --init-model: 1.0 or 0.25 picks the shipped model, any "
        "width with --random-weights (default 1.0)",
    )
    p.add_argument(
        "--devices",
        default=None,
        help="registry: ID:TYPE,... or a fleet.json from `wakefl provision`; "
        "without it devices register with their first hello",
    )
    p.add_argument(
        "--strategy",
        default="selffl",
        help="the federated strategy (default selffl; the baselines are listed in "
        "sdk/selffl/baselines/README.md)",
    )
    p.add_argument(
        "--strategy-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="strategy hyperparameter (repeatable), e.g. lr=0.01 l_max=40",
    )


def _add_wire_options(p: argparse.ArgumentParser) -> None:
    """What travels on the wire, and the devices' re-send interval."""
    p.add_argument(
        "--wire-dtype",
        choices=list(WIRE_DTYPE_NAMES),
        default="fp32",
        help="tensor dtype of the downlink (and of plain uplinks)",
    )
    p.add_argument(
        "--uplink-codec",
        choices=list(CODECS),
        default="",
        help="what devices send, announced in the downlink: the parameters in fp32/fp16, or "
        "the update relative to the round's global model in fp16 or int8 with one scale per "
        "256 entries (~0.25x the fp32 bytes); default: plain in --wire-dtype",
    )
    p.add_argument(
        "--ack-timeout", type=float, default=30.0, help="device re-send interval in s (default 30)"
    )


def _add_start_options(p: argparse.ArgumentParser) -> None:
    """Waiting for the fleet before the first round, the embedded broker, seed, logging."""
    p.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        help="give up if the devices needed are not online after this many seconds",
    )
    p.add_argument(
        "--start-grace",
        type=float,
        default=None,
        help="with --devices and no --min-clients: seconds to wait for every listed "
        "device before the first round, then start with those online "
        "(default: min(--round-timeout, 60))",
    )
    p.add_argument(
        "--embedded-port",
        type=int,
        default=None,
        help="port of --broker embedded (default: a free one)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the device sampling and of --random-weights (default 0)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log at INFO level: connections, devices, each round",
    )
