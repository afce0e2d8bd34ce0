"""The wire protocol is one package that both ends import (docs/ARCHITECTURE.md): nothing
in protocol/ imports the device SDK, the server or the tools, and the protocol's modules
exist only there."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = ("wakefl.sdk", "wakefl.server", "wakefl.tools")
MODULES = (
    "frames",
    "messages",
    "message_types",
    "message_checks",
    "message_encode",
    "message_decode",
    "round_settings",
    "records",
    "topics",
    "codec_names",
    "update_codec",
)


def _imported_modules(path: Path) -> list[str]:
    """Every module an `import` or `from ... import` of the file names, at any depth."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside wakefl.protocol
                names.append("wakefl.protocol" + ("." + node.module if node.module else ""))
            elif node.module:
                names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _forbidden(names: list[str]) -> list[str]:
    return [n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]


@pytest.mark.parametrize("path", sorted((REPO / "protocol").glob("*.py")), ids=lambda p: p.name)
def test_protocol_imports_no_sdk_server_or_tools(path: Path) -> None:
    assert _forbidden(_imported_modules(path)) == []


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    # The rule itself, on a file that breaks it in each way an import can be written.
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import wakefl.server.ingest\n"
        "from wakefl.sdk import serving\n"
        "from wakefl import tools\n"
        "def f():\n"
        "    from wakefl.sdk.selffl.strategy import Strategy\n"
    )
    found = _forbidden(_imported_modules(bad))
    assert found == [
        "wakefl.server.ingest",
        "wakefl.sdk",
        "wakefl.sdk.serving",
        "wakefl.tools",
        "wakefl.sdk.selffl.strategy",
        "wakefl.sdk.selffl.strategy.Strategy",
    ]


@pytest.mark.parametrize("name", MODULES)
def test_protocol_modules_live_only_in_wakefl_protocol(name: str) -> None:
    assert importlib.util.find_spec(f"wakefl.protocol.{name}") is not None
    assert importlib.util.find_spec(f"wakefl.sdk.{name}") is None
    assert importlib.util.find_spec(f"wakefl.sdk.selffl.{name}") is None
