"""Training for speech around the phrase: the version-2 model from a version-1 start, the
context-speech stage in the batches, and the window cache that renders augmented windows
once for every run that shares them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from micro_training import SETTINGS as MICRO_SETTINGS
from safetensors.torch import load_file

from wakefl.errors import ConfigError
from wakefl.models.kws_cnn import KwsCnn, ModelConfig, load_model, save_model
from wakefl.tools.training.data import (
    STREAM_NEAR_RHYME,
    holds_near_rhyme,
    load_pretrain_data,
    make_batch,
)
from wakefl.tools.training.pretrain import pretrain
from wakefl.tools.training.settings import BEST, LAST, STATE_WEIGHTS, model_config
from wakefl.tools.training.window_cache import WindowCache, render_settings

pytestmark = pytest.mark.slow

# The micro settings, four batches long, validated every second step.
SETTINGS = dataclasses.replace(
    MICRO_SETTINGS, samples=16 * 4, eval_every_steps=2, warmup_steps=1, workers=0
)


@pytest.fixture(scope="module")
def corpus(pretrain_micro_corpus: Path) -> Path:
    return pretrain_micro_corpus


def test_arch_names_and_overrides():
    assert model_config("v1", 0.25) == ModelConfig(width=0.25)
    v2 = model_config("v2,gain_norm=none,first_time_pool=3", 0.5)
    assert (v2.version, v2.norm, v2.gain_norm, v2.first_time_pool) == (2, "frame", "none", 3)
    for bad in ("v3", "v1,norm=frame", "v2,colour=red", "v2,norm="):
        with pytest.raises(ConfigError):
            model_config(bad, 0.25)


def test_context_speech_changes_some_windows_deterministically(corpus: Path) -> None:
    data = load_pretrain_data(corpus, 24000, 6.0, progress=False)
    from wakefl.tools.augmentation.speech_backgrounds import SpeechBackgrounds

    data.speech = SpeechBackgrounds.make(data.neg, 0, n_each=4, seconds=3.0)
    assert data.neg_by_speaker and len(data.pos_speakers) == len(data.pos)
    plain = make_batch(data, 5, SETTINGS)[0]
    on = dataclasses.replace(SETTINGS, context_speech=0.5)
    a, b = make_batch(data, 5, on)[0], make_batch(data, 5, on)[0]
    np.testing.assert_array_equal(a, b)
    changed = [not np.allclose(x, y) for x, y in zip(plain, a, strict=True)]
    assert 0 < sum(changed) < len(changed)


def test_low_snr_noise_changes_only_the_windows_given_noise_and_names_its_cache(
    corpus: Path,
) -> None:
    data = load_pretrain_data(corpus, 24000, 6.0, progress=False)
    plain = make_batch(data, 5, SETTINGS)[0]
    low = dataclasses.replace(SETTINGS, noise_snr_floor=-5.0)
    a, b = make_batch(data, 5, low)[0], make_batch(data, 5, low)[0]
    np.testing.assert_array_equal(a, b)
    changed = [not np.array_equal(x, y) for x, y in zip(plain, a, strict=True)]
    # Only the background's level moves (the same draws otherwise): about half the windows.
    assert 0 < sum(changed) < len(changed)
    frontend: dict[str, str] = {}
    assert "noise_snr_floor" not in render_settings(SETTINGS, corpus, [], frontend)
    assert render_settings(low, corpus, [], frontend)["noise_snr_floor"] == -5.0


def test_everyday_speech_source_keeps_near_rhymes_out_of_other_speech(corpus: Path) -> None:
    from wakefl.tools.corpus.plan import clip_content
    from wakefl.tools.training.data import narrow_to_speech_source

    data = load_pretrain_data(corpus, 24000, 6.0, progress=False)
    # The contents come from the corpus's own file names: its negatives hold both kinds.
    assert {"conf", "other"} <= set(data.neg_content) and len(data.neg_content) == len(data.neg)
    from wakefl.sdk.manifest import read_manifest

    rows = [r for r in read_manifest(corpus) if r.kind == "clip"]
    rows = [r for r in rows if r.split == "train" and r.label == 0]
    assert list(data.neg_content) == [clip_content(r.path) for r in rows]
    assert narrow_to_speech_source(data, "negatives") is data.neg
    before = {k: v.copy() for k, v in data.neg_by_speaker.items()}
    kept = narrow_to_speech_source(data, "everyday")
    everyday = data.neg_content == "other"
    np.testing.assert_array_equal(kept, data.neg[everyday])
    # A speaker goes on with their own everyday sentences only.
    for name, idx in data.neg_by_speaker.items():
        assert idx.size and (data.neg_content[idx] == "other").all()
        assert set(idx) == {i for i in before[name] if everyday[i]}
    data.neg_content = np.full(len(data.neg), "conf", dtype=object)
    with pytest.raises(ConfigError, match="everyday"):
        narrow_to_speech_source(data, "everyday")


def test_the_speech_source_names_a_cache_only_when_it_is_everyday(corpus: Path) -> None:
    frontend: dict[str, str] = {}
    everyday = dataclasses.replace(SETTINGS, speech_source="everyday")
    assert "speech_source" not in render_settings(SETTINGS, corpus, [], frontend)
    assert render_settings(everyday, corpus, [], frontend)["speech_source"] == "everyday"


def _changed_windows(
    data, on, off, steps: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[str], list[str]]:
    """The contents of the windows that differ between settings `on` and `off` over the
    first `steps` batches, and the contents of every window drawn (checked to be the same
    clips under both)."""
    from wakefl.tools.training import data as data_module

    contents: list[str] = []
    source = data_module._source

    def noting(*args, **kwargs):  # the real draw, its window's content noted
        out = source(*args, **kwargs)
        contents.append(out[2])
        return out

    monkeypatch.setattr(data_module, "_source", noting)
    changed: list[str] = []
    drawn: list[str] = []
    for step in range(steps):
        contents.clear()
        a, b = make_batch(data, step, on)[0], make_batch(data, step, off)[0]
        assert contents[: len(a)] == contents[len(a) :]  # the same clips drawn
        drawn += contents[: len(a)]
        changed += [k for x, y, k in zip(a, b, contents, strict=False) if not np.array_equal(x, y)]
    return changed, drawn


def test_speech_stays_off_the_near_rhymes_only_and_names_its_cache(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`speech_over_near_rhymes=False` changes only near-rhyme negatives' windows (the
    phrases and everyday negatives of the batch stay as they were) and names its cache."""
    from wakefl.tools.augmentation.speech_backgrounds import SpeechBackgrounds
    from wakefl.tools.corpus.plan import NEAR_RHYME_CONTENTS

    data = load_pretrain_data(corpus, 24000, 6.0, progress=False)
    data.speech = SpeechBackgrounds.make(data.neg, 0, n_each=4, seconds=3.0)
    on = dataclasses.replace(SETTINGS, context_speech=1.0)
    off = dataclasses.replace(on, speech_over_near_rhymes=False)
    changed, _ = _changed_windows(data, on, off, 6, monkeypatch)
    assert changed and set(changed) <= set(NEAR_RHYME_CONTENTS)
    frontend: dict[str, str] = {}
    assert "speech_over_near_rhymes" not in render_settings(on, corpus, [], frontend)
    assert render_settings(off, corpus, [], frontend)["speech_over_near_rhymes"] is False


@pytest.mark.parametrize(
    ("start", "held"),
    [
        (0, False),  # the window ends where the near-rhyme starts
        (500, False),  # 500 of its 2,000 samples inside
        (1000, True),  # exactly half: its first
        (2500, True),  # all of it
        (4000, True),  # its second half
        (4001, False),  # less than half
        (6000, False),  # after it
    ],
)
def test_a_stream_crop_holds_a_near_rhyme_when_half_of_it_is_inside(start: int, held: bool):
    spans = np.array([[3000, 5000]])
    assert holds_near_rhyme(spans, start, 3000) is held
    assert holds_near_rhyme(np.zeros((0, 2), np.int64), start, 3000) is False


def test_speech_stays_off_stream_near_rhymes_by_their_transcripts(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`speech_over_stream_near_rhymes=False` changes only the stream crops whose stream's
    transcript puts a near-rhyme inside them, and names its cache."""
    from wakefl.tools.augmentation.speech_backgrounds import SpeechBackgrounds

    data = load_pretrain_data(corpus, 24000, 6.0, progress=False)
    assert sum(s.shape[0] for s in data.train_stream_near_rhymes) > 0  # from the transcripts
    assert len(data.train_stream_near_rhymes) == len(data.train_streams)
    data.speech = SpeechBackgrounds.make(data.neg, 0, n_each=4, seconds=3.0)
    # Every negative a stream crop: the micro streams hold three near-rhymes in a minute.
    on = dataclasses.replace(
        SETTINGS, context_speech=1.0, speech_over_near_rhymes=False, stream_crop_share=1.0
    )
    off = dataclasses.replace(on, speech_over_stream_near_rhymes=False)
    changed, drawn = _changed_windows(data, on, off, 12, monkeypatch)
    held = drawn.count(STREAM_NEAR_RHYME)
    assert changed and set(changed) == {STREAM_NEAR_RHYME} and len(changed) <= held
    frontend: dict[str, str] = {}
    assert "speech_over_stream_near_rhymes" not in render_settings(on, corpus, [], frontend)
    assert render_settings(off, corpus, [], frontend)["speech_over_stream_near_rhymes"] is False


def test_a_version_2_run_starts_from_version_1_weights_over_a_window_cache(
    corpus: Path, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    v1 = KwsCnn(ModelConfig(width=0.25))
    save_model(v1, tmp_path / "v1.safetensors")
    cache = tmp_path / "cache"
    s = dataclasses.replace(
        SETTINGS, arch="v2", context_speech=0.5, window_cache=str(cache), cache_windows=16 * 64
    )
    pretrain(corpus, tmp_path / "run", s, init_from=tmp_path / "v1.safetensors", progress=False)
    model = load_model(tmp_path / "run" / BEST)
    assert model.cfg.version == 2 and model.cfg.gain_norm == "pcen"
    last = load_model(tmp_path / "run" / LAST)  # the latest weights, as a model file
    state = load_file(str(tmp_path / "run" / STATE_WEIGHTS))
    for k, v in last.named_parameters():
        torch.testing.assert_close(v, state[f"model.{k}"])
    cached = WindowCache.load(cache)
    assert cached.log_mel.shape == (16 * 64, 40, 151) and set(cached.labels) == {0, 1}
    # A second run with another model reuses the windows: nothing is rendered again.
    stamps = {p: p.stat().st_mtime_ns for p in cache.glob("windows-*.npz")}
    other = dataclasses.replace(s, arch="v2,gain_norm=none")
    pretrain(corpus, tmp_path / "run2", other, progress=False)
    assert {p: p.stat().st_mtime_ns for p in cache.glob("windows-*.npz")} == stamps
    # Windows of other augmentation are refused rather than silently mixed.
    with pytest.raises(ConfigError, match="other settings"):
        pretrain(
            corpus, tmp_path / "run3", dataclasses.replace(s, context_speech=0.2), progress=False
        )


def test_a_cached_run_resumes_to_the_same_weights(corpus: Path, tmp_path: Path) -> None:
    s = dataclasses.replace(
        SETTINGS, arch="v2", window_cache=str(tmp_path / "cache"), cache_windows=16 * 64
    )
    pretrain(corpus, tmp_path / "whole", s, progress=False)
    pretrain(corpus, tmp_path / "parts", s, progress=False, max_steps=2)
    pretrain(corpus, tmp_path / "parts", s, progress=False, resume=True)
    a = load_file(str(tmp_path / "whole" / STATE_WEIGHTS))
    b = load_file(str(tmp_path / "parts" / STATE_WEIGHTS))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
