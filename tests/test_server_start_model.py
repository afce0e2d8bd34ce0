"""Which model `wakefl server` starts the fleet from (issue #50, item 3): by default the
shipped model of the width asked for, a random one only when asked for, and its first
line says which."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from wakefl.errors import ConfigError
from wakefl.models.kws_cnn import get_flat_params
from wakefl.models.kws_cnn.pretrained import load_pretrained
from wakefl.server.state_store import StateStore
from wakefl.tools.cli.server import starting_model


@pytest.mark.parametrize(
    ("init_model", "random_weights", "width", "start"),
    [
        (None, False, 1.0, "pretrained:full"),
        (None, False, 0.25, "pretrained:small"),
        ("pretrained:small", False, 1.0, "pretrained:small"),
        ("ckpt.safetensors", False, 0.5, "ckpt.safetensors"),
        (None, True, 0.05, None),
        (None, True, 1.0, None),
    ],
)
def test_the_starting_model_each_choice_gives(init_model, random_weights, width, start):
    assert starting_model(init_model, random_weights, width) == start


@pytest.mark.parametrize(
    ("init_model", "random_weights", "width", "says"),
    [
        (None, False, 0.5, "no shipped model of width 0.5"),
        ("pretrained:full", True, 1.0, "not both"),
    ],
)
def test_a_start_that_cannot_be_chosen_is_one_line(init_model, random_weights, width, says):
    with pytest.raises(ConfigError, match=says):
        starting_model(init_model, random_weights, width)


@pytest.mark.parametrize(("width", "name"), [("1.0", "full"), ("0.25", "small")])
def test_the_server_starts_from_the_shipped_model_and_says_so(mqtt_broker, tmp_path, width, name):
    state = tmp_path / "state"
    proc = subprocess.run(
        [sys.executable, "-m", "wakefl.tools.cli", "server", "--broker", mqtt_broker.url]
        + ["--state", str(state), "--width", width, "--devices", "d1:A"]
        + ["--start-timeout", "1", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines and lines[0].endswith(
        f"the fleet starts from the shipped model pretrained:{name}"
    ), proc.stdout + proc.stderr
    store = StateStore(state)
    try:
        saved = store.load_server_state()
    finally:
        store.close()
    assert saved is not None
    torch.testing.assert_close(
        saved.global_params, get_flat_params(load_pretrained(name)), rtol=0, atol=0
    )
