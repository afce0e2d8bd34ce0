"""`--broker` from the command line, a file or the environment: the password need not
appear on the command line."""

from __future__ import annotations

import json

import pytest

from wakefl.errors import ConfigError
from wakefl.tools.cli.broker_option import BROKER_ENV, resolve_broker

URL = "mqtts://dev-a:s3cret@broker.example:8883?ca=ca.crt"


def test_broker_from_argument_file_or_environment(tmp_path):
    provisioned = tmp_path / "dev-a.json"
    provisioned.write_text(json.dumps({"broker": URL, "device_id": "dev-a"}))
    plain = tmp_path / "url.txt"
    plain.write_text(URL + "\n")
    assert resolve_broker(URL, env={}) == URL
    assert resolve_broker("embedded", env={}) == "embedded"
    assert resolve_broker(f"@{provisioned}", env={}) == URL
    assert resolve_broker(f"@{plain}", env={}) == URL
    assert resolve_broker(None, env={BROKER_ENV: URL}) == URL
    assert resolve_broker(None, env={BROKER_ENV: f"@{provisioned}"}) == URL
    assert resolve_broker("mqtt://other:1883", env={BROKER_ENV: URL}) == "mqtt://other:1883"


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "cannot read"),
        ('{"device_id": "x"}', "no 'broker'"),
        ("{not json", "JSON object"),
        ("mqtt://a\nmqtt://b", "one broker URL"),
    ],
)
def test_bad_broker_files_are_one_line_errors(tmp_path, content, needle):
    path = tmp_path / "broker.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=needle):
        resolve_broker(f"@{path}", env={})
    with pytest.raises(ConfigError, match=BROKER_ENV):
        resolve_broker(None, env={})
