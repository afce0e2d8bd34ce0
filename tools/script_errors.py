"""How the `python -m wakefl.tools...` scripts end on bad input: a refusal the project
raises (`wakefl.errors.WakeflError`: a missing corpus folder, an unfinished build, absurd
flags) is one line on stderr and exit status 2, as in the `wakefl` command line, never a
traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from wakefl.errors import WakeflError


def run_script(main: Callable[[], int | None], name: str) -> int:
    """`main()`'s exit status, or 2 after `<name>: error: <why>` on stderr when it refuses
    its input."""
    try:
        return int(main() or 0)
    except WakeflError as exc:
        print(f"{Path(name).stem}: error: {exc}", file=sys.stderr)
        return 2
