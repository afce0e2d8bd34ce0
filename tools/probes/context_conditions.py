"""The recordings of the context probe (tools/probes/context_probe.py): held-out speakers
saying the wake phrase, alone or inside a sentence said in one breath, in image-source rooms
of the held-out acoustic simulation, under one named condition each: a background kind
(quiet, babble, a single talker, television, music, fan) at an active-speech ratio, placed
over the whole recording or only outside the talker's speech, with or without a device's
AGC (up to 30 dB of gain) and noise suppression.

Every recording is a pure function of (seed, speaker, condition): the same conditions
for every model scored, so two models' figures differ only by the models."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from wakefl.tools.acoustics.field_acoustics import (
    HELD_OUT_ROOMS,
    active_rms,
    agc,
    babble,
    background,
    image_source_room,
    reverberate,
    spectral_gate,
    to_level,
)

SAMPLE_RATE = 16000
RECORDING_S = 3.5
LEAD_S = 1.0  # the talker starts after this much room tone
SPEECH_LEVEL_DB = -28.0  # the talker's active level before any device gain
ROOM_TONE_DB = -70.0
KINDS = ("quiet", "babble", "talker", "tv", "music", "fan")
# The sentences said in one breath with the phrase (the issue reports of a new user).
CARRIERS = (
    "good morning, hey nova, what is the weather like today",
    "hey nova turn on the lights",
    "okay so hey nova play some music",
)
MARGIN = int(0.05 * SAMPLE_RATE)


@dataclass(frozen=True)
class Condition:
    """One probe condition. `placement`: "over" (the whole recording) or "outside" (only
    where the talker is silent, 50 ms clear of their speech)."""

    name: str
    kind: str = "quiet"
    snr_db: float | None = None
    placement: str = "over"
    agc: bool = False
    suppress: bool = False
    carrier: bool = False


def probe_conditions() -> tuple[Condition, ...]:
    """The fixed grid: quiet, AGC and suppression in quiet, every speech and noise kind at
    10, 5 and 0 dB over the phrase and outside it, a field device's chain (suppression and
    AGC) over fan noise, and the carrier sentences in quiet and under babble."""
    out = [
        Condition("quiet"),
        Condition("quiet, AGC 30 dB", agc=True),
        Condition("quiet, noise suppression", suppress=True),
    ]
    for kind in KINDS[1:]:
        for snr in (10.0, 5.0, 0.0):
            out.append(Condition(f"{kind} {snr:g} dB over", kind, snr))
            out.append(Condition(f"{kind} {snr:g} dB outside", kind, snr, "outside"))
    out += [
        Condition("fan 5 dB, suppression + AGC", "fan", 5.0, agc=True, suppress=True),
        Condition("AGC, babble 10 dB outside", "babble", 10.0, "outside", agc=True),
        Condition("carrier, quiet", carrier=True),
        Condition("carrier, AGC", agc=True, carrier=True),
        Condition("carrier, babble 10 dB outside", "babble", 10.0, "outside", carrier=True),
    ]
    return tuple(out)


@dataclass(frozen=True)
class ProbeRoom:
    rir: np.ndarray
    noise_rir: np.ndarray
    rt60_s: float
    distance_m: float


def held_out_rooms(seed: int, n: int) -> list[ProbeRoom]:
    """`n` rooms of the held-out simulation's generator family (RT60 0.2-1.0 s, 0.5-4 m),
    drawn under a key of their own, so no training room is among them."""
    rng = np.random.default_rng([seed, HELD_OUT_ROOMS, 511])
    rooms = []
    for _ in range(n):
        r = image_source_room(rng, (0.2, 1.0), (0.5, 4.0))
        rooms.append(ProbeRoom(r.speech_rir, r.noise_rir, r.rt60_s, r.distance_m))
    return rooms


def _speech_mask(x: np.ndarray, start: int, end: int) -> np.ndarray:
    """1 outside [start - margin, end + margin), ramped over 10 ms at its edges."""
    mask = np.ones(x.size)
    mask[max(0, start - MARGIN) : min(x.size, end + MARGIN)] = 0.0
    ramp = np.convolve(mask, np.ones(160) / 160, mode="same")
    return np.clip(ramp, 0.0, 1.0)


def _background(
    x: np.ndarray,
    room: ProbeRoom,
    cond: Condition,
    rng: np.random.Generator,
    babble_speech: Sequence[np.ndarray],
    span: tuple[int, int],
) -> np.ndarray:
    """The condition's background from the noise source, at `cond.snr_db` below the
    talker's active level (both measured where they sound), over or outside `span`."""
    assert cond.snr_db is not None
    if cond.kind == "talker":  # one other person talking
        bg = babble(rng, x.size, babble_speech, talkers=(1, 1))
    else:
        bg = background(rng, cond.kind, x.size, babble_speech)
    bg = reverberate(bg, room.noise_rir)
    if cond.placement == "outside":
        bg = bg * _speech_mask(x, *span)
    level = active_rms(bg)
    if level <= 0.0:
        return np.zeros_like(x)
    return bg * (active_rms(x[span[0] : span[1]]) / level / 10.0 ** (cond.snr_db / 20.0))


def render(
    utterance: np.ndarray,
    room: ProbeRoom,
    cond: Condition,
    rng: np.random.Generator,
    babble_speech: Sequence[np.ndarray],
) -> np.ndarray:
    """One probe recording (RECORDING_S, float32): `utterance` (dry, 16 kHz) from the
    talker's position after LEAD_S of room tone, the condition's background from the
    noise source's, then the device stages the condition names."""
    n = int(RECORDING_S * SAMPLE_RATE)
    lead = int(LEAD_S * SAMPLE_RATE)
    dry = np.zeros(n)
    speech = to_level(np.asarray(utterance, dtype=np.float64), SPEECH_LEVEL_DB, active=True)
    speech = speech[: n - lead]
    dry[lead : lead + speech.size] = speech
    x = reverberate(dry, room.rir)
    x += rng.standard_normal(n) * 10.0 ** (ROOM_TONE_DB / 20.0)
    if cond.kind != "quiet" and cond.snr_db is not None:
        x = x + _background(x, room, cond, rng, babble_speech, (lead, lead + speech.size))
    if cond.suppress:
        x = spectral_gate(x, max_reduction_db=18.0)
    if cond.agc:
        x = agc(x, max_gain_db=30.0)
    return np.clip(x, -1.0, 1.0).astype(np.float32)
