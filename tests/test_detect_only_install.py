"""The core install, as a detect-only device gets it: `pip install wakefl` into a fresh
virtual environment brings numpy and onnxruntime, not torch. There `wakefl edge detect`
runs a shipped model on a real recording at its shipped threshold, the environment stays
under 400 MB, and any other command says in one line which extra it needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_MB = 400


def _size_mb(folder: Path) -> float:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            p = Path(root) / f
            if not p.is_symlink():
                total += p.stat().st_size
    return total / 1e6


@pytest.mark.parametrize(
    "command", [["model", "info"], ["model", "export", "--pretrained", "small", "--out", "x.onnx"]]
)
def test_without_torch_other_commands_name_the_extra(command):
    # torch is not installed, as pip would leave it: its import fails like a missing module's.
    code = textwrap.dedent("""
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "torchaudio"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, NoTorch())
        from wakefl.tools.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    res = subprocess.run(
        [sys.executable, "-c", code, *command], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"'wakefl {command[0]}' needs the full install" in res.stderr
    assert "pip install 'wakefl[full]'" in res.stderr and "'torch'" in res.stderr


@pytest.mark.slow
def test_a_core_install_detects_without_torch(tmp_path, hey_nova_wav):
    from wakefl.models.kws_cnn.pretrained import pretrained_card
    from wakefl.tools.cli import main

    model = tmp_path / "small.onnx"
    assert main(["model", "export", "--pretrained", "small", "--out", str(model)]) == 0
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # A copy of the working tree, so the build leaves no files in the repository.
    src = tmp_path / "src"
    ignore = ("--exclude=.venv", "--exclude=.git", "--exclude=build", "--exclude=runs")
    subprocess.run(
        f"mkdir -p {src} && tar -C {REPO} {' '.join(ignore)} -cf - . | tar -C {src} -xf -",
        shell=True,
        check=True,
        timeout=120,
    )
    res = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "BuildBackendWarning" not in res.stderr
    listed = subprocess.run(
        [str(py), "-m", "pip", "list", "--format=json"], capture_output=True, text=True
    )
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"numpy", "onnxruntime", "wakefl"} <= names and "torch" not in names
    assert _size_mb(venv) < MAX_MB

    wakefl = str(venv / "bin" / "wakefl")
    res = subprocess.run(
        [wakefl, "edge", "detect", "--model", str(model), str(hey_nova_wav), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["threshold"] == pretrained_card("small")["threshold"]
    assert out["windows"] > 0 and out["duration_s"] > 1.5
    res = subprocess.run(
        [wakefl, "model", "info"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "wakefl[full]" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    # Every command's help still reads there, the corpus profiles' included.
    for command in (["corpus", "import"], ["corpus", "build"], ["eval"], ["server"]):
        res = subprocess.run(
            [wakefl, *command, "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path
        )
        assert res.returncode == 0 and res.stdout.startswith("usage: wakefl"), res.stderr
