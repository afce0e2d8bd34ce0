"""Paths as results record them: a committed result must not carry the folders of the
machine that produced it (its home, its scratch space), only where a file lies relative to
the run or corpus folder, or inside the wakefl cache."""

from __future__ import annotations

import os
from pathlib import Path

from .cache_location import cache_root

CACHE_MARK = "$WAKEFL_CACHE"


def recorded_path(path: str | Path, base: str | Path | None = None) -> str:
    """`path` as a result records it: inside the cache as `$WAKEFL_CACHE/...`; else
    relative to `base` (the run or corpus folder the result describes; `..` allowed); with
    no base, relative to the working folder when inside it, else its folder and name."""
    p = Path(os.path.abspath(path))
    cache = Path(os.path.abspath(cache_root()))
    if p == cache or cache in p.parents:
        return Path(CACHE_MARK, p.relative_to(cache)).as_posix()
    if base is not None:
        return Path(os.path.relpath(p, os.path.abspath(base))).as_posix()
    cwd = Path.cwd()
    if cwd in p.parents:
        return p.relative_to(cwd).as_posix()
    return Path(p.parent.name, p.name).as_posix()
