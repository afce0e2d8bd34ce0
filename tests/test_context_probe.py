"""The context probe: its recordings put the background where the condition says and at
its ratio, and the benchmark prints and writes its breakdown for a model on real speech."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch

from wakefl.edge_runtime import load_audio
from wakefl.models.kws_cnn import KwsCnn, ModelConfig, save_model
from wakefl.tools.acoustics.field_acoustics import active_rms
from wakefl.tools.probes import context_probe
from wakefl.tools.probes.context_conditions import (
    LEAD_S,
    Condition,
    held_out_rooms,
    probe_conditions,
    render,
)


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    folder = tmp_path_factory.mktemp("probe")
    out = []
    for i, text in enumerate(("hey nova", "turn on the lights please", "what time is it")):
        subprocess.run(["espeak-ng", "-w", str(folder / f"{i}.wav"), text], check=True)
        out.append(load_audio(folder / f"{i}.wav", 16000))
    return out


def test_conditions_cover_every_kind_placement_and_device_stage():
    conds = probe_conditions()
    assert len({c.name for c in conds}) == len(conds)
    assert {c.kind for c in conds} == {"quiet", "babble", "talker", "tv", "music", "fan"}
    assert {c.placement for c in conds if c.snr_db is not None} == {"over", "outside"}
    assert any(c.agc for c in conds) and any(c.suppress for c in conds)
    assert any(c.carrier for c in conds) and any(not c.carrier for c in conds)


def test_outside_leaves_the_talker_clean_and_over_sits_at_its_ratio(speech):
    phrase, *others = speech
    room = held_out_rooms(0, 1)[0]
    quiet = render(phrase, room, Condition("q"), np.random.default_rng(1), others)
    lead = int(LEAD_S * 16000)
    talk = slice(lead + 1600, lead + phrase.size - 1600)  # well inside the phrase
    outside = render(
        phrase, room, Condition("o", "babble", 0.0, "outside"), np.random.default_rng(1), others
    )
    np.testing.assert_allclose(outside[talk], quiet[talk], atol=1e-6)
    assert np.abs(outside[: lead - 1600] - quiet[: lead - 1600]).max() > 1e-3
    over = render(phrase, room, Condition("v", "babble", 5.0), np.random.default_rng(1), others)
    span = slice(lead, lead + phrase.size)
    added = over - quiet
    ratio = 20 * np.log10(active_rms(quiet[span]) / active_rms(added))
    assert abs(ratio - 5.0) < 1.0


def test_the_probe_prints_and_writes_its_breakdown(tmp_path, capsys):
    torch.manual_seed(0)
    weights = tmp_path / "m.safetensors"
    save_model(KwsCnn(ModelConfig.context_robust(width=0.25)).eval(), weights)
    (tmp_path / "m.card.json").write_text(json.dumps({"threshold": 0.5}))
    out = tmp_path / "probe.json"
    code = context_probe.main(["--model", f"v2={weights}", "--speakers", "1", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    for group in ("background", "ratio (dB)", "placement", "AGC", "RT60", "distance", "utterance"):
        assert f"| {group} | v2 |" in printed
    result = json.loads(out.read_text())
    # A committed result names no folder of the machine that made it.
    recorded = result["models"]["v2"]["weights"]
    assert recorded.endswith("m.safetensors") and not recorded.startswith("/")
    rates = result["models"]["v2"]["breakdown"]["condition"]
    assert set(rates) == {c.name for c in probe_conditions()}
    assert all(0.0 <= r <= 1.0 for r in rates.values())
    with pytest.raises(Exception, match="LABEL="):
        context_probe.main(["--model", str(weights)])
    with pytest.raises(Exception, match="not in"):
        context_probe.main(["--model", f"v2={weights}@1.5"])


def test_miss_breakdown_is_the_share_missed_in_each_group_at_each_threshold():
    conds = {c.name: c for c in probe_conditions()}
    picked = ("quiet", "babble 10 dB outside", "carrier, quiet", "fan 5 dB over")
    recordings = [
        context_probe.Recording("s", conds[name], rt60, 1.0, np.zeros(8, np.float32))
        for name, rt60 in zip(picked, (0.3, 0.3, 0.8, 0.8), strict=True)
    ]
    peaks = np.array([0.9, 0.4, 0.7, 0.6])
    frr = context_probe.miss_breakdown(recordings, peaks, {"low": 0.5, "high": 0.8})
    assert frr["low"]["background"] == {"quiet": 0.0, "babble": 1.0, "fan": 0.0}
    assert frr["high"]["background"] == {"quiet": 0.5, "babble": 1.0, "fan": 1.0}
    assert frr["high"]["utterance"] == pytest.approx(
        {"isolated phrase": 2 / 3, "carrier sentence": 1}
    )
    assert frr["low"]["placement"] == {"outside": 1.0, "over": 0.0}
    assert frr["low"]["RT60"] == {"RT60 < 0.45 s": 0.5, "RT60 > 0.7 s": 0.0}


def test_the_detection_benchmark_breaks_its_misses_down_on_probe_audio(tmp_path):
    from wakefl.tools.bench.detection_conditions import probe_breakdown
    from wakefl.tools.bench.detection_report import breakdown_lines

    class LoudnessScorer:  # louder windows score higher: a stand-in for a model
        sample_rate, window_samples = 16000, 24000

        def score(self, windows):
            rms = np.sqrt(np.mean(np.asarray(windows, dtype=np.float64) ** 2, axis=1))
            return 1.0 - np.exp(-30.0 * rms)

    info = {"seed": 0, "phrase": "hey nova", "profile": {"name": "pretrain-compact"}}
    (tmp_path / "corpus.json").write_text(json.dumps(info))
    conditions = {
        "held-out speakers": {"all types": {"threshold_at_0.5_fa_h": 0.0}},
        "held-out acoustics": {"all types": {"threshold_at_0.5_fa_h": 2.0}},
        "unseen voices": {"all types": {}},
    }
    b = probe_breakdown(tmp_path, 1, LoudnessScorer(), 0.2, conditions)
    assert b["recordings"] == len(probe_conditions())
    assert list(b["thresholds"]) == [
        "shipped threshold",
        "held-out speakers, <= 0.5 FA/h",
        "held-out acoustics, <= 0.5 FA/h",
    ]
    nothing_missed = b["frr"]["held-out speakers, <= 0.5 FA/h"]
    all_missed = b["frr"]["held-out acoustics, <= 0.5 FA/h"]
    shipped = b["frr"]["shipped threshold"]
    for group in ("background", "ratio (dB)", "placement", "AGC", "noise suppression"):
        assert set(nothing_missed[group].values()) == {0.0}
        assert set(all_missed[group].values()) == {1.0}
    # Louder backgrounds raise the loudness stand-in's peak: at 0 dB it misses no more
    # than at 10 dB, and the quiet recordings sit between nothing and all missed.
    assert shipped["ratio (dB)"]["0"] <= shipped["ratio (dB)"]["10"]
    assert set(shipped["background"]) == {"quiet", "babble", "talker", "tv", "music", "fan"}
    lines = breakdown_lines(b)
    assert "1 held-out speakers" in lines[0] and "shipped threshold 0.2000" in lines[0]
    assert "background | shipped threshold | held-out speakers, <= 0.5 FA/h" in "\n".join(lines)
    (tmp_path / "corpus.json").write_text(json.dumps({"seed": 0}))
    with pytest.raises(Exception, match="names no corpus profile"):
        probe_breakdown(tmp_path, 1, LoudnessScorer(), 0.2, conditions)
