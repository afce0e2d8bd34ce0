"""Where wakefl keeps what it can rebuild (synthesized speech, corpora, warm-start models):
$WAKEFL_CACHE, else ~/.cache/wakefl. Read at call time, so a test or a CI job can point it
elsewhere."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    env = os.environ.get("WAKEFL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "wakefl"
