"""GnuSpeech as a speech engine (tools/corpus/gnuspeech.py): real synthesis through Node.js
and the pinned WebAssembly package, skipped with the reason where they are absent."""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from scipy.signal import welch

from wakefl.errors import ConfigError
from wakefl.sdk.manifest import SAMPLE_RATE
from wakefl.tools.corpus.gnuspeech import GNUSPEECH_TRACT_CM, gnuspeech_version, tract_length_cm
from wakefl.tools.corpus.speech_synthesis import Voice, synthesize
from wakefl.tools.corpus.voices import draw_gnuspeech_voice


def _absent() -> str | None:
    try:
        gnuspeech_version()
    except ConfigError as exc:
        return str(exc)
    return None


_WHY_ABSENT = _absent()
needs_engine = pytest.mark.skipif(_WHY_ABSENT is not None, reason=_WHY_ABSENT or "")


def _spectral_centroid(wave: np.ndarray) -> float:
    """The power spectrum's centre between 200 Hz and 6 kHz, where the formants lie."""
    freqs, power = welch(wave, SAMPLE_RATE, nperseg=1024)
    band = (freqs > 200) & (freqs < 6000)
    return float((power[band] * freqs[band]).sum() / power[band].sum())


@needs_engine
def test_a_speaker_says_the_phrase_the_same_way_twice(tmp_path: Path) -> None:
    voice = Voice("gnuspeech", "female", "vtl150", 100, -4)
    first = synthesize(voice, "hey nova", cache_dir=tmp_path / "a")
    again = synthesize(voice, "hey nova", cache_dir=tmp_path / "b")  # a new rendering
    assert first.dtype == np.float32 and 0.25 < first.size / SAMPLE_RATE < 2.0
    assert float(np.sqrt(np.mean(first**2))) > 0.01
    np.testing.assert_array_equal(first, again)


@needs_engine
def test_the_physical_settings_change_the_voice(tmp_path: Path) -> None:
    def say(variant: str, rate: int = 100) -> np.ndarray:
        return synthesize(Voice("gnuspeech", "male", variant, rate, -4), "hey nova", tmp_path)

    long_tract, short_tract = say("vtl200"), say("vtl100")
    # A shorter vocal tract raises the formants: the spectrum's centre moves up.
    assert _spectral_centroid(short_tract) > 1.15 * _spectral_centroid(long_tract)
    assert say("vtl175", rate=70).size > 1.2 * say("vtl175", rate=130).size


def test_voices_drawn_between_the_shipped_ones_are_deterministic_and_in_range() -> None:
    a = [draw_gnuspeech_voice(np.random.default_rng(5)) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    drawn = [draw_gnuspeech_voice(np.random.default_rng(s)) for s in range(200)]
    assert {v.voice for v in drawn} == set(GNUSPEECH_TRACT_CM)
    for v in drawn:
        length = tract_length_cm(v)
        assert length is not None
        assert 0.89 <= length / GNUSPEECH_TRACT_CM[v.voice] <= 1.11
        assert 85 <= v.rate <= 120 and -7 <= v.pitch <= -1


@pytest.mark.parametrize("variant", ["long", "vtl", "vtl50", "vtl500", "vtl-150", "vtl15.5"])
def test_a_variant_that_is_no_tract_length_is_refused(variant: str) -> None:
    with pytest.raises(ConfigError, match="vtl<mm>"):
        tract_length_cm(Voice("gnuspeech", "male", variant, 100, -4))


@needs_engine
@pytest.mark.parametrize(
    ("voice", "rate", "pitch"), [("baby", 100, -4), ("male", 20, -4), ("male", 100, 40)]
)
def test_absurd_settings_are_refused_before_synthesis(voice: str, rate: int, pitch: int) -> None:
    from wakefl.tools.corpus.gnuspeech import run_gnuspeech

    with pytest.raises(ConfigError):
        run_gnuspeech(Voice("gnuspeech", voice, "", rate, pitch), "hey nova")


def _install_module():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "install_gnuspeech.py"
    spec = importlib.util.spec_from_file_location("install_gnuspeech", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tarball(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_the_installer_unpacks_a_package_and_refuses_paths_that_leave_it(tmp_path: Path) -> None:
    inst = _install_module()
    inst._unpack(_tarball({"package/package.json": b"{}", "package/wasm/x.js": b"1"}), tmp_path)
    assert (tmp_path / "package.json").read_bytes() == b"{}"
    assert (tmp_path / "wasm" / "x.js").read_bytes() == b"1"
    for bad in ("package/../../evil", "/etc/evil", "other/file"):
        with pytest.raises(SystemExit):
            inst._unpack(_tarball({bad: b"x"}), tmp_path / "out")
    assert not (tmp_path.parent / "evil").exists()
    # Every pinned package carries an integrity hash of the form the registry publishes.
    for _version, url, integrity in inst.PACKAGES.values():
        algo, _, digest = integrity.partition("-")
        assert url.startswith("https://registry.npmjs.org/") and algo == "sha512"
        assert len(base64.b64decode(digest)) == hashlib.sha512().digest_size


def test_the_intelligibility_benchmark_refuses_a_speaker_count_out_of_range() -> None:
    from wakefl.tools.bench.engine_intelligibility import main

    with pytest.raises(ConfigError, match="--speakers"):
        main(["--speakers", "0"])


@needs_engine
def test_the_intelligibility_benchmark_scores_each_kind_of_speech(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from wakefl.tools.bench.engine_intelligibility import main

    assert main(["--speakers", "2", "--model", "small", "--seed", "3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| voice |") and rows[-1].startswith("| all | 2 |")
    shares = [cell.strip() for cell in rows[-1].split("|")[3:6]]
    assert all(s.endswith("%") and 0 <= int(s[:-1]) <= 100 for s in shares)
    assert 0.0 <= float(rows[-1].split("|")[6]) <= 1.0


def test_the_gnuspeech_add_on_keeps_its_unseen_voice_out_of_training() -> None:
    from wakefl.tools.corpus.gnuspeech import GNUSPEECH_TRAIN, GNUSPEECH_UNSEEN
    from wakefl.tools.corpus.plan import PROFILES
    from wakefl.tools.corpus.speakers import make_speakers, make_unseen_speakers

    prof = PROFILES["pretrain-gnuspeech"]
    speakers = make_speakers(0, prof, "hey nova")
    unseen = make_unseen_speakers(0, prof, "hey nova")
    assert len(speakers) == prof.n_speakers and len(unseen) == prof.unseen_speakers
    assert {s.voice.engine for s in speakers + unseen} == {"gnuspeech"}
    for split in ("train", "val", "test"):  # every split hears every training voice
        assert {s.voice.voice for s in speakers if s.split == split} == set(GNUSPEECH_TRAIN)
    assert {s.voice.voice for s in unseen} == set(GNUSPEECH_UNSEEN)
    # The unseen speakers' tracts are shorter than any training speaker's.
    longest_unseen = max(tract_length_cm(s.voice) or 0.0 for s in unseen)
    assert longest_unseen < min(tract_length_cm(s.voice) or 99.0 for s in speakers)
    assert speakers == make_speakers(0, prof, "hey nova") != make_speakers(1, prof, "hey nova")
    with pytest.raises(ConfigError, match="base voices"):
        draw_gnuspeech_voice(np.random.default_rng(0), ("baby",))


@needs_engine
@pytest.mark.slow  # about 30 s: the micro add-on's speech through GnuSpeech
def test_the_micro_gnuspeech_add_on_builds_with_its_unseen_split(tmp_path: Path) -> None:
    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.corpus.build import build_corpus

    manifest = build_corpus(
        tmp_path / "c", seed=0, profile="pretrain-gnuspeech-micro", progress=False,
        tts_cache_dir=tmp_path / "tts",
    )  # fmt: skip
    rows = read_manifest(manifest)
    assert any(r.label == 1 for r in rows if r.split == "train")
    unseen = read_manifest(manifest.parent / "unseen" / "manifest.csv")
    assert unseen and all(r.split == "test" for r in unseen)
    assert {r.speaker for r in unseen if r.speaker.startswith("unseen")}
    speakers = (manifest.parent / "speakers.csv").read_text().splitlines()[1:]
    assert speakers and all(",gnuspeech," in line for line in speakers)
