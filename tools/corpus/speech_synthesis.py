"""Speech from offline synthesisers, resampled to 16 kHz and cached: espeak-ng, flite,
festival, RHVoice and MBROLA (Debian packages; RHVoice and MBROLA from the contrib and
non-free components) and SVOX Pico (the `py-nanotts` wheel, its voices inside).

Every engine is deterministic for a given voice, settings and text (Pico once the memory it
reads before writing comes zeroed, `_fresh_pico_memory`); the cache key is a hash of exactly
those (and the engine's version), so a cached render equals a fresh one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
from scipy.signal import resample_poly

from wakefl.cache_location import cache_root
from wakefl.errors import AudioError, ConfigError
from wakefl.progress_bars import bar_disabled
from wakefl.tools.corpus.gnuspeech import gnuspeech_version, run_gnuspeech

SAMPLE_RATE = 16000

# espeak-ng English voices that work without MBROLA, and variants that sound like people
# (robotic, whispering and joke variants are left out).
ESPEAK_VOICES = (
    "en-us", "en-gb", "en-gb-scotland", "en-gb-x-gbclan",
    "en-gb-x-rp", "en-gb-x-gbcwmd", "en-029", "en-us-nyc",
)  # fmt: skip
ESPEAK_VARIANTS = (
    "m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8", "f1", "f2", "f3", "f4", "f5",
    "klatt", "klatt2", "klatt3", "klatt4", "Alex", "Andy", "Annie", "aunty", "benjamin",
    "david", "ed", "edward", "grandma", "grandpa", "john", "linda", "max", "michel",
    "paul", "robert", "steph", "victor", "adam", "caleb", "shelby", "travis", "zac",
)  # fmt: skip
FLITE_VOICES = ("kal16", "awb", "rms", "slt")
# festival voice names as its Scheme functions call them (Debian festvox-* packages).
FESTIVAL_PACKAGES = {
    "kal_diphone": "festvox-kallpc16k",
    "ked_diphone": "festvox-kdlpc16k",
    "cmu_us_slt_arctic_hts": "festvox-us-slt-hts",
    "rab_diphone": "festvox-rablpc16k",
    "don_diphone": "festvox-don",
    # festival's prosody over the MBROLA speakers' diphones.
    "us1_mbrola": "festvox-us1",
    "us2_mbrola": "festvox-us2",
    "us3_mbrola": "festvox-us3",
    "en1_mbrola": "festvox-en1",
}
FESTIVAL_VOICES = tuple(FESTIVAL_PACKAGES)
# RHVoice's English voices (HMM synthesis). Its `slt` is the CMU ARCTIC speaker behind
# festival's HTS voice, which the unseen-voices split holds out, so it is never used.
RHVOICE_VOICES = ("alan", "bdl", "clb", "evgeniy-eng", "lyubov")
# MBROLA diphone voices driven by espeak-ng: `mb-us1` speaks English with its own speaker,
# `mb-de1-en` reads English with a German speaker's diphones (accented English).
MBROLA_PACKAGES = {
    "mb-us1": "mbrola-us1",
    "mb-us2": "mbrola-us2",
    "mb-us3": "mbrola-us3",
    "mb-en1": "mbrola-en1",
    "mb-de1-en": "mbrola-de1",
    "mb-de2-en": "mbrola-de2",
    "mb-nl2-en": "mbrola-nl2",
    "mb-fr1-en": "mbrola-fr1",
    "mb-fr4-en": "mbrola-fr4",
    "mb-sw2-en": "mbrola-sw2",
    "mb-pl1-en": "mbrola-pl1",
    "mb-hu1-en": "mbrola-hu1",
}
MBROLA_VOICES = tuple(MBROLA_PACKAGES)
PICO_VOICES = ("en-US", "en-GB")
# Pico's other voices are other speakers recorded for other languages. Reading English text
# they give accented English from the same synthesis method, without using the two English
# voices that the unseen-voices split holds out.
PICO_OTHER_VOICES = ("de-DE", "es-ES", "fr-FR", "it-IT")
ENGINES = ("espeak-ng", "flite", "festival", "pico", "rhvoice", "mbrola", "gnuspeech")


@dataclass(frozen=True)
class Voice:
    """One synthetic speaker: engine, voice, variant and prosody settings.

    `rate` is words per minute for espeak-ng and MBROLA (spoken through espeak-ng), a
    duration stretch x100 for flite and festival, a speed factor x100 for Pico and a rate
    in percent for RHVoice; `pitch` is espeak-ng's 0-99 pitch, flite's mean F0 target in Hz,
    Pico's pitch factor x100 or RHVoice's pitch in percent (festival ignores it). GnuSpeech's
    are in tools/corpus/gnuspeech.py.
    """

    engine: str
    voice: str
    variant: str
    rate: int
    pitch: int

    def describe(self) -> str:
        return f"{self.engine}:{self.voice}{'+' + self.variant if self.variant else ''}:r{self.rate}:p{self.pitch}"


def default_cache_dir() -> Path:
    env = os.environ.get("WAKEFL_TTS_CACHE")
    return Path(env) if env else cache_root() / "tts"


@lru_cache(maxsize=8)
def engine_version(engine: str) -> str:
    if engine == "pico":
        try:
            import py_nanotts  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                f"the Pico engine needs the py-nanotts package ({exc}); run scripts/setup.sh"
            ) from None
        from importlib.metadata import version

        # The suffix keeps renders made before Pico's memory came zeroed out of the cache.
        return f"py-nanotts {version('py-nanotts')}, fresh memory"
    if engine in ("rhvoice", "mbrola"):
        return _debian_engine_version(engine)
    if engine == "gnuspeech":
        return gnuspeech_version()
    exe = {"espeak-ng": "espeak-ng", "flite": "flite", "festival": "text2wave"}.get(engine)
    if exe is None:
        raise ConfigError(f"unknown speech engine {engine!r}")
    if shutil.which(exe) is None:
        package = "festival" if engine == "festival" else exe
        raise ConfigError(
            f"{exe} is not installed (Debian package '{package}'; run scripts/setup.sh)"
        )
    cmd = ["festival", "--version"] if engine == "festival" else [exe, "--version"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return (
        (out.stdout + out.stderr).strip().splitlines()[0]
        if (out.stdout + out.stderr).strip()
        else exe
    )


def _debian_engine_version(engine: str) -> str:
    """RHVoice and MBROLA print no version of their own: the Debian package's stands in."""
    exe, package = {"rhvoice": ("RHVoice-test", "rhvoice"), "mbrola": ("mbrola", "mbrola")}[engine]
    if shutil.which(exe) is None or (engine == "mbrola" and shutil.which("espeak-ng") is None):
        raise ConfigError(
            f"{exe} is not installed (Debian package '{package}', in the contrib/non-free "
            "components; run scripts/setup.sh)"
        )
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True, check=False
    )
    return f"{package} {out.stdout.strip() or 'unknown'}"


def cache_key(voice: Voice, text: str) -> str:
    blob = f"{engine_version(voice.engine)}|{voice.describe()}|{text}".encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def _to_16k(wave: np.ndarray, sr: int) -> np.ndarray:
    if wave.ndim == 2:
        wave = wave.mean(axis=1)
    if sr != SAMPLE_RATE:
        g = np.gcd(sr, SAMPLE_RATE)
        wave = resample_poly(wave.astype(np.float64), SAMPLE_RATE // g, sr // g)
    return np.asarray(wave, dtype=np.float32)


def _run_engine(voice: Voice, text: str) -> np.ndarray:
    if voice.engine == "espeak-ng":
        name = f"{voice.voice}+{voice.variant}" if voice.variant else voice.voice
        cmd = [
            "espeak-ng",
            "-v",
            name,
            "-s",
            str(voice.rate),
            "-p",
            str(voice.pitch),
            "--stdout",
            text,
        ]
        res = subprocess.run(cmd, capture_output=True, check=False)
        if res.returncode != 0 or not res.stdout:
            raise AudioError(
                f"espeak-ng failed for {voice.describe()}: {res.stderr.decode(errors='replace')[:200]}"
            )
        wave, sr = sf.read(io.BytesIO(res.stdout), dtype="float32")
    elif voice.engine == "flite":
        with tempfile.TemporaryDirectory(prefix="wakefl-flite-") as tmp:
            out = Path(tmp) / "u.wav"
            cmd = [
                "flite", "-voice", voice.voice,
                "--setf", f"duration_stretch={voice.rate / 100:.2f}",
                "--setf", f"int_f0_target_mean={voice.pitch}",
                "-t", text, "-o", str(out),
            ]  # fmt: skip
            res = subprocess.run(cmd, capture_output=True, check=False)
            if res.returncode != 0 or not out.exists():
                raise AudioError(
                    f"flite failed for {voice.describe()}: {res.stderr.decode(errors='replace')[:200]}"
                )
            wave, sr = sf.read(str(out), dtype="float32")
    elif voice.engine == "festival":
        wave, sr = _run_festival(voice, text)
    elif voice.engine == "pico":
        wave, sr = _run_pico(voice, text)
    elif voice.engine == "rhvoice":
        wave, sr = _run_rhvoice(voice, text)
    elif voice.engine == "mbrola":
        wave, sr = _run_mbrola(voice, text)
    elif voice.engine == "gnuspeech":
        wave, sr = run_gnuspeech(voice, text)
    else:
        raise ConfigError(f"unknown speech engine {voice.engine!r}")
    wave = _to_16k(wave, sr)
    if wave.size == 0 or not np.any(wave):
        raise AudioError(f"{voice.describe()} produced no audio for {text!r}")
    return trim_silence(wave)


def _run_festival(voice: Voice, text: str) -> tuple[np.ndarray, int]:
    if voice.voice not in FESTIVAL_VOICES:
        raise ConfigError(
            f"unknown festival voice {voice.voice!r}; choose one of {', '.join(FESTIVAL_VOICES)}"
        )
    # text2wave reads the text from a file; the voice and the speaking rate are Scheme
    # expressions evaluated before synthesis.
    with tempfile.TemporaryDirectory(prefix="wakefl-festival-") as tmp:
        src, out = Path(tmp) / "u.txt", Path(tmp) / "u.wav"
        src.write_text(text + "\n", encoding="utf-8")
        cmd = [
            "text2wave", "-eval", f"(voice_{voice.voice})",
            "-eval", f"(Parameter.set 'Duration_Stretch {voice.rate / 100:.2f})",
            str(src), "-o", str(out),
        ]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, check=False)
        if res.returncode != 0 or not out.exists() or out.stat().st_size <= 44:
            detail = res.stderr.decode(errors="replace")[:200]
            raise AudioError(
                f"festival failed for {voice.describe()} (is {FESTIVAL_PACKAGES[voice.voice]} installed?): {detail}"
            )
        wave, sr = sf.read(str(out), dtype="float32")
    return wave, sr


# py-nanotts mallocs Pico's 2.5 MB working memory afresh for every utterance, and Pico reads
# some of it before writing it. A new process's first blocks are fresh (zeroed) pages; later
# ones are heap memory holding what earlier utterances, arrays or tensors left there. The
# same text then rendered differently (up to 99 LSB) with what the process had done before,
# so two builds of one corpus differed. While Pico renders, glibc's M_PERTURB fills every
# block malloc hands out with 0xff ^ 0xff = 0, what a fresh page holds; outside the render
# it is off again, so nothing else pays for the fill.
_M_PERTURB = -6  # glibc's malloc.h
_ZEROED_ALLOCATIONS = 0xFF
_PICO_RENDER = threading.Lock()  # py-nanotts holds the GIL while it renders: nothing is lost


@lru_cache(maxsize=1)
def _mallopt() -> Any:
    libc_name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    mallopt = getattr(ctypes.CDLL(libc_name), "mallopt", None) if libc_name else None
    if mallopt is None:
        raise ConfigError(
            "the Pico engine renders reproducibly only with glibc's malloc (mallopt); "
            "this platform has none"
        )
    return mallopt


@contextmanager
def _fresh_pico_memory() -> Iterator[None]:
    mallopt = _mallopt()
    with _PICO_RENDER:
        if mallopt(_M_PERTURB, _ZEROED_ALLOCATIONS) != 1:
            raise ConfigError("glibc refused M_PERTURB, which Pico renders reproducibly with")
        try:
            yield
        finally:
            mallopt(_M_PERTURB, 0)


def _run_pico(voice: Voice, text: str) -> tuple[np.ndarray, int]:
    engine_version("pico")
    import py_nanotts

    if voice.voice not in PICO_VOICES + PICO_OTHER_VOICES:
        known = ", ".join(PICO_VOICES + PICO_OTHER_VOICES)
        raise ConfigError(f"unknown Pico voice {voice.voice!r}; choose one of {known}")
    with _fresh_pico_memory():
        pcm = py_nanotts.NanoTTS().speak(
            text, voice=voice.voice, speed=voice.rate / 100.0, pitch=voice.pitch / 100.0
        )
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0, SAMPLE_RATE


def _run_rhvoice(voice: Voice, text: str) -> tuple[np.ndarray, int]:
    if voice.voice not in RHVOICE_VOICES:
        raise ConfigError(
            f"unknown RHVoice voice {voice.voice!r}; choose one of {', '.join(RHVOICE_VOICES)}"
        )
    with tempfile.TemporaryDirectory(prefix="wakefl-rhvoice-") as tmp:
        out = Path(tmp) / "u.wav"
        cmd = ["RHVoice-test", "-p", voice.voice, "-r", str(voice.rate), "-t", str(voice.pitch),
               "-o", str(out)]  # fmt: skip
        res = subprocess.run(cmd, input=text.encode(), capture_output=True, check=False)
        if res.returncode != 0 or not out.exists() or out.stat().st_size <= 44:
            detail = res.stderr.decode(errors="replace")[:200]
            raise AudioError(f"RHVoice failed for {voice.describe()}: {detail}")
        wave, sr = sf.read(str(out), dtype="float32")
    return wave, sr


def _run_mbrola(voice: Voice, text: str) -> tuple[np.ndarray, int]:
    if voice.voice not in MBROLA_VOICES:
        raise ConfigError(
            f"unknown MBROLA voice {voice.voice!r}; choose one of {', '.join(MBROLA_VOICES)}"
        )
    cmd = ["espeak-ng", "-v", voice.voice, "-s", str(voice.rate), "-p", str(voice.pitch),
           "--stdout", text]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, check=False)
    if res.returncode != 0 or len(res.stdout) <= 44:
        detail = res.stderr.decode(errors="replace")[:200]
        raise AudioError(
            f"MBROLA failed for {voice.describe()} (is {MBROLA_PACKAGES[voice.voice]} "
            f"installed?): {detail}"
        )
    wave, sr = sf.read(io.BytesIO(res.stdout), dtype="float32")
    # Some voice databases are recorded hot and clip at full scale: the level is set later.
    return wave, sr


def trim_silence(
    wave: np.ndarray, threshold_db: float = -45.0, margin_s: float = 0.03
) -> np.ndarray:
    """Cut leading and trailing silence (relative to the peak), keeping a short margin."""
    peak = float(np.max(np.abs(wave)))
    if peak == 0:
        return wave
    loud = np.flatnonzero(np.abs(wave) > peak * 10.0 ** (threshold_db / 20.0))
    m = int(margin_s * SAMPLE_RATE)
    return wave[max(0, loud[0] - m) : min(wave.size, loud[-1] + m + 1)].copy()


# np.load parses each .npy header with ast.literal_eval, and CPython 3.11's AST builder
# keeps its recursion depth in interpreter-wide state: two threads parsing at once can fail
# with "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905).
# synthesize_many reads cached entries from several threads, so those reads take turns.
_CACHE_READ = threading.Lock()


def synthesize(voice: Voice, text: str, cache_dir: Path | None = None) -> np.ndarray:
    """float32 mono speech at 16 kHz, leading/trailing silence trimmed; cached on disk."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(voice, text)
    file = cache_dir / key[:2] / f"{key}.npy"
    if file.is_file():
        try:
            with _CACHE_READ:
                return np.load(file)
        except (OSError, ValueError):
            pass  # a damaged cache entry is simply rendered again
    wave = _run_engine(voice, text)
    file.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename so that concurrent builds never read a half-written entry.
    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        np.save(f, wave)
    tmp.replace(file)
    return wave


def synthesize_many(
    jobs: Iterable[tuple[Voice, str]],
    cache_dir: Path | None = None,
    workers: int = 2,
    progress: bool = True,
) -> dict[tuple[Voice, str], np.ndarray]:
    """Render many utterances; the engines run as subprocesses, so threads overlap them."""
    from tqdm import tqdm

    unique = list(dict.fromkeys(jobs))
    for v in {j[0].engine for j in unique}:
        engine_version(v)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        waves = list(
            tqdm(
                pool.map(lambda j: synthesize(j[0], j[1], cache_dir), unique),
                total=len(unique),
                desc="speech",
                unit="utt",
                disable=bar_disabled(progress),
                leave=False,
            )
        )
    return dict(zip(unique, waves, strict=True))
