"""Pretraining pipeline on a micro corpus: the corpus recipe (engines, unseen voices, streams
per split), augmentation, a few training steps, checkpoints, resume and publishing."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from micro_training import SETTINGS

from wakefl.edge_runtime.detection_rule import count_events, smoothed
from wakefl.errors import ConfigError
from wakefl.models.kws_cnn import load_model, weights_digest
from wakefl.sdk.manifest import read_manifest
from wakefl.tools.augmentation.wave_augment import AugmentBank, augment_window, fit_window
from wakefl.tools.corpus.build import build_corpus
from wakefl.tools.training.data import load_pretrain_data, make_batch
from wakefl.tools.training.distillation import distill_loss
from wakefl.tools.training.pretrain import pretrain
from wakefl.tools.training.publish import publish
from wakefl.tools.training.settings import (
    BEST,
    BEST_CARD,
    STATE_INFO,
    PretrainSettings,
    lr_at,
)
from wakefl.tools.training.validation import score_batches, threshold_for_fa


@pytest.fixture(scope="module")
def corpus(pretrain_micro_corpus: Path) -> Path:
    return pretrain_micro_corpus


@pytest.fixture(scope="module")
def voices_corpus(tmp_path_factory) -> Path:
    return build_corpus(
        tmp_path_factory.mktemp("pretrain-voices-micro"),
        seed=1,
        profile="pretrain-voices-micro",
        progress=False,
        tts_cache_dir=tmp_path_factory.getbasetemp() / "tts",
    )


def _speakers(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_corpus_has_streams_per_split_and_an_unseen_voices_corpus(corpus: Path) -> None:
    rows = read_manifest(corpus)
    streams = {r.split for r in rows if r.kind == "stream"}
    assert streams == {"train", "val", "test"}
    engines = {s["engine"] for s in _speakers(corpus.parent / "speakers.csv")}
    assert {"espeak-ng", "flite", "festival"} <= engines
    unseen = read_manifest(corpus.parent / "unseen" / "manifest.csv")
    assert unseen and all(r.split == "test" for r in unseen)
    assert any(r.label == 1 for r in unseen) and any(r.kind == "stream" for r in unseen)
    seen_voices = {(s["engine"], s["voice"]) for s in _speakers(corpus.parent / "speakers.csv")}
    unseen_voices = {
        (s["engine"], s["voice"]) for s in _speakers(corpus.parent / "unseen" / "speakers.csv")
    }
    # Whole voice families and the Pico engine stay out of the main corpus.
    assert not seen_voices & unseen_voices
    assert any(e == "pico" for e, _ in unseen_voices)
    assert {r.speaker for r in unseen if r.kind == "clip" and r.label == 1} <= {
        s["speaker"] for s in _speakers(corpus.parent / "unseen" / "speakers.csv")
    }


def test_extra_voices_corpus_speaks_with_voices_the_unseen_split_lacks(
    corpus: Path, voices_corpus: Path
) -> None:
    extra = {(s["engine"], s["voice"]) for s in _speakers(voices_corpus.parent / "speakers.csv")}
    unseen = {
        (s["engine"], s["voice"]) for s in _speakers(corpus.parent / "unseen" / "speakers.csv")
    }
    assert extra and {e for e, _ in extra} == {"pico"}
    assert not extra & unseen
    rows = read_manifest(voices_corpus)
    train = [r for r in rows if r.split == "train" and r.kind == "clip"]
    assert {r.label for r in train} == {0, 1}
    assert any(r.kind == "stream" and r.split == "train" for r in rows)
    # Real rendered speech: a wake-phrase clip is far louder than a background-only one.
    from wakefl.edge_runtime import load_audio

    pos = next(r for r in train if r.label == 1)
    bg = next(r for r in train if r.speaker.startswith("nospeech"))
    assert (
        np.abs(load_audio(pos.resolve(voices_corpus), 16000)).max()
        > 2 * np.abs(load_audio(bg.resolve(voices_corpus), 16000)).std()
    )


def test_extra_corpus_adds_training_audio_only(corpus: Path, voices_corpus: Path) -> None:
    base = load_pretrain_data(corpus, 24000, 6.0, progress=False)
    both = load_pretrain_data(corpus, 24000, 6.0, progress=False, extra=[voices_corpus])
    train = [r for r in read_manifest(voices_corpus) if r.split == "train"]
    n_pos = sum(r.kind == "clip" and r.label == 1 for r in train)
    n_neg = sum(r.kind == "clip" and r.label == 0 for r in train)
    assert n_pos and n_neg
    assert len(both.pos) == len(base.pos) + n_pos and len(both.neg) == len(base.neg) + n_neg
    n_streams = sum(r.kind == "stream" for r in train)
    assert len(both.train_streams) == len(base.train_streams) + n_streams
    # The main corpus's audio comes first (mined-pool indices stay valid), and validation
    # is the main corpus's alone.
    np.testing.assert_array_equal(both.pos[: len(base.pos)], base.pos)
    np.testing.assert_array_equal(both.neg[: len(base.neg)], base.neg)
    np.testing.assert_array_equal(both.val_clips, base.val_clips)
    assert len(both.val_streams) == len(base.val_streams)


def test_resume_needs_the_same_extra_corpora(
    corpus: Path, voices_corpus: Path, tmp_path: Path
) -> None:
    import shutil

    run = tmp_path / "run"
    pretrain(corpus, run, SETTINGS, progress=False, max_steps=2, extra=[voices_corpus])
    assert json.loads((run / STATE_INFO).read_text())["extra_manifests"] == [str(voices_corpus)]
    with pytest.raises(ConfigError, match="extra-corpus"):
        pretrain(corpus, run, SETTINGS, resume=True, progress=False)
    info = pretrain(corpus, run, SETTINGS, resume=True, progress=False, extra=[voices_corpus])
    assert info["step"] == SETTINGS.total_steps
    # An add-on corpus built for another wake phrase is refused.
    other = tmp_path / "other"
    shutil.copytree(voices_corpus.parent, other)
    meta = json.loads((other / "corpus.json").read_text())
    (other / "corpus.json").write_text(json.dumps({**meta, "phrase": "hey robot"}))
    with pytest.raises(ConfigError, match="hey robot"):
        load_pretrain_data(corpus, 24000, 6.0, progress=False, extra=[other / "manifest.csv"])


def test_a_timing_add_on_adds_wake_phrase_clips_only(corpus: Path, tmp_path: Path) -> None:
    timing = build_corpus(tmp_path / "timing", 0, "pretrain-timing-micro", progress=False)
    base = load_pretrain_data(corpus, 24000, 6.0, progress=False)
    both = load_pretrain_data(corpus, 24000, 6.0, progress=False, extra=[timing])
    n_pos = sum(r.split == "train" for r in read_manifest(timing))
    assert n_pos and len(both.pos) == len(base.pos) + n_pos
    assert len(both.neg) == len(base.neg)
    assert len(both.train_streams) == len(base.train_streams)
    # Built with the corpus's seed, its speakers are the corpus's: its training clips are
    # spoken by the corpus's training speakers only.
    held_out = {r.speaker for r in read_manifest(corpus) if r.split != "train"}
    assert not held_out & {r.speaker for r in read_manifest(timing) if r.split == "train"}


def test_augmentation_keeps_length_and_is_deterministic() -> None:
    bank = AugmentBank.make(0, n_each=2, seconds=2.0)
    x = (np.random.default_rng(1).standard_normal(24000) * 0.05).astype(np.float32)
    a = augment_window(x, 1, np.random.default_rng(5), bank)
    b = augment_window(x, 1, np.random.default_rng(5), bank)
    assert a.shape == x.shape and a.dtype == np.float32 and np.array_equal(a, b)
    assert np.all(np.abs(a) <= 1.0)
    # Padding a short clip repeats its own edges instead of inserting digital silence.
    short = np.full(1000, 0.1, np.float32)
    assert np.all(fit_window(short, 2000, np.random.default_rng(0)) != 0)


def test_batches_depend_only_on_seed_and_step(corpus: Path) -> None:
    data = load_pretrain_data(corpus, 24000, 6.0, progress=False)
    x1, y1 = make_batch(data, 7, SETTINGS)
    x2, y2 = make_batch(data, 7, SETTINGS)
    x3, _ = make_batch(data, 8, SETTINGS)
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert not np.array_equal(x1, x3)
    assert y1.sum() == round(SETTINGS.batch_size * SETTINGS.positive_share)  # class balance


def test_field_augmentation_changes_some_windows_and_keeps_the_rest(corpus: Path) -> None:
    data = load_pretrain_data(corpus, 24000, 6.0, progress=False, field_rooms=2)
    assert len(data.field_rirs) == 2
    plain, _ = make_batch(data, 7, SETTINGS)
    field = dataclasses.replace(SETTINGS, field_augment=0.5)
    x1, y1 = make_batch(data, 7, field)
    x2, _ = make_batch(data, 7, field)
    assert np.array_equal(x1, x2) and x1.shape == plain.shape and np.all(np.abs(x1) <= 1.0)
    # Some windows have gone through the field stages.
    assert not np.array_equal(x1, plain)
    # Off (the default), the batches are the ones a run without the option always drew.
    assert np.array_equal(
        make_batch(data, 7, dataclasses.replace(field, field_augment=0.0))[0], plain
    )


def test_speech_backgrounds_change_some_windows_and_keep_the_rest(corpus: Path) -> None:
    from wakefl.tools.augmentation.speech_backgrounds import SpeechBackgrounds

    data = load_pretrain_data(corpus, 24000, 6.0, progress=False)
    plain, labels = make_batch(data, 7, SETTINGS)
    data.speech = SpeechBackgrounds.make(data.neg, 0, n_each=2, seconds=2.0)
    # Off (the default), the batches are the ones a run without the option always drew.
    assert np.array_equal(make_batch(data, 7, SETTINGS)[0], plain)
    talk = dataclasses.replace(SETTINGS, speech_backgrounds=1.0)
    x1, y1 = make_batch(data, 7, talk)
    assert np.array_equal(x1, make_batch(data, 7, talk)[0]) and np.array_equal(y1, labels)
    assert np.all(np.abs(x1) <= 1.0)
    # Every window has someone talking under it now: none is the plain one.
    assert not any(np.array_equal(a, b) for a, b in zip(x1, plain, strict=True))


def test_validation_can_come_from_another_corpus(corpus: Path, tmp_path: Path) -> None:
    other = build_corpus(tmp_path / "other", 3, "pretrain-micro", progress=False)
    data = load_pretrain_data(corpus, 24000, 6.0, progress=False, val_manifest=other)
    val = [r for r in read_manifest(other) if r.split == "val"]
    assert len(data.val_labels) == sum(r.kind == "clip" for r in val)
    assert list(data.val_labels) == [r.label for r in val if r.kind == "clip"]
    assert len(data.val_streams) == sum(r.kind == "stream" for r in val)
    # Training audio is still the training corpus's.
    own = load_pretrain_data(corpus, 24000, 6.0, progress=False)
    assert np.array_equal(data.pos, own.pos) and np.array_equal(data.neg, own.neg)
    # A validation corpus without both labels cannot choose a checkpoint.
    timing = build_corpus(tmp_path / "timing", 0, "pretrain-timing-micro", progress=False)
    with pytest.raises(ConfigError, match="both labels"):
        load_pretrain_data(corpus, 24000, 6.0, progress=False, val_manifest=timing)


def test_balanced_draws_take_a_rare_group_as_often_as_a_common_one(
    corpus: Path, tmp_path: Path
) -> None:
    timing = build_corpus(tmp_path / "timing", 0, "pretrain-timing-micro", progress=False)
    data = load_pretrain_data(corpus, 24000, 6.0, progress=False, extra=[timing])
    # Every training clip, the add-on's included, is in the group of its device type and in
    # that of its speaker's engine.
    rows = [(r, m) for m in (corpus, timing) for r in read_manifest(m) if r.split == "train"]
    engine = {
        m: {s["speaker"]: s["engine"] for s in _speakers(m.parent / "speakers.csv")}
        for m in (corpus, timing)
    }
    keys = {
        "device_type": lambda rm: rm[0].device_type,
        "engine": lambda rm: engine[rm[1]].get(rm[0].speaker, ""),  # "": no speech
    }
    for label, groups in ((1, data.pos_groups), (0, data.neg_groups)):
        clips = [(r, m) for r, m in rows if r.kind == "clip" and r.label == label]
        for key, of in keys.items():
            names = sorted({of(r) for r in clips})
            assert len(names) > 1
            for name, group in zip(names, groups[key], strict=True):
                assert group.tolist() == [i for i, r in enumerate(clips) if of(r) == name]
    # One loud wake-phrase clip alone in its group, the others silent (augmentation keeps
    # silence near silent): balanced, the loud one fills a 1/len(groups) share of positives.
    data.pos[1:] = 0.0
    data.pos[0] = 0.3 * np.sin(np.arange(24000, dtype=np.float32) * 0.05)
    rest = np.arange(1, len(data.pos))
    data.pos_groups["engine"] = [np.array([0]), rest[: rest.size // 2], rest[rest.size // 2 :]]
    n_pos = round(SETTINGS.batch_size * SETTINGS.positive_share)

    def loud_share(balance_by: str) -> float:
        s = dataclasses.replace(SETTINGS, balance_by=balance_by)
        peaks = [np.abs(make_batch(data, k, s)[0][:n_pos]).max(axis=1) for k in range(40)]
        return float(np.mean(np.concatenate(peaks) > 2e-3))

    assert 0.2 < loud_share("engine") < 0.47  # 1/3 expected, over 40 batches
    assert loud_share("") < 0.1  # 1/len(data.pos) expected
    with pytest.raises(ConfigError, match="balance_by"):
        pretrain(corpus, tmp_path / "run", dataclasses.replace(SETTINGS, balance_by="voice"))


def test_schedule_warms_up_then_decays() -> None:
    s = PretrainSettings(samples=32 * 1000, warmup_steps=100)
    assert lr_at(0, s) < lr_at(99, s) == pytest.approx(s.lr)
    assert lr_at(999, s) == pytest.approx(0.05 * s.lr, rel=1e-3)


def test_event_counting_follows_the_streaming_detector() -> None:
    from wakefl.edge_runtime import detect_audio

    class Scorer:
        sample_rate, window_samples = 16000, 1600

        def score(self, windows: np.ndarray) -> np.ndarray:
            return np.clip(np.abs(windows).max(axis=1), 0, 1)

    rng = np.random.default_rng(3)
    wave = (rng.random(16000 * 20) < 0.0004).astype(np.float32) * rng.uniform(
        0.3, 1.0, 16000 * 20
    ).astype(np.float32)
    res = detect_audio(Scorer(), wave, hop_s=0.1, threshold=0.5, smoothing=3, refractory_s=1.0)
    sc = smoothed(res.raw_scores, 3)
    assert np.allclose(sc, res.scores)
    assert count_events(sc, 0.5, 10) == len(res.events)
    thr = threshold_for_fa([sc], 20 / 3600, 180.0, 10)  # at most one event in 20 s
    assert count_events(sc, thr, 10) <= 1 and count_events(sc, thr - 1e-3, 10) > 1


def test_train_checkpoint_resume_equals_uninterrupted_run(corpus: Path, tmp_path: Path) -> None:
    whole = pretrain(corpus, tmp_path / "a", SETTINGS, progress=False)
    assert whole["step"] == SETTINGS.total_steps
    for f in (BEST, BEST_CARD, STATE_INFO, "history.jsonl"):
        assert (tmp_path / "a" / f).exists()
    card = json.loads((tmp_path / "a" / BEST_CARD).read_text())
    assert 0.0 <= card["threshold"] <= 1.0 + 1e-6 and card["smoothing"] == 3
    # Killed after 2 steps (the checkpoint of that moment survives), then resumed.
    pretrain(corpus, tmp_path / "b", SETTINGS, progress=False, max_steps=2)
    assert json.loads((tmp_path / "b" / STATE_INFO).read_text())["step"] == 2
    with pytest.raises(ConfigError, match="--resume"):
        pretrain(corpus, tmp_path / "b", SETTINGS, progress=False)
    resumed = pretrain(corpus, tmp_path / "b", SETTINGS, resume=True, progress=False)
    assert resumed["step"] == SETTINGS.total_steps
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "a" / "state.safetensors"))
    wb = load_file(str(tmp_path / "b" / "state.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="width"):
        pretrain(
            corpus,
            tmp_path / "b",
            PretrainSettings(width=0.5, samples=96, batch_size=16),
            resume=True,
            progress=False,
        )


def test_more_batch_workers_train_the_same_run(corpus: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    s = dataclasses.replace(SETTINGS, samples=16 * 3)
    pretrain(corpus, tmp_path / "one", s, progress=False)
    pretrain(corpus, tmp_path / "three", dataclasses.replace(s, workers=3), progress=False)
    wa = load_file(str(tmp_path / "one" / "state.safetensors"))
    wb = load_file(str(tmp_path / "three" / "state.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=0)


def test_init_from_a_narrower_model_widens_it(corpus: Path, tmp_path: Path) -> None:
    from wakefl.models.kws_cnn import KwsCnn, ModelConfig, save_model

    torch.manual_seed(0)
    narrow = tmp_path / "narrow.safetensors"
    save_model(KwsCnn(ModelConfig(width=0.25)), narrow)
    wide = dataclasses.replace(SETTINGS, width=1.0)
    info = pretrain(corpus, tmp_path / "w", wide, init_from=narrow, progress=False, max_steps=1)
    assert info["init_from"] == str(narrow) and info["step"] == 1
    # The other way round would throw trained channels away: refused.
    save_model(KwsCnn(ModelConfig(width=1.0)), tmp_path / "wide.safetensors")
    with pytest.raises(ConfigError, match="wider"):
        pretrain(
            corpus,
            tmp_path / "n",
            SETTINGS,
            init_from=tmp_path / "wide.safetensors",
            progress=False,
        )


def test_the_distillation_loss_is_the_scaled_kl_divergence_between_tempered_scores() -> None:
    student = torch.tensor([[0.3, -1.2], [2.0, 0.5]])
    teacher = torch.tensor([[1.0, 1.0], [-3.0, 2.0]])
    for t in (1.0, 2.0, 4.0):
        p = torch.softmax(teacher / t, dim=1)
        q = torch.softmax(student / t, dim=1)
        expected = t * t * (p * (p / q).log()).sum(dim=1).mean()
        torch.testing.assert_close(distill_loss(student, teacher, t), expected)
        assert float(distill_loss(teacher, teacher, t)) == pytest.approx(0.0, abs=1e-7)


def test_a_student_learns_its_teachers_scores_and_a_resume_keeps_the_teacher(
    corpus: Path, tmp_path: Path
) -> None:
    from wakefl.models.kws_cnn import KwsCnn, ModelConfig, save_model

    # A teacher that calls everything the phrase: labels alone teach the opposite for the
    # negatives, so which of the two the student followed shows in its scores.
    torch.manual_seed(3)
    yes = KwsCnn(ModelConfig(width=0.25))
    with torch.no_grad():
        yes.head[-1].weight.zero_()
        yes.head[-1].bias.copy_(torch.tensor([-6.0, 6.0]))
    teacher = save_model(yes, tmp_path / "teacher.safetensors")
    fast = dataclasses.replace(SETTINGS, lr=0.02)
    taught = dataclasses.replace(fast, distill_from=str(teacher), distill_weight=1.0)
    negatives = load_pretrain_data(corpus, yes.cfg.window_samples, 6.0, False, 0).neg[:64]
    scores = {}
    for name, settings in (("labels", fast), ("teacher", taught)):
        info = pretrain(corpus, tmp_path / name, settings, progress=False, max_steps=6)
        model = load_model(
            publish(tmp_path / name, "small", dest=tmp_path / f"p-{name}", checkpoint="last")
        )
        scores[name] = float(score_batches(model, negatives).mean())
    assert info["teacher_digest"] == weights_digest(teacher)
    assert scores["teacher"] > 0.5 > scores["labels"]
    # A resumed run must be taught by the same weights; a teacher of another frontend and
    # a weight outside (0, 1] are refused before the corpus is decoded, the weight before
    # the run's folder is made.
    other = save_model(KwsCnn(ModelConfig(width=0.25)), tmp_path / "other.safetensors")
    mels = save_model(KwsCnn(ModelConfig(width=0.25, n_mels=32)), tmp_path / "m.safetensors")
    refused = (
        ("teacher", dataclasses.replace(taught, distill_from=str(other)), "from other weights"),
        ("x", dataclasses.replace(taught, distill_from=str(mels)), "frontend"),
        ("y", dataclasses.replace(taught, distill_weight=1.5), "weight in"),
    )
    for folder, settings, message in refused:
        with pytest.raises(ConfigError, match=message):
            pretrain(
                corpus,
                tmp_path / folder,
                settings,
                resume=folder == "teacher",
                progress=False,
                max_steps=1,
            )
    assert not (tmp_path / "y").exists()


def test_mel_warp_moves_a_formant_by_its_factor() -> None:
    import librosa

    from wakefl.tools.augmentation.mel_warp import hz_to_mel, source_positions, warp_log_mel

    hz = np.array([0.0, 300.0, 999.0, 1000.0, 2500.0, 8000.0])
    assert np.allclose(hz_to_mel(hz), librosa.hz_to_mel(hz))  # the frontend's Slaney scale
    assert np.allclose(source_positions(40, 20.0, 8000.0, np.array([1.0]))[0], np.arange(40))
    centres = librosa.mel_frequencies(42, fmin=20.0, fmax=8000.0)[1:-1]
    # A peak at band k (a formant at centre_k) lands, after scaling by alpha, on the band
    # whose centre is nearest alpha * centre_k.
    k, alphas = 20, np.array([0.9, 1.1])
    feats = torch.zeros(2, 40, 5)
    feats[:, k, :] = 1.0
    warped = warp_log_mel(feats, alphas, 20.0, 8000.0)
    for j, a in enumerate(alphas):
        peak = int(warped[j, :, 0].argmax())
        assert peak == int(np.argmin(np.abs(centres - a * centres[k]))) != k
    torch.testing.assert_close(warp_log_mel(feats, np.ones(2), 20.0, 8000.0), feats)


def test_time_warp_stretches_one_side_and_compresses_the_other() -> None:
    from wakefl.tools.augmentation.time_warp import MAX_WARP, draw_warp, source_frames, warp_time

    frames, last = 151, 150.0
    assert np.allclose(source_frames(frames, np.array([60.0]), np.array([60.0]))[0], np.arange(151))
    src = source_frames(frames, np.array([60.0, 90.0]), np.array([75.0, 70.0]))
    # Ends fixed, the anchor lands where it was moved, each side linear.
    assert np.allclose(src[:, 0], 0.0) and np.allclose(src[:, -1], last)
    assert np.isclose(src[0, 75], 60.0) and np.isclose(src[1, 70], 90.0)
    assert np.allclose(np.diff(src[0, :76]), 60 / 75) and np.allclose(np.diff(src[0, 75:]), 90 / 75)
    with pytest.raises(ValueError, match="inside"):
        source_frames(frames, np.array([0.0]), np.array([10.0]))
    # A ramp is interpolated exactly, so the output is the source positions themselves.
    ramp = torch.arange(frames, dtype=torch.float64).expand(2, 3, frames).clone()
    out = warp_time(ramp, np.array([60.0, 90.0]), np.array([75.0, 70.0]))
    assert np.allclose(out[:, 0].numpy(), src)
    # A "syllable" of 20 frames before the anchor at 60, moved to 75: 20 * 75 / 60 = 25 frames.
    feats = torch.zeros(1, 2, frames)
    feats[0, :, 30:50] = 1.0
    long = warp_time(feats, np.array([60.0]), np.array([75.0]))
    assert int((long[0, 0] > 0.5).sum()) == 25
    torch.testing.assert_close(warp_time(feats, np.array([60.0]), np.array([60.0])), feats)
    # Draws: the side nearer the edge changes by at most the factor asked; the same
    # generator state gives the same draws.
    anchor, moved = draw_warp(4000, frames, 0.3, torch.Generator().manual_seed(1))
    near = np.minimum(anchor, last - anchor)
    assert ((anchor >= 0.25 * last) & (anchor <= 0.75 * last)).all()
    assert (np.abs(moved - anchor) <= 0.3 * near + 1e-9).all()
    assert np.abs(moved - anchor).max() > 0.29 * near[np.argmax(np.abs(moved - anchor))]
    again = draw_warp(4000, frames, 0.3, torch.Generator().manual_seed(1))
    assert np.array_equal(anchor, again[0]) and np.array_equal(moved, again[1])
    with pytest.raises(ValueError, match="time warp"):
        draw_warp(4, frames, MAX_WARP, torch.Generator())


def test_mining_keeps_the_highest_scoring_negatives() -> None:
    from wakefl.tools.training.hard_negatives import (
        CLIP,
        STREAM,
        candidates,
        fits,
        mine,
        windows_of,
    )

    rng = np.random.default_rng(0)
    streams = [rng.uniform(-1, 1, 5000).astype(np.float32) * g for g in (0.1, 0.5)]
    clips = rng.uniform(-1, 1, (30, 400)).astype(np.float32) * rng.uniform(0, 1, (30, 1))

    def loudness(w: np.ndarray) -> np.ndarray:
        return np.abs(w).mean(axis=1)

    desc = candidates(streams, len(clips), 400, 40, seed=1, step=3)
    assert np.array_equal(desc, candidates(streams, len(clips), 400, 40, seed=1, step=3))
    assert not np.array_equal(desc, candidates(streams, len(clips), 400, 40, seed=1, step=4))
    assert (desc[:, 0] == STREAM).sum() == 20 and (desc[:, 0] == CLIP).sum() == 20
    assert all(s + 400 <= streams[i].size for src, i, s in desc if src == STREAM)
    pool = mine(loudness, streams, clips, 400, 40, 8, seed=1, step=3, chunk=7)
    all_scores = loudness(windows_of(desc, streams, clips, 400))
    pool_scores = loudness(windows_of(pool, streams, clips, 400))
    assert np.allclose(pool_scores, np.sort(all_scores)[::-1][:8])
    assert fits(pool, streams, len(clips), 400)
    assert not fits(pool, streams[:1] + [streams[1][:300]], len(clips), 400)  # short stream
    assert not fits(np.array([[CLIP, 30, 0]]), streams, len(clips), 400)
    assert not fits(np.array([[7, 0, 0]]), streams, len(clips), 400)


def test_mining_and_warp_resume_equals_uninterrupted_run(corpus: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    s = dataclasses.replace(
        SETTINGS,
        hard_negative_share=0.5,
        mine_every_steps=2,
        mine_candidates=24,
        hard_pool=6,
        mel_warp=0.1,
        time_warp=0.2,
    )
    whole = pretrain(corpus, tmp_path / "a", s, progress=False)
    assert whole["hard_pool_step"] == 4 and len(whole["hard_pool"]) == 6
    # A pool of silent windows: the negatives drawn from it stay (nearly) silent through
    # the augmentation, the others do not.
    data = load_pretrain_data(corpus, 24000, 6.0, progress=False)
    data.hard = np.zeros((6, 24000), np.float32)
    n_pos = round(s.batch_size * s.positive_share)
    n_hard = round((s.batch_size - n_pos) * s.hard_negative_share)
    x, y = make_batch(data, 5, s)
    peaks = np.abs(x).max(axis=1)
    assert (y[n_pos : n_pos + n_hard] == 0).all() and (peaks[n_pos : n_pos + n_hard] < 2e-3).all()
    assert (peaks[n_pos + n_hard :] > 2e-3).any()
    pretrain(corpus, tmp_path / "b", s, progress=False, max_steps=3)  # killed mid-segment
    pretrain(corpus, tmp_path / "b", s, resume=True, progress=False)
    wa = load_file(str(tmp_path / "a" / "state.safetensors"))
    wb = load_file(str(tmp_path / "b" / "state.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
    assert json.loads((tmp_path / "b" / STATE_INFO).read_text())["hard_pool"] == whole["hard_pool"]
    # A checkpoint whose pool names a clip this corpus lacks is refused on resume.
    pretrain(corpus, tmp_path / "c", s, progress=False, max_steps=3)
    state = json.loads((tmp_path / "c" / STATE_INFO).read_text())
    state["hard_pool"][0] = [1, 10**6, 0]
    (tmp_path / "c" / STATE_INFO).write_text(json.dumps(state))
    with pytest.raises(ConfigError, match="another corpus"):
        pretrain(corpus, tmp_path / "c", s, resume=True, progress=False)


@pytest.mark.parametrize(
    "flags",
    [
        ["--mel-warp", "0.7"],
        ["--mel-warp", "nan"],
        ["--time-warp", "0.5"],
        ["--time-warp", "nan"],
        ["--hard-negatives", "1.5"],
        ["--mine-every", "0"],
        ["--workers", "-1"],
        ["--extra-corpus", "no-such-corpus/manifest.csv"],
        ["--distill-weight", "0.3"],
        ["--distill-temperature", "4"],
        ["--distill-from", "no-such-teacher.safetensors"],
        ["--distill-weight", "nan", "--distill-from", __file__],
        ["--distill-temperature", "0", "--distill-from", __file__],
        ["--field-augment", "1.5"],
        ["--field-augment", "nan"],
        ["--speech-backgrounds", "-0.1"],
        ["--speech-backgrounds", "nan"],
        ["--noise-snr-floor", "nan"],
        ["--noise-snr-floor", "-40"],
        ["--noise-snr-floor", "30"],
        ["--logit-margin", "-1"],
        ["--logit-margin", "nan"],
        ["--logit-margin", "40"],
        ["--positive-margin", "-1"],
        ["--positive-margin", "nan"],
        ["--logit-cap", "nan"],
        ["--positive-margin", "6", "--logit-cap", "4"],
        ["--logit-cap", "40"],
        ["--speech-over-near-rhymes", "no"],
        ["--speech-over-stream-near-rhymes", "no"],
        ["--val-corpus", "no-such-corpus/manifest.csv"],
    ],
)
def test_pretrain_cli_refuses_absurd_flags(flags, tmp_path: Path, capsys) -> None:
    from wakefl.tools.cli import main

    rc = main(["model", "pretrain", "--out", str(tmp_path / "run"), "--quiet", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and flags[0] in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before any corpus build or run folder
