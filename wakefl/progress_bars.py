"""Progress bars (tqdm) only where a person watches them."""

from __future__ import annotations


def bar_disabled(progress: bool) -> bool | None:
    """tqdm's `disable` for a `progress` flag: off when not asked for; when asked, None,
    with which tqdm turns the bar off where its stream is no terminal (a log file, a pipe,
    CI), where its carriage-return updates would pile up into one long line."""
    return None if progress else True
