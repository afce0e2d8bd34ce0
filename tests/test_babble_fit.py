"""The babble-fit probe on a real corpus and the shipped `small`: phrases it fits clean lose
score under babble 0 dB over them, the same windows for every model and run, and absurd
arguments are refused before any audio is decoded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from wakefl.errors import ConfigError
from wakefl.tools.probes import babble_fit

pytestmark = pytest.mark.slow


def test_babble_over_the_phrase_lowers_the_score_of_a_trained_model(
    pretrain_micro_corpus: Path, tmp_path: Path, capsys
) -> None:
    args = ["--corpus", str(pretrain_micro_corpus), "--clips", "8", "--ratios", "0"]
    args += ["--profile", "pretrain-micro", "--model", "small=pretrained:small"]
    args += ["--model", "strict=pretrained:small@0.999"]
    assert babble_fit.main([*args, "--json", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    assert "| train, training babble 0 dB |" in out and "| test, probe babble 0 dB |" in out
    result = json.loads((tmp_path / "a.json").read_text())
    sets = result["models"]["small"]["sets"]
    assert len(sets) == 2 + 2 * len(babble_fit.DEFAULT_KINDS)
    for split in ("train", "test"):
        clean = sets[f"{split}, clean"]["median"]
        assert sets[f"{split}, training babble 0 dB"]["median"] < clean
        assert sets[f"{split}, probe babble 0 dB"]["median"] < clean
    # One set of windows for every model: a stricter threshold detects no more of any.
    strict = result["models"]["strict"]["sets"]
    for name, row in sets.items():
        assert strict[name]["median"] == row["median"]
        assert strict[name]["detected"] <= row["detected"]
    # And for every run.
    assert babble_fit.main([*args, "--json", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text()) == result


def test_babble_of_everyday_speech_and_of_near_rhymes_are_cut_from_their_own_clips(
    pretrain_micro_corpus: Path, tmp_path: Path
) -> None:
    args = ["--corpus", str(pretrain_micro_corpus), "--clips", "6", "--ratios", "0", "5"]
    args += ["--profile", "pretrain-micro", "--model", "small=pretrained:small"]
    args += ["--kinds", "training", "everyday", "near-rhyme", "--json", str(tmp_path / "k.json")]
    assert babble_fit.main(args) == 0
    sets = json.loads((tmp_path / "k.json").read_text())["models"]["small"]["sets"]
    assert not any("probe" in name for name in sets)
    for kind in ("training", "everyday", "near-rhyme"):
        assert sets[f"train, {kind} babble 0 dB"]["median"] < sets["train, clean"]["median"]
    # Three babbles made from different clips: three sets of scores.
    medians = {
        sets[f"test, {k} babble 0 dB"]["median"] for k in ("training", "everyday", "near-rhyme")
    }
    assert len(medians) == 3


def test_agc_sets_score_each_phrase_through_an_agc_alone_and_after_quiet(
    pretrain_micro_corpus: Path, tmp_path: Path
) -> None:
    args = ["--corpus", str(pretrain_micro_corpus), "--clips", "6", "--ratios", "0"]
    args += ["--profile", "pretrain-micro", "--model", "small=pretrained:small", "--agc"]
    args += ["--kinds", "training", "--json", str(tmp_path / "g.json")]
    assert babble_fit.main(args) == 0
    sets = json.loads((tmp_path / "g.json").read_text())["models"]["small"]["sets"]
    assert len(sets) == 2 + 2 * 2 + 2
    for split in ("train", "test"):
        scores = {
            sets[f"{split}, {name}"]["median"] for name in ("clean", "AGC", "AGC after quiet")
        }
        assert len(scores) == 3  # three different sets of windows


def test_the_agc_after_quiet_starts_the_phrase_at_full_gain(pretrain_micro_corpus: Path) -> None:
    windows = babble_fit.clip_windows(pretrain_micro_corpus.parent, "test", 1, 4, 24000, [0, 7071])
    alone = babble_fit.through_agc(windows, after_quiet=False, seed=0)
    after = babble_fit.through_agc(windows, after_quiet=True, seed=0)
    assert alone.shape == after.shape == windows.shape and alone.dtype == np.float32
    assert np.max(np.abs(after)) <= 1.0 and np.max(np.abs(alone)) <= 1.0

    # After a second of room tone the gain sits at its 30 dB maximum: the first 10 ms come
    # out about 30 dB up, louder than the same window's own AGC lets them be.
    def first_level(x: np.ndarray) -> float:
        return float(np.mean(10 * np.log10(np.mean(x[:, :160] ** 2, axis=1) + 1e-12)))

    assert first_level(after) > first_level(windows) + 25.0
    assert first_level(after) > first_level(alone)
    np.testing.assert_array_equal(after, babble_fit.through_agc(windows, True, seed=0))


@pytest.mark.parametrize(
    "extra",
    [
        ["--clips", "0"],
        ["--ratios", "100"],
        ["--ratios", "nan"],
        ["--model", "x=no-such.safetensors"],
    ],
)
def test_absurd_arguments_are_refused(extra, pretrain_micro_corpus: Path) -> None:
    args = ["--corpus", str(pretrain_micro_corpus), "--model", "small=pretrained:small", *extra]
    with pytest.raises(ConfigError):
        babble_fit.main(args)


def test_an_unknown_babble_kind_is_refused(pretrain_micro_corpus: Path) -> None:
    args = ["--corpus", str(pretrain_micro_corpus), "--model", "small=pretrained:small"]
    with pytest.raises(SystemExit):
        babble_fit.main([*args, "--kinds", "whispers"])


def test_a_folder_without_a_manifest_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="manifest"):
        babble_fit.main(["--corpus", str(tmp_path), "--model", "small=pretrained:small"])
