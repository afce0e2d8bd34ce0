"""The `--help` texts: whole sentences, with the defaults stated."""

from __future__ import annotations

import pytest

from wakefl.tools.cli import main


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_texts_are_whole_and_state_defaults(capsys):
    top = _help(capsys)
    assert "`wakefl COMMAND --help` describes each command." in top and "status" in top
    edge = _help(capsys, "edge", "detect")
    assert "default: the model's shipped threshold" in edge and "(default 0.1)" in edge
    assert "(default 3)" in edge and "(default 1.0)" in edge
    server = _help(capsys, "server")
    for text in ("(default 'default')", "(default 10)", "default selffl", "(default 0)"):
        assert text in server, text
    assert "pretrained:full" in server and "@FILE" in server
    assert "split, onset_s, offset_s" in _help(capsys, "corpus", "import")
    assert "--random-weights" in _help(capsys, "model", "export")


def _all_help_argvs() -> list[list[str]]:
    """Every command and sub-command of `wakefl`, as the full install registers them."""
    import argparse

    from wakefl.tools.cli import COMMANDS, _build_parser

    def walk(parser: argparse.ArgumentParser, argv: list[str]) -> list[list[str]]:
        found = [argv]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    found += walk(child, [*argv, name])
        return found

    argvs: list[list[str]] = [[]]
    for command in COMMANDS:
        parser = _build_parser([command])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        argvs += walk(sub.choices[command], [command])
    return argvs


# A core install (numpy + onnxruntime): the `full` extra's modules, and what they bring in,
# fail to import as pip would leave them.
_CORE_ONLY = """
import json, sys

FULL = {"torch", "torchaudio", "onnx", "onnxscript", "librosa", "soundfile", "paho",
        "safetensors", "tqdm", "matplotlib", "scipy", "pyroomacoustics", "silero_vad"}

class FullExtraMissing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FULL:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, FullExtraMissing())
from wakefl.tools.cli import main

codes = []
for argv in json.loads(sys.argv[1]):
    try:
        codes.append(main(argv))
    except SystemExit as exc:
        codes.append(exc.code)
    print("\\n=====", flush=True)
print(json.dumps(codes))
"""


def test_every_help_works_on_the_core_install():
    import json
    import subprocess
    import sys

    argvs = _all_help_argvs()
    assert ["corpus", "import"] in argvs and ["model", "export"] in argvs
    res = subprocess.run(
        [sys.executable, "-c", _CORE_ONLY, json.dumps([[*a, "--help"] for a in argvs])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    *outputs, codes = res.stdout.split("\n=====\n")
    assert json.loads(codes) == [0] * len(argvs), (res.stderr, codes)
    for argv, out in zip(argvs, outputs, strict=True):
        assert out.startswith(f"usage: {' '.join(['wakefl', *argv])}"), (argv, out[:200])
        assert "needs the full install" not in out


def test_a_full_extra_command_refuses_on_the_core_install_in_one_line(tmp_path):
    import json
    import subprocess
    import sys

    argv = ["corpus", "import", "--src", str(tmp_path), "--manifest", "x.csv", "--out", "o"]
    res = subprocess.run(
        [sys.executable, "-c", _CORE_ONLY, json.dumps([argv])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(res.stdout.split("\n=====\n")[-1]) == [2]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "'wakefl corpus' needs the full install" in lines[0]
    assert "pip install 'wakefl[full]'" in lines[0]


def test_random_weights_help_says_what_the_model_does(capsys, tmp_path):
    """An untrained model scores every sound near 0.5, so at the fallback threshold it
    fires at random, on silence too: the help says so, and no longer "detects nothing"."""
    import json

    import numpy as np

    from wakefl.tools.cli import main

    text = _help(capsys, "model", "export")
    assert "detects nothing" not in text
    assert "near 0.5" in text and "fires at random, on silence too" in text
    model = tmp_path / "random.onnx"
    argv = ["model", "export", "--random-weights", "--width", "0.25", "--out", str(model)]
    assert main(argv) == 0
    assert "fires at random" in capsys.readouterr().out
    silence = tmp_path / "silence.wav"
    _write_wav(silence, np.zeros(3 * 16000, np.int16))
    assert main(["edge", "detect", "--model", str(model), str(silence), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["threshold"] == 0.5 and abs(out["max_score"] - 0.5) < 0.1, out


def _write_wav(path, samples) -> None:
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(samples.tobytes())
