"""The README's SDK snippet ("Embedding the SDK in a device app") runs as pasted: taken from
README.md, run as a program in a folder holding `corpus/` and `recording.wav`, with the
broker's URL in WAKEFL_BROKER, against a real mosquitto and an aggregation server for one
round. And the full example, without data, says in one line which quick command makes it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

REPO = Path(__file__).resolve().parents[1]
DEVICE_ID, DEVICE_TYPE = "kitchen-speaker-1", "A"


def readme_snippet() -> str:
    """The first Python block of the README's section on embedding the SDK."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Embedding the SDK in a device app", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert blocks, "no Python block in the README's SDK section"
    return blocks[0]


def _serve_one_round(broker_url: str, state: Path):
    """An aggregation server for one round of the snippet's device, from the shipped
    small model (what a fleet runs elsewhere)."""
    from wakefl.models.kws_cnn import get_flat_params
    from wakefl.models.kws_cnn.pretrained import load_pretrained
    from wakefl.sdk.selffl.registry import make_strategy
    from wakefl.server.aggregation_server import AggregationServer, ServerConfig

    shipped = load_pretrained("small")
    args = {"lr": 0.05, "batch_size": 8, "l_max": 2, "warmup_steps": 2}
    server = AggregationServer(
        ServerConfig(
            broker_url=broker_url,
            state_dir=state,
            initial_params=get_flat_params(shipped),
            model_config=shipped.cfg.to_dict(),
            rounds=1,
            round_timeout=120,
            devices={DEVICE_ID: DEVICE_TYPE},
            strategy_args=args,
            ack_timeout_s=5,
        ),
        make_strategy("selffl", **args),
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow  # a device trains a round against a real broker
def test_the_readme_snippet_runs_as_pasted(tiny_corpus, mqtt_broker, tmp_path):
    from wakefl.models.kws_cnn.pretrained import pretrained_card
    from wakefl.sdk.manifest import read_manifest

    snippet = readme_snippet()
    assert "microphone_chunks" not in snippet
    app = tmp_path / "app"
    app.mkdir()
    (app / "corpus").symlink_to(tiny_corpus.parent, target_is_directory=True)
    # A recording: test clips of the device type played back to back, the wake word in some.
    rows = [
        r
        for r in read_manifest(tiny_corpus)
        if r.device_type == DEVICE_TYPE and r.split == "test" and r.kind == "clip"
    ][:6]
    audio = np.concatenate([sf.read(r.resolve(tiny_corpus), dtype="float32")[0] for r in rows])
    sf.write(app / "recording.wav", audio, 16000, subtype="PCM_16")
    (app / "snippet.py").write_text(snippet, encoding="utf-8")

    server = _serve_one_round(mqtt_broker.url, tmp_path / "server")
    env = {**os.environ, "WAKEFL_BROKER": mqtt_broker.url}
    res = subprocess.run(
        [sys.executable, "snippet.py"], cwd=app, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    server.join(timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not server.is_alive()  # the run ended, and with it the device's rounds
    assert (app / "served.onnx").is_file() and (app / "state").is_dir()
    threshold, source = res.stdout.splitlines()[0].split(" ", 1)
    assert float(threshold) == pytest.approx(pretrained_card("small")["threshold"], abs=1e-6)
    assert source  # it says where its threshold comes from
    for line in res.stdout.splitlines()[1:]:
        assert re.fullmatch(r"wake word at \d+\.\d\d s \(score \d\.\d\d\)", line), line


def test_the_example_without_data_names_the_quick_command(tmp_path):
    script = REPO / "tools" / "examples" / "device_app.py"
    env = {**os.environ, "WAKEFL_CACHE": str(tmp_path / "empty-cache")}
    res = subprocess.run(
        [sys.executable, str(script), "--type", "A"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) == 1 and "Traceback" not in res.stderr, lines
    assert "wakefl corpus build --profile tiny --out corpus" in lines[0]
    assert "--data corpus/manifest.csv" in lines[0]
