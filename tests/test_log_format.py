"""One log format: Python logging and the progress lines share a time-stamped layout."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

from wakefl.log_format import configure, final_line, progress_line

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING|ERROR) wakefl\.[a-z.]+: .+$")
# The line a command ends on: `wakefl: error: ...` (or `wakefl server: error: ...` from
# the argument parser), stamped like the others.
FINAL = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ERROR wakefl( [a-z-]+)*: error: .+$")


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
    errors = [ln for ln in err.splitlines() if ln.strip()]
    assert errors and FINAL.match(errors[-1]) and "came online" in errors[-1], err
    assert all(LINE.match(ln) or FINAL.match(ln) for ln in errors), err


class _Terminal:
    def isatty(self) -> bool:
        return True


def test_the_final_line_is_plain_on_a_terminal_and_stamped_in_a_log(tmp_path):
    assert final_line("wakefl", "error: no such file", _Terminal()) == (
        "wakefl: error: no such file"
    )
    with (tmp_path / "log").open("w") as log:
        assert FINAL.match(final_line("wakefl", "error: no such file", log))


def test_a_refused_command_ends_its_log_on_a_stamped_line(tmp_path):
    """A refusal by the command and one by its argument parser, stderr into a file (a log):
    each ends on one stamped line, nothing else written."""
    refusals = [
        ["eval", "--manifest", str(tmp_path / "none.csv"), "--baseline", "b.onnx"],
        ["server", "--broker", "embedded"],  # --state missing
    ]
    for argv in refusals:
        with (tmp_path / "err.log").open("w") as log:
            proc = subprocess.run(
                [sys.executable, "-m", "wakefl.tools.cli", *argv],
                stdout=subprocess.DEVNULL,
                stderr=log,
                timeout=60,
            )
        lines = (tmp_path / "err.log").read_text().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and FINAL.match(lines[0]), lines
