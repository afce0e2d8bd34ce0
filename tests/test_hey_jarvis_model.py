"""The committed "hey jarvis" model (models/kws_cnn/pretrained/hey-jarvis-small.*), which
tools/bench/peers.py scores beside openWakeWord's and microWakeWord's: anyone can export it
and it hears its own phrase, through onnxruntime, on real speech."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import espeak_wav

PRETRAINED = Path(__file__).resolve().parents[1] / "models" / "kws_cnn" / "pretrained"
WEIGHTS = PRETRAINED / "hey-jarvis-small.safetensors"


def test_its_card_names_the_phrase_its_threshold_and_how_it_was_trained() -> None:
    card = json.loads(WEIGHTS.with_suffix(".card.json").read_text(encoding="utf-8"))
    config = json.loads(WEIGHTS.with_suffix(".json").read_text(encoding="utf-8"))
    assert card["phrase"] == "hey jarvis" and card["width"] == 0.25
    assert 0.0 < card["threshold"] < 1.0
    assert config["config"]["width"] == 0.25
    legs = card["training"]["legs"]
    assert legs and all('--phrase "hey jarvis"' in leg["command"] for leg in legs)
    assert set(card["training"]["corpora"]) >= {"JARVIS", "JARVIS-CARRIER"}
    assert WEIGHTS.stat().st_size < 8 * 1024 * 1024


def test_exported_it_hears_hey_jarvis_in_running_speech_and_not_hey_nova(tmp_path, capsys) -> None:
    from wakefl.tools.cli import main

    model = tmp_path / "hey-jarvis.onnx"
    assert main(["model", "export", "--weights", str(WEIGHTS), "--out", str(model), "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    card = json.loads(WEIGHTS.with_suffix(".card.json").read_text(encoding="utf-8"))
    assert exported["shipped_threshold"] == pytest.approx(card["threshold"])

    def detect(text: str, name: str) -> dict:
        wav = espeak_wav(tmp_path / name, text)
        assert main(["edge", "detect", "--model", str(model), str(wav), "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    # The phrase in one breath with a command, and after other speech (espeak-ng's default
    # voice; its scores are deterministic, 0.999 and 0.996 against the threshold 0.994).
    for k, text in enumerate(
        ["hey jarvis, turn on the kitchen lights", "good morning. hey jarvis. what is the weather"]
    ):
        assert len(detect(text, f"jarvis{k}.wav")["events"]) == 1, text
    nova = detect("hey nova, turn on the kitchen lights", "nova.wav")
    assert not nova["events"] and nova["max_score"] < nova["threshold"], nova
