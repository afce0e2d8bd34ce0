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
