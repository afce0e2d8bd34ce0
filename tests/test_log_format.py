"""One log format: Python logging and the progress lines share a time-stamped layout."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

from wakefl.log_format import configure, progress_line

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING|ERROR) wakefl\.[a-z.]+: .+$")


def test_progress_lines_and_log_records_share_the_format(capsys):
    assert LINE.match(progress_line("wakefl.server", "round 1/3: sampled 2"))
    configure()
    configure(verbose=True)  # installed once, level raised
    root = logging.getLogger()
    try:
        assert root.level == logging.INFO
        assert sum(type(h).__name__ == "_Handler" for h in root.handlers) == 1
        logging.getLogger("wakefl.device").warning("hello not delivered: %s", "timeout")
        err = capsys.readouterr().err.strip().splitlines()
        assert err and LINE.match(err[-1]) and err[-1].endswith("hello not delivered: timeout")
    finally:
        configure()


def test_the_server_prints_its_progress_in_the_log_format(tmp_path):
    """`wakefl server` with an embedded broker: its first progress line is stamped."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "wakefl.tools.cli", "server", "--broker", "embedded"]
        + ["--state", str(tmp_path / "s"), "--random-weights", "--width", "0.05"]
        + ["--devices", "d1:A"]
        + ["--start-timeout", "1", "--rounds", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=120)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines and all(LINE.match(ln) for ln in lines), out
    assert "came online" in err  # no device: a one-line error, after stamped progress
