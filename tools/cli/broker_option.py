"""The `--broker` option of `wakefl server` and `wakefl device`, whose URL may hold a
password: given on the command line it shows in `ps`, so it can come from a file or the
environment instead.

- `--broker URL` (`mqtt://`, `mqtts://`, or `embedded` for the server);
- `--broker @FILE`: the `broker` key of a JSON file, as `wakefl provision` writes
  `server.json` and `devices/<id>.json` (mode 0600), or a text file holding the URL;
- no `--broker`: the environment variable WAKEFL_BROKER (a URL or `@FILE`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from wakefl.errors import ConfigError

BROKER_ENV = "WAKEFL_BROKER"
HELP = (
    "broker URL (mqtt://[user:pass@]host[:port], mqtts://...?ca=CA.pem), or @FILE: the "
    "'broker' of a JSON file such as `wakefl provision`'s server.json or devices/<id>.json "
    f"(keeps the password out of ps); default: ${BROKER_ENV}"
)


def _from_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the broker file {path}: {exc.strerror or exc}") from None
    if text.startswith("{"):
        try:
            url = json.loads(text).get("broker")
        except (ValueError, AttributeError):
            raise ConfigError(f"{path}: not a JSON object with a 'broker' URL") from None
        if not isinstance(url, str) or not url:
            raise ConfigError(f"{path}: no 'broker' URL in it")
        return url
    if not text or "\n" in text:
        raise ConfigError(f"{path}: expected one broker URL or a JSON object with 'broker'")
    return text


def resolve_broker(value: str | None, env: dict[str, str] | None = None) -> str:
    """The broker URL from `--broker` or, without it, from $WAKEFL_BROKER."""
    env = dict(os.environ) if env is None else env
    source = value if value is not None else env.get(BROKER_ENV)
    if not source:
        raise ConfigError(f"give --broker URL, --broker @FILE or set {BROKER_ENV}")
    if source.startswith("@"):
        return _from_file(Path(source[1:]).expanduser())
    return source
