"""List every function longer than a limit in the source folders; exit 1 if any.

A function's length is ``end_lineno - lineno + 1`` of its ``def`` (as Python's ``ast``
gives it), docstring and blank lines included, decorators excluded. Nested functions and
methods are counted on their own as well as inside the function that holds them.

Usage: python scripts/check_function_length.py [--max N] [PATH ...]
(defaults: 60 lines; models/, protocol/, sdk/, server/, edge_runtime/, tools/, wakefl/).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("models", "protocol", "sdk", "server", "edge_runtime", "tools", "wakefl")
DEFAULT_MAX_LINES = 60


def python_files(paths: list[Path]) -> Iterator[Path]:
    """Every .py file under the given folders (or the files themselves), sorted."""
    for path in paths:
        if path.is_file() and path.suffix == ".py":
            yield path
        elif path.is_dir():
            yield from sorted(p for p in path.rglob("*.py") if ".venv" not in p.parts)


def long_functions(path: Path, max_lines: int) -> Iterator[tuple[int, str, int]]:
    """(line, qualified name, length) of each function in `path` longer than `max_lines`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[int, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > max_lines:
                    yield child.lineno, name, length
                yield from visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            else:
                yield from visit(child, prefix)

    yield from visit(tree, "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--max", type=int, default=DEFAULT_MAX_LINES, help="longest allowed function, in lines"
    )
    parser.add_argument(
        "paths", nargs="*", type=Path, help="files or folders (default: the source folders)"
    )
    args = parser.parse_args(argv)
    paths = args.paths or [ROOT / d for d in SOURCE_DIRS]
    found = 0
    for path in python_files(paths):
        for line, name, length in long_functions(path, args.max):
            shown = (
                path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
            )
            print(f"{shown}:{line}: {name} is {length} lines (max {args.max})")
            found += 1
    if found:
        print(f"{found} function(s) longer than {args.max} lines", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
