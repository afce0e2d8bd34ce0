"""The `python -m wakefl.tools...` scripts refuse bad input in one line and exit 2
(tools/script_errors.py), as the `wakefl` command line does, instead of a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from wakefl.errors import ConfigError
from wakefl.tools.script_errors import run_script


def test_a_refusal_is_one_line_and_status_2(capsys) -> None:
    def refuses() -> int:
        raise ConfigError("no such corpus")

    assert run_script(refuses, "/x/tools/bench/detection.py") == 2
    assert capsys.readouterr().err == "detection: error: no such corpus\n"
    assert run_script(lambda: None, "x.py") == 0 and run_script(lambda: 3, "x.py") == 3


def test_the_detection_benchmark_refuses_a_folder_without_a_corpus(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "wakefl.tools.bench.detection", "--pretrained", "small"]
        + ["--corpus", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("detection: error: ") and "manifest.csv" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
