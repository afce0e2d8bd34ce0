"""The README's demo tables, rendered from the demo's own results.

Each `wakefl demo` run writes `report/demo_results.json` (tools/fleet/demo.py). A run the
README reports is committed under tools/results/, and the README holds its table between

    <!-- demo-table: tools/results/<run>/demo_results.json -->
    ...
    <!-- /demo-table -->

and a profile's runs over seeds side by side between `<!-- demo-spread: PATH PATH ... -->`
and `<!-- /demo-spread -->`. `python -m wakefl.tools.studies.demo_readme` rewrites every
such block from its JSON; `--check` exits 1 when a block differs from what its JSON renders
(tests/test_demo_readme.py runs the check), so a change that moves the figures shows in
review as a changed JSON and a changed table, never as a table edited by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from wakefl.tools.fleet.demo_report import counts_line, readme_table, spread_table

BLOCK = re.compile(
    r"(<!-- demo-table: (?P<path>[^ ]+) -->\n)(?P<body>.*?)(<!-- /demo-table -->)", re.DOTALL
)
# One profile over seeds: `<!-- demo-spread: PATH PATH ... -->`, the runs' JSON files.
SPREAD = re.compile(
    r"(<!-- demo-spread: (?P<paths>[^>]+?) -->\n)(?P<body>.*?)(<!-- /demo-spread -->)",
    re.DOTALL,
)


def render(doc: dict[str, Any]) -> list[str]:
    """The Markdown lines of one run: what ran and how long it took, the table, and the
    counts of gains and losses beyond their intervals."""
    return [
        f"`{doc['command']}`: {doc['elapsed_s']} s.",
        "",
        *readme_table(doc["rows"]),
        "",
        counts_line(doc["rows"]),
    ]


def rewrite(readme: str, root: Path) -> str:
    """`readme` with every demo-table block rendered from its JSON (paths from `root`)."""

    def block(m: re.Match) -> str:
        doc = json.loads((root / m.group("path")).read_text())
        return m.group(1) + "\n".join(render(doc)) + "\n" + m.group(4)

    def spread(m: re.Match) -> str:
        docs = [json.loads((root / p).read_text()) for p in m.group("paths").split()]
        return m.group(1) + "\n".join(spread_table(docs)) + "\n" + m.group(4)

    return SPREAD.sub(spread, BLOCK.sub(block, readme))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Render the README's demo tables from their JSON.")
    ap.add_argument("--readme", type=Path, default=Path("README.md"))
    ap.add_argument("--check", action="store_true", help="exit 1 when a table is out of date")
    args = ap.parse_args(argv)
    text = args.readme.read_text()
    new = rewrite(text, args.readme.resolve().parent)
    if args.check:
        if new != text:
            print(f"{args.readme}: a demo table differs from its JSON; run without --check")
            return 1
        return 0
    args.readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
