"""The tree's limits (scripts/check_module_limits.py, run by CI): each rule as a table test
on a made-up graph or tree, and the rules that the tree already keeps checked on it, so that
an import cycle or an import of a command module fails here too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "check_module_limits", REPO / "scripts" / "check_module_limits.py"
)
assert _spec is not None and _spec.loader is not None
limits = importlib.util.module_from_spec(_spec)
sys.modules["check_module_limits"] = limits  # dataclasses look their module up by name
_spec.loader.exec_module(limits)


@pytest.mark.parametrize(
    ("graph", "cycles"),
    [
        ({"a": set(), "b": {"a"}}, []),
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_import_cycles(graph: dict[str, set[str]], cycles: list[list[str]]) -> None:
    assert limits.import_cycles(graph) == cycles


def test_a_long_chain_of_imports_does_not_exhaust_the_stack() -> None:
    n = 5000
    graph = {f"m{i}": {f"m{i + 1}"} for i in range(n)} | {f"m{n}": {"m0"}}
    assert [len(g) for g in limits.import_cycles(graph)] == [n + 1]


CLI = "wakefl.tools.cli"


@pytest.mark.parametrize(
    ("graph", "known", "unknown", "stale"),
    [
        # The command line may import anything, and its modules one another.
        ({f"{CLI}": {f"{CLI}.eval", "wakefl.sdk"}, f"{CLI}.eval": {CLI}}, set(), [], []),
        ({"wakefl.tools.x": {f"{CLI}.eval"}}, set(), [f"wakefl.tools.x -> {CLI}.eval"], []),
        ({"wakefl.sdk.y": {CLI}}, set(), [f"wakefl.sdk.y -> {CLI}"], []),
        # A known exception passes while it is there, and is reported once it is gone.
        ({"wakefl.tools.x": {f"{CLI}.eval"}}, {f"wakefl.tools.x -> {CLI}.eval"}, [], []),
        (
            {"wakefl.tools.x": set()},
            {f"wakefl.tools.x -> {CLI}.eval"},
            [],
            ["wakefl.tools.x -> " + f"{CLI}.eval"],
        ),
    ],
)
def test_imports_of_the_command_line(graph, known, unknown, stale) -> None:
    found = limits.import_findings(graph, frozenset(known))
    assert (found.unknown_cli_imports, found.stale_exceptions) == (unknown, stale)


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_graph_resolves_each_way_an_import_is_written(tmp_path: Path) -> None:
    _write(tmp_path, "tools/__init__.py", "")
    _write(tmp_path, "tools/a/__init__.py", "from .b import f\n")
    _write(tmp_path, "tools/a/b.py", "import numpy\nfrom wakefl.tools.a import c\ndef f(): ...\n")
    _write(tmp_path, "tools/a/c.py", "def g():\n    from ..a.b import f\n")
    _write(tmp_path, "tools/d.py", "import wakefl.tools.a.c.g\nfrom wakefl.tools.a import f\n")
    _write(tmp_path, "wakefl/__init__.py", "")
    graph = limits.import_graph(tmp_path)
    assert graph == {
        "wakefl": set(),
        "wakefl.tools": set(),
        "wakefl.tools.a": {"wakefl.tools.a.b"},
        "wakefl.tools.a.b": {"wakefl.tools.a.c"},
        "wakefl.tools.a.c": {"wakefl.tools.a.b"},  # a lazy import counts
        "wakefl.tools.d": {"wakefl.tools.a.c", "wakefl.tools.a"},
    }
    assert limits.import_cycles(graph) == [["wakefl.tools.a.b", "wakefl.tools.a.c"]]


@pytest.mark.parametrize(
    ("relative", "most"),
    [
        ("sdk/device_client.py", 300),
        ("sdk/device_state.py", 600),
        ("protocol/frames.py", 400),
        ("tools/fleet/demo.py", 600),
        ("tests/test_server_rounds.py", 600),
    ],
)
def test_line_limits(relative: str, most: int) -> None:
    assert limits.line_limit(relative) == most


def test_long_files_and_crowded_folders_are_reported(tmp_path: Path) -> None:
    _write(tmp_path, "protocol/ok.py", "x = 1\n" * 400)
    _write(tmp_path, "protocol/long.py", "x = 1\n" * 401)
    _write(tmp_path, "tests/test_long.py", "x = 1\n" * 601)
    for i in range(12):
        _write(tmp_path, f"tools/full/m{i}.py", "")
        _write(tmp_path, f"tools/over/m{i}.py", "")
    _write(tmp_path, "tools/full/__init__.py", "")
    _write(tmp_path, "tools/full/__main__.py", "")
    _write(tmp_path, "tools/over/m12.py", "")
    assert list(limits.long_files(tmp_path)) == [
        "protocol/long.py: 401 lines (max 400)",
        "tests/test_long.py: 601 lines (max 600)",
    ]
    assert list(limits.crowded_folders(tmp_path)) == ["tools/over/: 13 modules (max 12)"]


def test_the_tree_has_no_import_cycle_and_no_library_use_of_the_command_line() -> None:
    found = limits.import_findings(limits.import_graph())
    assert list(found.lines()) == []


def test_folders_under_tools_keep_the_module_limit() -> None:
    assert list(limits.crowded_folders()) == []
