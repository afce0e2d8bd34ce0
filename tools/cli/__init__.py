"""The `wakefl` command. Each sub-command lives in its own module, which provides
`register(subparsers)`; modules are imported only when their command runs, so that
`wakefl edge detect` on a detection-only device never imports torch."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from wakefl import __version__
from wakefl.errors import WakeflError

# command -> (module implementing it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "model": ("wakefl.tools.cli.model", "inspect and export the wake-word model"),
    "edge": ("wakefl.tools.cli.edge", "streaming wake-word detection with onnxruntime"),
    "corpus": ("wakefl.tools.cli.corpus", "build a synthetic corpus or import recordings"),
    "eval": ("wakefl.tools.cli.eval", "relative FA/FR of candidates against a baseline"),
    "paper": ("wakefl.tools.cli.paper", "the Self-FL paper's synthetic Gaussian study"),
    "server": ("wakefl.tools.cli.server", "run the aggregation server over MQTT"),
    "device": ("wakefl.tools.cli.device", "run one device of the fleet over MQTT"),
    "provision": ("wakefl.tools.cli.provision", "provision broker credentials for a device"),
    "experiment": ("wakefl.tools.cli.experiment", "the paper's wake-word study"),
    "demo": ("wakefl.tools.cli.demo", "a small federation end to end, with a report"),
    "status": ("wakefl.tools.cli.status", "the fleet as the server recorded it"),
}


# The commands a core install (numpy + onnxruntime, no torch) runs; the others need the
# `full` extra.
CORE_COMMANDS = ("edge",)


def missing_extra(command: str, exc: ModuleNotFoundError) -> Exception:
    """A module of the `full` extra is missing: a one-line error naming the extra; a
    missing wakefl module is a broken install, and keeps its traceback."""
    missing = (exc.name or "").split(".")[0]
    if not missing or missing == "wakefl":
        return exc
    return WakeflError(
        f"'wakefl {command}' needs the full install (missing the Python module "
        f"'{missing}'): pip install 'wakefl[full]'; a core install runs only 'wakefl "
        f"{' / '.join(CORE_COMMANDS)}'"
    )


class _Parser(argparse.ArgumentParser):
    """argparse's parser, ending on a bad argument with the same final line as any other
    refusal (log_format.final_line); its sub-command parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        from wakefl.log_format import final_line, is_terminal

        if is_terminal(sys.stderr):
            self.print_usage(sys.stderr)
        else:
            message += f" (`{self.prog} --help` lists the options)"
        print(final_line(self.prog, f"error: {message}", sys.stderr), file=sys.stderr)
        sys.exit(2)


def _build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="wakefl",
        description="wakefl: on-device wake-word personalization with federated learning "
        "(Self-FL). `wakefl COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"wakefl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen command's module is imported; the others are listed by name.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        if name == chosen:
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name == module:
                    raise WakeflError(f"command '{name}' is not available in this build") from exc
                raise missing_extra(name, exc) from None
            mod.register(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from wakefl.log_format import configure, final_line

    configure()  # one format for every command's log lines; -v raises the level
    try:
        parser = _build_parser(argv)
        args = parser.parse_args(argv)
        func = getattr(args, "func", None)
        if func is None:
            parser.print_help()
            return 2
        try:
            result = func(args)
        except ModuleNotFoundError as exc:
            raise missing_extra(args.command, exc) from None
        return int(result or 0)
    except WakeflError as exc:
        print(final_line("wakefl", f"error: {exc}", sys.stderr), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(final_line("wakefl", "interrupted", sys.stderr, "WARNING"), file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (`wakefl ... | head`): stop quietly, as other commands do. Python
        # would flush stdout again at exit and fail once more; point it at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
