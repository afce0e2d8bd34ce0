"""Installs GnuSpeech (the `@echogarden/gnuspeech-wasm` package and its one dependency) for
the corpus's speech engines, without npm: each package's registry tarball is downloaded,
checked against the integrity hash pinned below, and unpacked into a `node_modules` folder
(by default `.venv/share/wakefl-gnuspeech/node_modules`, where tools/corpus/gnuspeech.py
looks). Idempotent: a folder already holding these versions is left as it is.

Usage: python scripts/install_gnuspeech.py [DEST]
"""

from __future__ import annotations

import base64
import hashlib
import io
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

# name -> (version, tarball, sha512 integrity as the npm registry publishes it)
PACKAGES = {
    "@echogarden/gnuspeech-wasm": (
        "0.3.0",
        "https://registry.npmjs.org/@echogarden/gnuspeech-wasm/-/gnuspeech-wasm-0.3.0.tgz",
        "sha512-ZXogAAuRxU98JyJg7/VebaDcy9yJKgImlhp3IHKUMvkctKYgI+xDatL+QXEDdY78Mk3yo3W/vMTq44jTLQilzg==",
    ),
    "wasm-heap-manager": (
        "0.4.1",
        "https://registry.npmjs.org/wasm-heap-manager/-/wasm-heap-manager-0.4.1.tgz",
        "sha512-YJWzJlG/WXoKTHDqCY8I8/+qDS9A29dwDzA6k87Em95ZdhuR8doWpjwWRKVwZmtFtEYjDcrgrNa1skaIce8ENQ==",
    ),
}
STAMP = ".wakefl-installed"


def _stamp_text() -> str:
    return "".join(f"{name} {ver}\n" for name, (ver, _, _) in sorted(PACKAGES.items()))


def _fetch(url: str, integrity: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as resp:  # noqa: S310 - a pinned https URL
        data = resp.read(64 << 20)
    algo, _, want = integrity.partition("-")
    got = base64.b64encode(hashlib.new(algo, data).digest()).decode()
    if got != want:
        raise SystemExit(f"install_gnuspeech: {url} does not match its pinned {algo} hash")
    return data


def _unpack(data: bytes, dest: Path) -> None:
    """The tarball's `package/` folder into `dest`, refusing any path that leaves it."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if not parts or parts[0] != "package" or ".." in parts or member.name.startswith("/"):
                raise SystemExit(f"install_gnuspeech: unexpected path {member.name!r} in a tarball")
            if not (member.isfile() or member.isdir()):
                continue
            target = dest.joinpath(*parts[1:])
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            assert src is not None
            target.write_bytes(src.read())


def install(dest: Path) -> None:
    if (dest / STAMP).is_file() and (dest / STAMP).read_text() == _stamp_text():
        return
    dest.mkdir(parents=True, exist_ok=True)
    for name, (version, url, integrity) in PACKAGES.items():
        data = _fetch(url, integrity)
        target = dest / name
        shutil.rmtree(target, ignore_errors=True)
        _unpack(data, target)
        print(f"[setup] GnuSpeech: {name} {version} in {target}")
    (dest / STAMP).write_text(_stamp_text())


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    install(
        Path(sys.argv[1])
        if len(sys.argv) > 1
        else root / ".venv/share/wakefl-gnuspeech/node_modules"
    )
