"""Check the limits the source tree keeps; print each breach and exit 1 if any.

- Lines per file: at most 600 in every package folder and in tests/, 400 in protocol/,
  300 for sdk/device_client.py (FILE_LIMITS; the first matching rule applies).
- Modules per folder: at most 12 under tools/ (a module is a .py file other than
  `__init__.py` and `__main__.py`, which only make the folder a package or a command).
- Imports with the grain: no cycle between modules (an import at any depth counts, a lazy
  one in a function included: it is the same dependency, only deferred), and nothing outside
  tools/cli imports tools/cli (a command module is never a library), bar the names in
  KNOWN_CLI_IMPORTS.

Usage: python scripts/check_module_limits.py (the checks take no options: the limits are
the project's, docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# import path prefix -> folder at the repository root (pyproject's package-dir).
PACKAGES = {
    "wakefl.models": "models",
    "wakefl.protocol": "protocol",
    "wakefl.sdk": "sdk",
    "wakefl.server": "server",
    "wakefl.edge_runtime": "edge_runtime",
    "wakefl.tools": "tools",
    "wakefl": "wakefl",
}
LINE_FOLDERS = (*PACKAGES.values(), "tests")
# (path prefix relative to the root, most lines): the first rule that matches a file wins.
FILE_LIMITS = (
    ("sdk/device_client.py", 300),
    ("protocol/", 400),
    ("", 600),
)
MODULES_PER_TOOLS_FOLDER = 12
NOT_MODULES = ("__init__.py", "__main__.py")
CLI_PACKAGE = "wakefl.tools.cli"
# Imports of tools/cli from outside it that a change under way still has to remove
# ("importer -> imported"); none today. A name here that no longer occurs is reported too.
KNOWN_CLI_IMPORTS: frozenset[str] = frozenset()


def python_files(folder: Path) -> list[Path]:
    """The .py files under `folder`, sorted, with virtual environments and caches left out."""
    return sorted(
        p
        for p in folder.rglob("*.py")
        if not {".venv", "__pycache__", "build"} & set(p.relative_to(folder).parts)
    )


def line_limit(relative: str) -> int:
    return next(most for prefix, most in FILE_LIMITS if relative.startswith(prefix))


def long_files(root: Path = ROOT) -> Iterator[str]:
    """One line per file over its line limit."""
    for folder in LINE_FOLDERS:
        for path in python_files(root / folder):
            relative = path.relative_to(root).as_posix()
            lines = len(path.read_text(encoding="utf-8").splitlines())
            most = line_limit(relative)
            if lines > most:
                yield f"{relative}: {lines} lines (max {most})"


def crowded_folders(root: Path = ROOT) -> Iterator[str]:
    """One line per folder under tools/ with more modules than the limit."""
    for folder in sorted({p.parent for p in python_files(root / "tools")} | {root / "tools"}):
        modules = [p for p in folder.glob("*.py") if p.name not in NOT_MODULES]
        if len(modules) > MODULES_PER_TOOLS_FOLDER:
            relative = folder.relative_to(root).as_posix()
            yield f"{relative}/: {len(modules)} modules (max {MODULES_PER_TOOLS_FOLDER})"


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Import name -> file of every module in the packages (a package is its __init__)."""
    out: dict[str, Path] = {}
    for prefix, folder in PACKAGES.items():
        for path in python_files(root / folder):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((prefix, *parts))
            out.setdefault(name, path)  # "wakefl" comes last: its own folder only
    return out


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules that module `name` (file `path`) imports, at any depth."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(name, path)
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            # `from a import b`: b is a module when one has that name, else a name in a.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a name: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = module_files(root)
    known = set(files)
    return {name: imports_of(name, path, known) for name, path in files.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan's algorithm, made
    iterative so that a deep chain of imports cannot exhaust the stack), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups)


def _is_cli(name: str) -> bool:
    return name == CLI_PACKAGE or name.startswith(CLI_PACKAGE + ".")


def cli_imports(graph: dict[str, set[str]]) -> list[str]:
    """`importer -> imported` for every import of tools/cli from a module outside it."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if not _is_cli(name)
        for target in targets
        if _is_cli(target)
    )


@dataclass(frozen=True)
class ImportFindings:
    cycles: list[list[str]]
    unknown_cli_imports: list[str]
    stale_exceptions: list[str]

    def lines(self) -> Iterable[str]:
        for group in self.cycles:
            yield f"import cycle: {' <-> '.join(group)}"
        for edge in self.unknown_cli_imports:
            yield f"imports a command module (tools/cli is no library): {edge}"
        for edge in self.stale_exceptions:
            yield f"KNOWN_CLI_IMPORTS names an import that is gone, remove it: {edge}"


def import_findings(
    graph: dict[str, set[str]], known_cli_imports: frozenset[str] = KNOWN_CLI_IMPORTS
) -> ImportFindings:
    found = cli_imports(graph)
    return ImportFindings(
        cycles=import_cycles(graph),
        unknown_cli_imports=[e for e in found if e not in known_cli_imports],
        stale_exceptions=sorted(known_cli_imports - set(found)),
    )


def breaches(root: Path = ROOT) -> list[str]:
    """Every breach of the limits, one line each."""
    return [
        *long_files(root),
        *crowded_folders(root),
        *import_findings(import_graph(root)).lines(),
    ]


def main() -> int:
    found = breaches()
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} breach(es) of the module limits", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
