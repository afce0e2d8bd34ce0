"""The shipped pretrained models detect "hey nova" spoken by voices that no training clip
uses (the espeak-ng families kept out of the pretraining corpus), at their shipped
threshold, and stay quiet on other speech; every entry point starts from them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wakefl.models.kws_cnn.pretrained import (
    NAMES,
    is_available,
    load_pretrained,
    pretrained_card,
    pretrained_path,
)
from wakefl.tools.corpus.speech_synthesis import Voice, synthesize
from wakefl.tools.corpus.voices import UNSEEN_ESPEAK_VOICES

WINDOW = 24000
POSITIVE_TEXTS = ("hey nova", "hey nova!", "hey, nova")
NEGATIVE_TEXTS = (
    "turn on the lights", "what time is it", "play some music", "good morning everyone",
    "the weather tomorrow will be sunny", "call my mother", "open the window please",
    "it was a long day at work", "see you later", "i would like a cup of tea",
    "the cat is sleeping on the sofa", "where are my keys",
)  # fmt: skip
# Voice families that the pretraining corpus keeps out of training (UNSEEN_ESPEAK_VOICES).
VOICES = tuple(
    Voice("espeak-ng", family, variant, rate, pitch)
    for family in UNSEEN_ESPEAK_VOICES
    for variant, rate, pitch in (
        ("m3", 150, 50),
        ("f2", 170, 60),
        ("klatt", 140, 40),
        ("Annie", 160, 55),
    )
)
SHIPPED = NAMES


def _window(speech: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The utterance at a random place in a 1.5 s window over quiet room noise."""
    speech = speech[: WINDOW - 800]
    out = rng.standard_normal(WINDOW).astype(np.float32) * 1e-3
    start = int(rng.integers(400, WINDOW - speech.size - 399))
    out[start : start + speech.size] += speech * np.float32(
        0.1 / (np.sqrt(np.mean(speech**2)) + 1e-9)
    )
    return out


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> tuple[np.ndarray, np.ndarray]:
    cache = tmp_path_factory.mktemp("tts")
    rng = np.random.default_rng(0)
    pos = [_window(synthesize(v, t, cache), rng) for v in VOICES for t in POSITIVE_TEXTS]
    neg = [_window(synthesize(v, t, cache), rng) for v in VOICES for t in NEGATIVE_TEXTS[::2]]
    return np.stack(pos), np.stack(neg)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_model_detects_the_phrase_from_an_unseen_voice(name: str, clips) -> None:
    assert is_available(name), f"the shipped model {name} is missing"
    assert pretrained_path(name).stat().st_size <= 8 * 2**20
    model = load_pretrained(name)
    card = pretrained_card(name)
    assert card["phrase"] == "hey nova"
    pos, neg = clips
    with torch.no_grad():
        p = model.predict_proba(torch.from_numpy(pos)).numpy()
        n = model.predict_proba(torch.from_numpy(neg)).numpy()
    thr = card["threshold"]
    assert np.mean(p >= thr) >= 0.9, f"{name}: accepted {np.mean(p >= thr):.2f} of positives"
    assert np.mean(n >= thr) <= 0.1, f"{name}: accepted {np.mean(n >= thr):.2f} of negatives"


def test_every_entry_point_starts_from_the_shipped_model(tmp_path) -> None:
    from wakefl.errors import ConfigError
    from wakefl.models.kws_cnn import load_model
    from wakefl.tools.evaluation.inputs import card_threshold
    from wakefl.tools.training.warm_start import resolve_baseline

    small = resolve_baseline(None, None, width=0.25, cache_dir=tmp_path, progress=False)
    model = load_model(small)
    shipped = load_pretrained("small")
    for p, q in zip(model.parameters(), shipped.parameters(), strict=True):
        assert torch.equal(p, q)
    # `wakefl eval --at-shipped-threshold` finds the operating point beside the checkpoint.
    assert card_threshold(small) == pytest.approx(pretrained_card("small")["threshold"])
    if "full" in SHIPPED:
        full = resolve_baseline(
            "pretrained:full", None, width=0.25, cache_dir=tmp_path, progress=False
        )
        assert load_model(full).cfg.width == 1.0
    with pytest.raises(ConfigError, match="manifest"):
        resolve_baseline(None, None, width=0.5, cache_dir=tmp_path, progress=False)
    with pytest.raises(ConfigError, match="shipped model"):
        resolve_baseline("pretrained:medium", None, width=0.25, cache_dir=tmp_path, progress=False)


def test_an_exported_shipped_model_carries_its_threshold(tmp_path, capsys) -> None:
    """fp32 and int8: the ONNX metadata and the sidecar hold the card's threshold, and the
    edge runtime's detector runs at it by default."""
    import json

    from wakefl.edge_runtime import OnnxScorer, StreamingDetector
    from wakefl.tools.cli import main

    threshold = pretrained_card("small")["threshold"]
    for extra in ([], ["--int8"]):
        out = tmp_path / f"small{len(extra)}.onnx"
        assert main(["model", "export", "--pretrained", "small", "--out", str(out), *extra]) == 0
        captured = capsys.readouterr()
        assert ("calibrating on 20 windows of the shipped calibration set" in captured.err) == bool(
            extra
        )
        assert f"shipped threshold {threshold:.4f}" in captured.out
        assert json.loads(out.with_suffix(".json").read_text())["shipped_threshold"] == threshold
        scorer = OnnxScorer(out)
        assert scorer.shipped_threshold == threshold
        assert StreamingDetector(scorer).threshold == threshold
