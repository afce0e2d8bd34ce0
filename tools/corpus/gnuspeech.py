"""GnuSpeech, articulatory speech synthesis, as a speech engine of the corpus.

GnuSpeech models a vocal tract and a glottis: a voice is a set of physical settings
(vocal-tract length, glottal pulse, pitch, breathiness), so settings between its shipped
voices make speakers no recording stands behind. The engine is the `@echogarden/gnuspeech-wasm`
package (GPL-3.0; WebAssembly, run by Node.js), installed by scripts/setup.sh through
scripts/install_gnuspeech.py into `.venv/share/wakefl-gnuspeech/node_modules`
(`WAKEFL_GNUSPEECH_MODULES` names another folder). tools/corpus/gnuspeech_say.mjs says one
text per call.

A `Voice` of this engine: `voice` one of `GNUSPEECH_VOICES`; `variant` "vtl<mm>" sets the
vocal-tract length (e.g. "vtl158": 15.8 cm), "" keeps the voice's own; `rate` the tempo x100;
`pitch` the pitch offset in semitones (the control model's default is -4). The intonation's
random draws are seeded from the voice and the text, so a rendering is the same every time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np
import soundfile as sf

from wakefl.errors import AudioError, ConfigError


class Voice(Protocol):
    """What this engine reads of a voice (tools/corpus/speech_synthesis.py `Voice` has it):
    the engine's own module stays below the module that runs every engine."""

    @property
    def voice(self) -> str: ...

    @property
    def variant(self) -> str: ...

    @property
    def rate(self) -> int: ...

    @property
    def pitch(self) -> int: ...

    def describe(self) -> str: ...


# The package's voices, less `baby` (no words come out of it), with their vocal-tract
# lengths in cm (the package's data/en/voice_*.txt).
GNUSPEECH_TRACT_CM = {"male": 17.5, "female": 15.0, "large_child": 12.5, "small_child": 10.0}
GNUSPEECH_VOICES = tuple(GNUSPEECH_TRACT_CM)
# The `pretrain-gnuspeech` add-on's split: its training speakers are drawn around these
# voices, its unseen ones around small_child's, a tract shorter than any of theirs.
GNUSPEECH_TRAIN = ("male", "female", "large_child")
GNUSPEECH_UNSEEN = ("small_child",)
PACKAGE = "@echogarden/gnuspeech-wasm"
_SAY = Path(__file__).with_name("gnuspeech_say.mjs")
_TIMEOUT_S = 120.0


def modules_dir() -> Path:
    env = os.environ.get("WAKEFL_GNUSPEECH_MODULES")
    return Path(env) if env else Path(sys.prefix) / "share" / "wakefl-gnuspeech" / "node_modules"


@lru_cache(maxsize=1)
def gnuspeech_version() -> str:
    """The package's name and version; ConfigError (with what to run) where Node.js or the
    package is missing."""
    if shutil.which("node") is None:
        raise ConfigError("GnuSpeech needs Node.js (Debian package 'nodejs'; run scripts/setup.sh)")
    meta = modules_dir() / PACKAGE / "package.json"
    if not meta.is_file():
        raise ConfigError(
            f"GnuSpeech ({PACKAGE}) is not installed in {modules_dir()}; run scripts/setup.sh"
        )
    return f"{PACKAGE} {json.loads(meta.read_text())['version']}"


def tract_length_cm(voice: Voice) -> float | None:
    """The vocal-tract length a voice's variant sets (None: the voice's own)."""
    if not voice.variant:
        return None
    digits = voice.variant.removeprefix("vtl")
    if not voice.variant.startswith("vtl") or not digits.isdigit() or not 70 <= int(digits) <= 200:
        raise ConfigError(
            f"GnuSpeech variant {voice.variant!r}: expected 'vtl<mm>' with 70-200 mm, or ''"
        )
    return int(digits) / 10.0


def run_gnuspeech(voice: Voice, text: str) -> tuple[np.ndarray, int]:
    """(wave, sample rate) of `text` said by `voice`."""
    gnuspeech_version()
    if voice.voice not in GNUSPEECH_VOICES:
        raise ConfigError(
            f"unknown GnuSpeech voice {voice.voice!r}; choose one of {', '.join(GNUSPEECH_VOICES)}"
        )
    if not 50 <= voice.rate <= 200 or not -24 <= voice.pitch <= 24:
        raise ConfigError(
            f"GnuSpeech tempo x100 must be 50-200 and the pitch offset -24..24 semitones, "
            f"got {voice.rate} and {voice.pitch}"
        )
    seed = int.from_bytes(hashlib.sha256(f"{voice.describe()}|{text}".encode()).digest()[:4], "big")
    with tempfile.TemporaryDirectory(prefix="wakefl-gnuspeech-") as tmp:
        out = Path(tmp) / "u.wav"
        args = {
            "text": text, "voice": voice.voice, "tempo": voice.rate / 100.0,
            "pitch_offset": float(voice.pitch), "vocal_tract_length": tract_length_cm(voice),
            "seed": seed, "out": str(out),
        }  # fmt: skip
        env = {**os.environ, "WAKEFL_GNUSPEECH_MODULES": str(modules_dir())}
        try:
            res = subprocess.run(
                ["node", str(_SAY), json.dumps(args)],
                capture_output=True, check=False, env=env, timeout=_TIMEOUT_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise AudioError(
                f"GnuSpeech took over {_TIMEOUT_S:.0f} s for {voice.describe()}"
            ) from None
        if res.returncode != 0 or not out.is_file() or out.stat().st_size <= 44:
            detail = res.stderr.decode(errors="replace")[-300:]
            raise AudioError(f"GnuSpeech failed for {voice.describe()}: {detail}")
        wave, sr = sf.read(str(out), dtype="float32")
    return wave, sr
