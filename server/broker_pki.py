"""The production broker's keys and accounts: a private CA and the broker's certificate
(openssl), broker passwords (mosquitto_passwd), and files only their owner (or the broker's
user) may read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from wakefl.errors import ConfigError
from wakefl.sdk.atomic_files import write_atomic


def run_tool(cmd: list[str]) -> None:
    """Run an openssl or mosquitto tool; ConfigError with its stderr when it fails."""
    if shutil.which(cmd[0]) is None:
        raise ConfigError(f"{cmd[0]} is not installed (Debian: mosquitto / openssl)")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ConfigError(f"{' '.join(cmd[:3])} failed: {proc.stderr.strip()[-500:]}")


def write_private(path: Path, data: dict[str, Any]) -> None:
    """`data` as JSON in `path`, readable by its owner only (it holds a password)."""
    write_atomic(path, (json.dumps(data, indent=2) + "\n").encode(), mode=0o600)


def ensure_ca(state: Path, host: str) -> None:
    """A private CA and a server certificate for `host` (IP or DNS name), made once."""
    if (state / "server.crt").is_file():
        return
    run_tool(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "3650",
            "-subj",
            "/CN=wakefl-ca",
            "-keyout",
            str(state / "ca.key"),
            "-out",
            str(state / "ca.crt"),
        ]
    )
    run_tool(
        [
            "openssl",
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={host}",
            "-keyout",
            str(state / "server.key"),
            "-out",
            str(state / "server.csr"),
        ]
    )
    kind = "IP" if host.replace(".", "").isdigit() or ":" in host else "DNS"
    (state / "server.ext").write_text(f"subjectAltName={kind}:{host}\n")
    run_tool(
        [
            "openssl",
            "x509",
            "-req",
            "-in",
            str(state / "server.csr"),
            "-CA",
            str(state / "ca.crt"),
            "-CAkey",
            str(state / "ca.key"),
            "-CAcreateserial",
            "-days",
            "3650",
            "-extfile",
            str(state / "server.ext"),
            "-out",
            str(state / "server.crt"),
        ]
    )
    os.chmod(state / "ca.key", 0o600)


def chown_for_broker(state: Path) -> None:
    """mosquitto started as root switches to the `mosquitto` user before reading these."""
    if os.geteuid() != 0:
        return
    import pwd

    try:
        pw = pwd.getpwnam("mosquitto")
    except KeyError:
        return
    for p in [
        state,
        state / "broker-data",
        *[
            state / n
            for n in ("ca.crt", "server.crt", "server.key", "passwd", "acl", "mosquitto.conf")
        ],
    ]:
        if p.exists():
            os.chown(p, pw.pw_uid, pw.pw_gid)
