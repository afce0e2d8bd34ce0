"""`wakefl provision` (issue #50, item 5): its --help is whole, and the commands it suggests
read the broker password from a file (`--broker @FILE`), never from the command line where
`ps` shows it."""

from __future__ import annotations

import json

import pytest

from wakefl.tools.cli import main


def test_provision_help_is_a_whole_description(capsys):
    with pytest.raises(SystemExit) as info:
        main(["provision", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "for one device (or one aggregation worker), in a provisioning folder" in text
    assert "(its layout: server/provisioning.py)." in text


def test_provision_suggests_broker_files_not_passwords_on_the_command_line(tmp_path, capsys):
    state = tmp_path / "prov"
    assert main(["provision", "--state", str(state), "--id", "dev1", "--type", "A"]) == 0
    out = capsys.readouterr().out
    assert main(["provision", "--state", str(state), "--worker", "w1"]) == 0
    out += capsys.readouterr().out
    assert f"wakefl server --broker @{state.resolve() / 'server.json'} " in out, out
    assert f"wakefl device --broker @{state.resolve() / 'devices' / 'dev1.json'} " in out, out
    assert f"--broker @{state.resolve() / 'workers' / 'w1.json'} " in out, out
    assert "jq" not in out and "$(" not in out, out
    for name in ("server.json", "devices/dev1.json", "workers/w1.json"):
        password = json.loads((state / name).read_text())["password"]
        assert password not in out, name
