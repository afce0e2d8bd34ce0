"""Progress bars show on a terminal and stay out of logs, pipes and CI output."""

from __future__ import annotations

import io

from tqdm import tqdm

from wakefl.progress_bars import bar_disabled


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_only_on_a_terminal():
    log = io.StringIO()
    for _ in tqdm(range(3), file=log, disable=bar_disabled(True)):
        pass
    assert log.getvalue() == ""
    term = _Terminal()
    for _ in tqdm(range(3), file=term, disable=bar_disabled(True)):
        pass
    assert "3/3" in term.getvalue()
    quiet = _Terminal()
    for _ in tqdm(range(3), file=quiet, disable=bar_disabled(False)):
        pass
    assert quiet.getvalue() == ""
