"""The embedded default broker: a managed mosquitto subprocess on 127.0.0.1.

Why mosquitto rather than an in-process Python broker (measured on Debian 12): mosquitto
2.0 starts in ~20 ms, moves ~200 MB/s of 12 MB messages on loopback, speaks MQTT 5 (the
reason codes the protocol relies on: an ACL-denied publish returns 0x87), keeps sessions
and retained messages on disk (autosave), and enforces the same password file, ACL and
TLS as the production config. amqtt, the in-process alternative, speaks only MQTT 3.1.1
(denials and oversize drops are silent), moves 45-70 MB/s, keeps sessions in memory only
and can hang on shutdown. Any standard broker works through its URL instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from wakefl.errors import ConfigError

MOSQUITTO_USER = "mosquitto"
# Above the protocol's 64 MiB message limit plus the MQTT header.
DEFAULT_MAX_PACKET = 64 * 1024 * 1024 + 64 * 1024


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prctl() -> Callable[..., int] | None:
    """libc's prctl on Linux (resolved in the parent: the child between fork and exec
    should do no more than call it), None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent() -> Callable[[], None]:
    """A `preexec_fn` making the child receive SIGTERM (mosquitto then saves its state and
    exits) when the process starting it dies, however it dies: a SIGKILL of the server
    cannot leave its broker running. Why a parent-death signal: a process group dies only
    when the group is signalled, not when its leader is killed alone, and a watchdog is one
    more process that can itself be killed. Linux sends the signal when the *thread* that
    started the child ends, so a ManagedBroker must be started by a thread that lives as
    long as it should (the main thread, in every caller)."""
    prctl = _prctl()
    parent = os.getpid()

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return preexec


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports on 127.0.0.1: every socket stays bound until all are
    chosen, so the system cannot hand out one port twice (brokers started together)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def free_port() -> int:
    return free_ports(1)[0]


def accepting(port: int) -> bool:
    """Whether something already accepts connections on 127.0.0.1:`port`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def run_as_user() -> pwd.struct_passwd | None:
    """mosquitto started as root drops to the `mosquitto` user; files it writes must be
    owned by that user."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(MOSQUITTO_USER)
    except KeyError:
        return None


def reachable_by(path: Path, pw: pwd.struct_passwd) -> bool:
    """Can `pw`'s user traverse every ancestor of `path` (needed to reach its files)?"""
    for parent in [path, *path.parents]:
        st = parent.stat()
        if st.st_uid == pw.pw_uid:
            ok = st.st_mode & 0o100
        elif st.st_gid == pw.pw_gid:
            ok = st.st_mode & 0o010
        else:
            ok = st.st_mode & 0o001
        if not ok:
            return False
    return True


def _chown_tree(path: Path, pw: pwd.struct_passwd | None) -> None:
    if pw is None:
        return
    for p in [path, *path.rglob("*")]:
        os.chown(p, pw.pw_uid, pw.pw_gid)


class ManagedBroker:
    """mosquitto on 127.0.0.1:`port` with persistence in `state_dir`.

    `autosave_s`: seconds between saves of the broker's state (server/config/mosquitto.conf
    says why not every second). `extra_conf` lines are appended to the listener (e.g.
    password_file, acl_file, TLS); `listener_conf` replaces the default plain listener."""

    def __init__(
        self,
        state_dir: str | Path,
        port: int | None = None,
        *,
        autosave_s: int = 30,
        extra_conf: str = "",
        listener_conf: str | None = None,
        max_packet: int = DEFAULT_MAX_PACKET,
        binary: str | None = None,
        conf_file: str | Path | None = None,
        max_queued: int = 10000,
        sys_interval: int = 10,
    ) -> None:
        """`conf_file`: run that configuration as is (e.g. the one `wakefl provision`
        rendered from server/config/mosquitto.conf) instead of writing one; `port` must
        then be the port it listens on."""
        self.state_dir = Path(state_dir).resolve()
        self.port = port or free_port()
        self.autosave_s = autosave_s
        self.extra_conf = extra_conf
        self.listener_conf = listener_conf
        self.max_packet = max_packet
        self.binary = binary or shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not Path(self.binary).exists():
            raise ConfigError(
                "mosquitto is not installed (Debian: apt-get install mosquitto); "
                "or pass --broker mqtt://HOST:PORT of an existing broker"
            )
        self.conf_file = Path(conf_file).resolve() if conf_file else None
        self.max_queued = max_queued
        self.sys_interval = sys_interval
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def conf_path(self) -> Path:
        return self.conf_file or self.state_dir / "mosquitto.conf"

    def _write_conf(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "data").mkdir(exist_ok=True)
        pw = run_as_user()
        # As root, mosquitto switches to the `mosquitto` user, which must reach the
        # persistence dir; under a private (0700) ancestor such as pytest's or a home
        # directory it could not, so the loopback-only embedded broker keeps root there.
        user = "user root\n" if pw is not None and not reachable_by(self.state_dir, pw) else ""
        listener = self.listener_conf or (f"listener {self.port} 127.0.0.1\nallow_anonymous true\n")
        # With passwords on, a client id is its username: otherwise one stolen device
        # password could connect with the server's (or another device's) client id and the
        # broker would hand it that session, disconnecting the real client. Anonymous
        # clients have no username to bind (docs/PROTOCOL.md: what anonymous mode guarantees).
        auth = "password_file" in listener + self.extra_conf
        bind_id = "use_username_as_clientid true\n" if auth else ""
        conf = (
            "# written by wakefl.server.broker\n"
            "per_listener_settings false\n"
            f"{user}"
            "persistence true\n"
            f"persistence_location {self.state_dir / 'data'}/\n"
            f"autosave_interval {self.autosave_s}\n"
            "autosave_on_changes false\n"
            f"max_packet_size {self.max_packet}\n"
            f"max_queued_messages {self.max_queued}\n"
            f"sys_interval {self.sys_interval}\n"
            "max_inflight_messages 20\n"
            "persistent_client_expiration 7d\n"
            "log_dest stderr\n"
            # notice: "Outgoing messages are being dropped for client X" (queue overflow)
            "log_type error\nlog_type warning\nlog_type notice\n"
            f"{bind_id}"
            f"{listener}{self.extra_conf}\n"
        )
        self.conf_path.write_text(conf)
        _chown_tree(self.state_dir, pw)

    def start(self, timeout: float = 10.0) -> ManagedBroker:
        if self.running:
            return self
        # Readiness below is "the port accepts": with another process already there, this
        # broker would fail to bind and its clients would talk to that process instead.
        if accepting(self.port):
            raise ConfigError(
                f"127.0.0.1:{self.port} is already taken by another process; stop it or "
                "give the broker another port"
            )
        if self.conf_file is None:
            self._write_conf()
        else:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.state_dir / "mosquitto.log", "ab")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(
            [self.binary, "-c", str(self.conf_path)],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent(),  # noqa: PLW1509 - only prctl runs before exec
        )
        log.close()
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                tail = (self.state_dir / "mosquitto.log").read_text(errors="replace")[-2000:]
                raise ConfigError(f"mosquitto exited with {self.proc.returncode}:\n{tail}")
            if accepting(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise ConfigError(f"mosquitto did not listen on 127.0.0.1:{self.port} within {timeout} s")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, kill: bool = False, timeout: float = 5.0) -> None:
        """SIGTERM (mosquitto saves its state) or SIGKILL (state as of the last autosave)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, kill: bool = False) -> ManagedBroker:
        self.stop(kill=kill)
        return self.start()

    def __enter__(self) -> ManagedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
