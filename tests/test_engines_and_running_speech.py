"""The speech engines of the `pretrain-engines` add-on (RHVoice, MBROLA, festival's other
voices) and the phrase inside running speech (`pos_run` / `conf_run` clips)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wakefl.sdk.manifest import CLIP_SAMPLES, SAMPLE_RATE, read_manifest
from wakefl.tools.corpus.build import build_corpus
from wakefl.tools.corpus.plan import PROFILES
from wakefl.tools.corpus.rendering import join_utterances, place_in_running_speech
from wakefl.tools.corpus.speakers import make_speakers, make_unseen_speakers
from wakefl.tools.corpus.speech_synthesis import Voice, synthesize
from wakefl.tools.corpus.voices import (
    ENGINES_TRAIN_FESTIVAL,
    ENGINES_TRAIN_MBROLA,
    ENGINES_TRAIN_RHVOICE,
    ENGINES_UNSEEN_MBROLA,
    ENGINES_UNSEEN_RHVOICE,
)


def _absent(engine: str, voice: str) -> str | None:
    """Why `voice` cannot speak on this machine, or None when it can."""
    if engine == "rhvoice":
        if shutil.which("RHVoice-test") is None:
            return "RHVoice is not installed (Debian non-free 'rhvoice'; scripts/setup.sh)"
        if not Path("/usr/share/RHVoice/voices", voice).is_dir():
            return f"RHVoice voice {voice} is not installed ('rhvoice-english')"
    elif engine == "mbrola":
        if shutil.which("mbrola") is None or shutil.which("espeak-ng") is None:
            return (
                "MBROLA or espeak-ng is not installed (Debian contrib 'mbrola'; scripts/setup.sh)"
            )
        database = voice.removeprefix("mb-").removesuffix("-en")
        if not Path("/usr/share/mbrola", database).is_dir():
            return f"MBROLA voice database {database} is not installed ('mbrola-{database}')"
    elif shutil.which("text2wave") is None:
        return "festival is not installed (scripts/setup.sh)"
    return None


_VOICES = (
    [("rhvoice", v, 100, 100) for v in ENGINES_TRAIN_RHVOICE + ENGINES_UNSEEN_RHVOICE]
    + [("mbrola", v, 160, 50) for v in ENGINES_TRAIN_MBROLA + ENGINES_UNSEEN_MBROLA]
    + [("festival", v, 100, 0) for v in ENGINES_TRAIN_FESTIVAL]
)


@pytest.mark.parametrize(("engine", "name", "rate", "pitch"), _VOICES)
def test_each_new_voice_says_the_phrase_the_same_way_twice(
    tmp_path: Path, engine: str, name: str, rate: int, pitch: int
) -> None:
    reason = _absent(engine, name)
    if reason:
        pytest.skip(reason)
    voice = Voice(engine, name, "", rate, pitch)
    first = synthesize(voice, "hey nova", cache_dir=tmp_path / "a")
    again = synthesize(voice, "hey nova", cache_dir=tmp_path / "b")
    # Two words of speech at 16 kHz: a few tenths of a second, not silence, not a click.
    assert first.dtype == np.float32 and 0.25 < first.size / SAMPLE_RATE < 2.0
    assert float(np.sqrt(np.mean(first**2))) > 0.01
    np.testing.assert_array_equal(first, again)


def test_pico_renders_the_same_whatever_the_process_rendered_before(tmp_path: Path) -> None:
    # Pico reads working memory it has not written. Before that memory came zeroed, a new
    # process's third render of a text, after arrays freed, differed from its first by up to
    # 99 LSB.
    pytest.importorskip("py_nanotts")
    script = tmp_path / "renders.py"
    script.write_text(
        "import sys\nfrom pathlib import Path\nimport numpy as np\n"
        "from wakefl.tools.corpus.speech_synthesis import Voice, synthesize\n"
        "out = Path(sys.argv[1])\n"
        "phrase = Voice('pico', 'en-GB', '', 90, 120), 'hey nova, turn on the lights please'\n"
        "other = Voice('pico', 'en-US', '', 110, 90), 'good morning'\n"
        "order = [phrase, phrase, other, phrase, phrase]\n"
        "waves = []\n"
        "for i, (v, t) in enumerate(order):\n"
        "    waves.append(synthesize(v, t, out / str(i)))\n"
        "    churn = [np.full(400_000 * (k + 1), 0.5) for k in range(4)]  # 3-13 MB, freed\n"
        "    del churn\n"
        "np.save(out / 'phrase.npy', np.stack([w for w, j in zip(waves, order) if j == phrase]))\n"
    )
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True)
    renders = np.load(tmp_path / "phrase.npy")
    for again in renders[1:]:
        np.testing.assert_array_equal(renders[0], again)
    # In this process too, after everything the tests before it allocated and freed.
    here = synthesize(Voice("pico", "en-GB", "", 90, 120), "hey nova, turn on the lights please",
                      tmp_path / "here")  # fmt: skip
    np.testing.assert_array_equal(renders[0], here)


def test_a_slower_rate_speaks_longer() -> None:
    reason = _absent("rhvoice", "bdl")
    if reason:
        pytest.skip(reason)
    fast = synthesize(Voice("rhvoice", "bdl", "", 150, 100), "hey nova, turn on the lights")
    slow = synthesize(Voice("rhvoice", "bdl", "", 70, 100), "hey nova, turn on the lights")
    assert slow.size > 1.3 * fast.size


def test_the_engines_add_on_keeps_its_held_out_voices_and_the_main_corpus_apart() -> None:
    prof = PROFILES["pretrain-engines"]
    train = make_speakers(0, prof, "hey nova")
    unseen = make_unseen_speakers(0, prof, "hey nova")
    train_voices = {s.voice.voice for s in train}
    unseen_voices = {s.voice.voice for s in unseen}
    assert train_voices == set(
        ENGINES_TRAIN_RHVOICE + ENGINES_TRAIN_MBROLA + ENGINES_TRAIN_FESTIVAL
    )
    assert unseen_voices == set(ENGINES_UNSEEN_RHVOICE + ENGINES_UNSEEN_MBROLA)
    assert "slt" not in train_voices | unseen_voices  # the held-out HTS voice's speaker
    # The main pretraining corpus hears none of the new engines.
    main = make_speakers(0, PROFILES["pretrain"], "hey nova")
    assert {s.voice.engine for s in main}.isdisjoint({"rhvoice", "mbrola"})
    assert {s.voice.voice for s in main}.isdisjoint(train_voices | unseen_voices)
    # Every split hears every engine (stratified by engine).
    for split in ("train", "val", "test"):
        assert {s.voice.engine for s in train if s.split == split} == {
            "rhvoice",
            "mbrola",
            "festival",
        }


def test_utterances_join_with_pauses_and_overlap_when_run_together() -> None:
    a, b = np.ones(1000), 2 * np.ones(500)
    joined, starts = join_utterances([a, b], [0.01])
    assert starts == [0, 1160] and joined.size == 1660 and joined[1100] == 0.0
    # A negative pause overlaps the parts, as words said in one breath.
    joined, starts = join_utterances([a, b], [-0.02])
    assert starts == [0, 680] and joined.size == 1180 and joined[700] == 3.0


@pytest.mark.parametrize(("start", "end"), [(100, 8000), (30000, 50000), (5000, 40000)])
def test_the_window_holds_the_phrase_whole_wherever_it_lies(start: int, end: int) -> None:
    speech = np.zeros(60000)
    speech[start:end] = 1.0
    for seed in range(20):
        window = place_in_running_speech(np.random.default_rng(seed), speech, start, end)
        assert window.size == CLIP_SAMPLES
        # A phrase longer than 1.4 s is sped up to fit; otherwise all of it is there.
        assert window.sum() >= min(end - start, 1.4 * SAMPLE_RATE) - 2


@pytest.mark.slow
def test_running_speech_clips_are_labelled_and_deterministic(tmp_path: Path) -> None:
    first = build_corpus(tmp_path / "a", 0, "pretrain-carrier-micro", progress=False)
    again = build_corpus(tmp_path / "b", 0, "pretrain-carrier-micro", progress=False)
    rows = read_manifest(first)
    kinds = {(Path(r.path).stem.split("_", 3)[3], r.label) for r in rows}
    assert kinds == {("pos_run", 1), ("conf_run", 0)}
    assert {r.split for r in rows} == {"train", "val", "test"}
    # The add-on's speakers are the main corpus's own, splits included.
    main = {s.speaker_id: s.split for s in make_speakers(0, PROFILES["pretrain-micro"], "hey nova")}
    assert all(main[r.speaker] == r.split for r in rows)
    for r in rows[:10]:
        assert (first.parent / r.path).read_bytes() == (again.parent / r.path).read_bytes()
