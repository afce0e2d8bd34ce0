"""The int8 calibration set shipped beside the pretrained models: 1.5 s windows of speech
from several engines and voices, through the rooms and microphones of device types A-E,
some under playback or alarm, plus windows of background alone. `wakefl model export
--int8` calibrates on its calibration windows unless given recordings, and checks the
int8 model against fp32 on its held-out windows, whose voices calibration never hears.

Remade (the same audio, given the same speech engines: another machine's engines may round
some samples a few 12-bit steps apart) by

    .venv/bin/python -m wakefl.tools.corpus.calibration_set

which writes models/kws_cnn/pretrained/int8-calibration.flac (12-bit samples, the windows
one after another) and int8-calibration.json (what each window holds)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from wakefl.models.kws_cnn.pretrained import PRETRAINED_DIR
from wakefl.models.kws_cnn.quantize import CALIBRATION_AUDIO, CALIBRATION_INDEX
from wakefl.sdk.manifest import CLIP_SAMPLES, SAMPLE_RATE
from wakefl.tools.acoustics.background_sounds import ambient_noise, background_for_state
from wakefl.tools.acoustics.device_acoustics import (
    DEVICE_PROFILES,
    capture,
    reverberate,
    scale_to,
)
from wakefl.tools.acoustics.room_impulse import exponential_rir
from wakefl.tools.corpus.rendering import place_in_window
from wakefl.tools.corpus.speech_synthesis import Voice, synthesize

SEED = 50
# Calibration hears these voices; the held-out check hears others (other flite and espeak-ng
# speakers, festival's HTS voice), so that it measures what calibration did not see.
CALIBRATION_VOICES = (
    Voice("espeak-ng", "en-us", "", 150, 50),
    Voice("espeak-ng", "en-gb", "f3", 175, 70),
    Voice("espeak-ng", "en-gb-scotland", "m3", 135, 30),
    Voice("flite", "slt", "", 100, 170),
    Voice("flite", "kal16", "", 110, 100),
    Voice("festival", "kal_diphone", "", 100, 0),
    Voice("festival", "ked_diphone", "", 95, 0),
    Voice("pico", "en-US", "", 100, 100),
)
HELD_OUT_VOICES = (
    Voice("flite", "awb", "", 105, 110),
    Voice("espeak-ng", "en-029", "f2", 160, 60),
    Voice("festival", "cmu_us_slt_arctic_hts", "", 100, 0),
    Voice("pico", "en-GB", "", 95, 100),
)
OTHER_TEXTS = ("hey noah", "nova scotia", "turn on the lights", "what time is it")
STATES = ("normal", "normal", "playback", "alarm")
BACKGROUND_WINDOWS = 4
_SPEECH_LEVEL_DB = (-32.0, -20.0)


@dataclass(frozen=True)
class WindowRecipe:
    """One window of the set: who says what (nothing: background alone), heard by which
    device type in which state, and whether it calibrates or is held out."""

    voice: Voice | None
    text: str
    device_type: str
    state: str
    role: str  # "calibration" or "held_out"


def recipes() -> list[WindowRecipe]:
    """Every voice says the wake phrase and one other text, on device types in turn;
    background windows close the calibration part."""
    devices = tuple(DEVICE_PROFILES)
    out: list[WindowRecipe] = []
    for role, voices in (("calibration", CALIBRATION_VOICES), ("held_out", HELD_OUT_VOICES)):
        for i, voice in enumerate(voices):
            for j, text in enumerate(("hey nova", OTHER_TEXTS[i % len(OTHER_TEXTS)])):
                k = len(out)
                out.append(WindowRecipe(voice, text, devices[k % 5], STATES[(i + j) % 4], role))
        if role == "calibration":
            out += [
                WindowRecipe(None, "", devices[b], STATES[b % 4], role)
                for b in range(BACKGROUND_WINDOWS)
            ]
    return out


def render(recipe: WindowRecipe, rng: np.random.Generator) -> np.ndarray:
    """The window as the recipe's device records it (the corpus build's chain: room,
    ambient tone, the state's background, microphone, gain, clipping)."""
    prof = DEVICE_PROFILES[recipe.device_type]
    room = exponential_rir(rng, rng.uniform(*prof.rt60_s), rng.uniform(*prof.drr_db))
    ref_db = rng.uniform(*_SPEECH_LEVEL_DB)
    field = scale_to(
        ambient_noise(rng, CLIP_SAMPLES, prof.ambient_exponent), ref_db + prof.noise_floor_db
    )
    if recipe.voice is not None:
        content = "pos" if recipe.text == "hey nova" else "neg"
        dry = place_in_window(rng, synthesize(recipe.voice, recipe.text), content)
        field += scale_to(reverberate(dry, room), ref_db)
    background = background_for_state(rng, recipe.state, CLIP_SAMPLES)
    if background is not None:
        snr = rng.uniform(*prof.snr_db.get(recipe.state, (5.0, 15.0)))
        field += scale_to(reverberate(background, room), ref_db - snr)
    return capture(rng, prof, field)


def describe(recipe: WindowRecipe) -> dict[str, str]:
    return {
        "voice": "" if recipe.voice is None else recipe.voice.describe(),
        "text": recipe.text,
        "device_type": recipe.device_type,
        "state": recipe.state,
        "role": recipe.role,
    }


def write_calibration_set(folder: Path) -> tuple[Path, Path]:
    """Renders every window and writes the audio and its index into `folder`."""
    rng = np.random.default_rng(SEED)
    plan = recipes()
    waves = [render(r, rng) for r in plan]
    # 12-bit samples (a field device's converter resolution) in 16-bit FLAC: the unused
    # low bits cost nothing, which keeps the shipped file near 430 kB instead of 750 kB.
    codes = np.concatenate([np.round(np.clip(w, -1, 1) * 2047) for w in waves])
    pcm = (np.clip(codes, -2048, 2047) * 16).astype(np.int16)
    audio, index = folder / CALIBRATION_AUDIO, folder / CALIBRATION_INDEX
    sf.write(str(audio), pcm, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
    info = {
        "made_by": "python -m wakefl.tools.corpus.calibration_set",
        "sample_rate": SAMPLE_RATE,
        "window_samples": CLIP_SAMPLES,
        "windows": [describe(r) for r in plan],
    }
    index.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    return audio, index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out", type=Path, default=PRETRAINED_DIR, help="(default: the shipped models' folder)"
    )
    args = ap.parse_args()
    audio, index = write_calibration_set(args.out)
    print(f"wrote {audio} ({audio.stat().st_size / 1e3:.0f} kB) and {index}")


if __name__ == "__main__":
    main()
