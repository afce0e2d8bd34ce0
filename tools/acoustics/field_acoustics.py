"""A second acoustic simulation, written apart from tools/acoustics/device_acoustics.py, so that
checkpoints and thresholds can be chosen, and detectors judged, on acoustics that training
never used: image-source rooms (pyroomacoustics) with RT60 0.3-1.0 s and 1-5 m between
talker and microphone, automatic gain control, spectral-gating noise suppression, an 8 kHz
mu-law link with packet loss, clipping and low bit depth, under TV, music and babble down to
-3 dB SNR.

Nothing here is shared with the training simulator: its rooms are geometric (image
sources, not a statistical tail), its music is plucked strings (not chords of harmonic
notes), its noises and alarms are its own, and each field device runs a front end (AGC,
noise suppression, codec) that the training devices A-E do not have. Every stage is a pure
function of its input and a numpy generator, so a seed gives the same audio every time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.ndimage import minimum_filter1d, uniform_filter, uniform_filter1d
from scipy.signal import butter, fftconvolve, istft, lfilter, resample_poly, sosfilt, stft

SAMPLE_RATE = 16000
LINK_RATE = 8000  # the narrowband link's sample rate
PACKET_S = 0.02  # one codec packet: 20 ms, as in Bluetooth HFP and VoIP
MU = 255.0  # G.711 mu-law
NOISE_KINDS = ("babble", "fan", "tv", "music", "beeper")
# Which manifest state each background stands for: a device playing media, an alarm ringing,
# or ordinary life around the device.
STATE_NOISES: dict[str, tuple[str, ...]] = {
    "normal": ("babble", "fan"),
    "playback": ("tv", "music"),
    "alarm": ("beeper",),
}
_MAX_ORDER = 50  # image-source order cap: ~1 s per room, and T20 still follows the target


def active_rms(x: np.ndarray, frame: int = 320, floor_db: float = 35.0) -> float:
    """RMS over the frames within `floor_db` of the loudest one: a talker's level while
    talking, which the pauses of a clip or a stream do not dilute."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size // frame
    if n == 0:
        return float(np.sqrt(np.mean(x**2))) if x.size else 0.0
    power = np.mean(x[: n * frame].reshape(n, frame) ** 2, axis=1)
    top = float(power.max())
    if top <= 0.0:
        return 0.0
    return float(np.sqrt(np.mean(power[power >= top * 10.0 ** (-floor_db / 10.0)])))


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)) + 1e-20))


def to_level(x: np.ndarray, level_db: float, active: bool = False) -> np.ndarray:
    """`x` scaled to `level_db` dBFS, of its RMS or (active) its active-speech RMS."""
    r = active_rms(x) if active else _rms(x)
    return x * (10.0 ** (level_db / 20.0) / r) if r > 0 else x


# --- rooms -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageSourceRoom:
    """A shoebox room simulated with image sources: the talker's and a noise source's
    responses at one microphone."""

    dims_m: tuple[float, float, float]
    rt60_s: float  # the target the wall absorption was set for (Sabine)
    distance_m: float  # talker to microphone
    speech_rir: np.ndarray
    noise_rir: np.ndarray


def _positions(
    rng: np.random.Generator, dims: np.ndarray, distance: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Microphone near a wall (a device on a shelf), talker `distance` away into the room
    (less where the room is too narrow), noise source elsewhere at least 1 m away."""
    mic = np.array([rng.uniform(0.3, 0.8), rng.uniform(0.3, 0.7) * dims[1], rng.uniform(0.8, 1.5)])
    angle = rng.uniform(-1.0, 1.0)
    talker = mic + distance * np.array([np.cos(angle), np.sin(angle), 0.0])
    talker[2] = rng.uniform(1.1, 1.8)
    talker = np.clip(talker, 0.3, dims - 0.3)
    noise = mic.copy()
    for _ in range(100):
        noise = np.array([rng.uniform(0.3, d - 0.3) for d in dims])
        if np.linalg.norm(noise - mic) >= 1.0:
            break
    return mic, talker, noise


def _trim_lead(rir: np.ndarray, keep: int = 32) -> np.ndarray:
    """Drop the propagation delay before the direct sound, so speech keeps its timing."""
    start = max(0, int(np.argmax(np.abs(rir))) - keep)
    return rir[start:]


def image_source_room(
    rng: np.random.Generator,
    rt60_s: tuple[float, float] = (0.3, 1.0),
    distance_m: tuple[float, float] = (1.0, 5.0),
) -> ImageSourceRoom:
    """A random shoebox room: longer reverberation comes with a larger room, as in real
    homes, and the room is always long enough for the talker's distance."""
    import pyroomacoustics as pra

    rt60 = float(rng.uniform(*rt60_s))
    distance = float(rng.uniform(*distance_m))
    length = max(float(rng.uniform(4.0, 6.0)) + 4.0 * (rt60 - 0.3), distance + 1.5)
    dims = np.array([length, length * rng.uniform(0.6, 0.9), rng.uniform(2.5, 3.2)])
    absorption, order = pra.inverse_sabine(rt60, dims)
    room = pra.ShoeBox(
        dims,
        fs=SAMPLE_RATE,
        materials=pra.Material(absorption),
        max_order=min(order, _MAX_ORDER),
        air_absorption=True,
    )
    mic, talker, noise = _positions(rng, dims, distance)
    room.add_source(talker)
    room.add_source(noise)
    room.add_microphone(mic)
    room.compute_rir()
    speech = _trim_lead(np.asarray(room.rir[0][0], dtype=np.float64))
    noise_rir = _trim_lead(np.asarray(room.rir[0][1], dtype=np.float64))
    return ImageSourceRoom(
        (float(dims[0]), float(dims[1]), float(dims[2])),
        rt60,
        float(np.linalg.norm(talker - mic)),
        speech / np.max(np.abs(speech)),
        noise_rir / np.max(np.abs(noise_rir)),
    )


def reverberate(dry: np.ndarray, rir: np.ndarray) -> np.ndarray:
    """`dry` heard through `rir`, the same length and timing as `dry`."""
    return fftconvolve(dry, rir)[: dry.size]


# --- device front-end stages -------------------------------------------------------------


def band_limit(x: np.ndarray, low_hz: float, high_hz: float) -> np.ndarray:
    """A microphone and its enclosure: 2nd-order high-pass, 4th-order low-pass."""
    sos = np.concatenate(
        [
            butter(2, low_hz, btype="highpass", fs=SAMPLE_RATE, output="sos"),
            butter(4, high_hz, btype="lowpass", fs=SAMPLE_RATE, output="sos"),
        ]
    )
    return sosfilt(sos, x)


def agc(
    x: np.ndarray,
    target_db: float = -20.0,
    max_gain_db: float = 30.0,
    min_gain_db: float = -20.0,
    gate_db: float = -65.0,
    attack_s: float = 0.02,
    release_s: float = 0.6,
) -> np.ndarray:
    """Automatic gain control: a 10 ms level follower (fast attack, slow release) steers
    the gain toward `target_db` dBFS within [min_gain_db, max_gain_db]; below `gate_db` the
    gain holds (silence is not pumped up), and a limiter keeps the peaks under full scale."""
    frame = SAMPLE_RATE // 100
    n = -(-x.size // frame)
    padded = np.zeros(n * frame)
    padded[: x.size] = x
    level = 10.0 * np.log10(np.mean(padded.reshape(n, frame) ** 2, axis=1) + 1e-12)
    up, down = np.exp(-0.01 / attack_s), np.exp(-0.01 / release_s)
    env, gain = level[0], float(np.clip(target_db - level[0], min_gain_db, max_gain_db))
    gains = np.empty(n)
    for i, lv in enumerate(level):
        a = up if lv > env else down
        env = a * env + (1.0 - a) * lv
        if lv > gate_db:
            gain = float(np.clip(target_db - env, min_gain_db, max_gain_db))
        gains[i] = gain
    per_sample = np.interp(
        np.arange(x.size), np.arange(n) * frame + frame / 2, 10.0 ** (gains / 20.0)
    )
    return np.tanh(x * per_sample / 0.95) * 0.95  # the limiter: soft, never above 0.95


def spectral_gate(
    x: np.ndarray,
    max_reduction_db: float = 18.0,
    oversubtract: float = 2.0,
    window_s: float = 1.5,
) -> np.ndarray:
    """Noise suppression by spectral gating: each bin's noise floor is the minimum of its
    smoothed power over the last `window_s` (minimum statistics), and the bin is attenuated
    by up to `max_reduction_db` where its power is near that floor. Steady noise drops; the
    speech keeps its peaks and loses its quiet parts, with the musical-noise artefacts of
    real suppressors."""
    nper, hop = 512, 128
    if x.size < nper:
        return x.copy()
    _, _, spec = stft(x, fs=SAMPLE_RATE, nperseg=nper, noverlap=nper - hop, boundary="even")
    power = np.abs(spec) ** 2
    smooth = uniform_filter(power, size=(3, 9), mode="nearest")  # 3 bins x 72 ms
    span = max(3, int(window_s * SAMPLE_RATE / hop))
    # A trailing window: the floor at a frame uses only what came before it, as a causal
    # suppressor must. 2x compensates the minimum's bias below the mean noise power.
    floor = 2.0 * minimum_filter1d(
        smooth, size=span, axis=1, origin=(span - 1) // 2, mode="nearest"
    )
    gain = np.maximum(1.0 - oversubtract * floor / (smooth + 1e-20), 0.0) ** 0.5
    gain = np.maximum(gain, 10.0 ** (-max_reduction_db / 20.0))
    gain = uniform_filter1d(gain, size=3, axis=1, mode="nearest")
    _, out = istft(spec * gain, fs=SAMPLE_RATE, nperseg=nper, noverlap=nper - hop, boundary=True)
    return np.asarray(out[: x.size], dtype=np.float64)


def mulaw_encode(x: np.ndarray) -> np.ndarray:
    """8-bit G.711 mu-law codes (-128..127) of `x` in [-1, 1]."""
    y = np.sign(x) * np.log1p(MU * np.minimum(np.abs(x), 1.0)) / np.log1p(MU)
    return np.clip(np.round(y * 127.5 - 0.5), -128, 127).astype(np.int16)


def mulaw_decode(codes: np.ndarray) -> np.ndarray:
    y = (codes.astype(np.float64) + 0.5) / 127.5
    return np.sign(y) * np.expm1(np.abs(y) * np.log1p(MU)) / MU


def lost_packets(rng: np.random.Generator, n: int, loss: float, burst: float) -> np.ndarray:
    """Which of `n` packets are lost: a two-state (Gilbert) channel whose long-run loss rate
    is `loss` and where a lost packet is followed by another lost one with probability
    `burst`, as radio fades lose packets in runs."""
    if not 0.0 <= loss < 1.0 or not 0.0 <= burst < 1.0:
        raise ValueError(f"loss {loss} and burst {burst} must lie in [0, 1)")
    # Stationary loss = p / (p + 1 - burst), with p the good-to-lost probability.
    p = loss * (1.0 - burst) / (1.0 - loss) if loss > 0 else 0.0
    u = rng.random(n)
    out = np.zeros(n, dtype=bool)
    prev = False
    for i in range(n):
        prev = bool(u[i] < (burst if prev else p))
        out[i] = prev
    return out


def conceal(x: np.ndarray, lost: np.ndarray, packet: int, repeat: bool) -> np.ndarray:
    """`x` with its lost packets replaced: by silence, or (`repeat`) by the last received
    packet, halved at each further loss in a row (a simple packet-loss concealment)."""
    out = x.copy()
    last = np.zeros(packet)
    fade = 1.0
    for i, gone in enumerate(lost):
        seg = slice(i * packet, min((i + 1) * packet, x.size))
        width = seg.stop - seg.start
        if width <= 0:
            break
        if gone:
            fade *= 0.5
            out[seg] = last[:width] * fade if repeat else 0.0
        else:
            last = np.zeros(packet)
            last[:width] = x[seg]
            fade = 1.0
    return out


def mulaw_link(
    x: np.ndarray,
    rng: np.random.Generator,
    loss: float = 0.0,
    burst: float = 0.3,
    repeat: bool = True,
) -> np.ndarray:
    """A narrowband voice link (Bluetooth HFP, telephony): down to 8 kHz, 8-bit mu-law,
    20 ms packets lost at rate `loss` and concealed, and back to 16 kHz for the model. Nothing
    above 4 kHz survives."""
    narrow = resample_poly(x, LINK_RATE, SAMPLE_RATE)
    coded = mulaw_decode(mulaw_encode(narrow))
    packet = int(PACKET_S * LINK_RATE)
    lost = lost_packets(rng, -(-coded.size // packet), loss, burst)
    coded = conceal(coded, lost, packet, repeat)
    wide = resample_poly(coded, SAMPLE_RATE, LINK_RATE)
    out = np.zeros(x.size)
    out[: min(x.size, wide.size)] = wide[: x.size]
    return out


def hard_clip(x: np.ndarray, level: float) -> np.ndarray:
    """A converter driven past its full scale `level`."""
    return np.clip(x, -level, level)


def quantize(x: np.ndarray, bits: int) -> np.ndarray:
    """Samples of a `bits`-bit converter (full scale 1.0), without dither."""
    if not 2 <= bits <= 24:
        raise ValueError(f"bits must lie in [2, 24], got {bits}")
    steps = 2.0 ** (bits - 1)
    return np.clip(np.round(x * steps), -steps, steps - 1) / steps


# --- backgrounds ---------------------------------------------------------------------------


def _pluck(rng: np.random.Generator, f0: float, n: int) -> np.ndarray:
    """One Karplus-Strong plucked string: a noise burst in a damped comb filter."""
    period = max(2, int(round(SAMPLE_RATE / f0)))
    g = rng.uniform(0.990, 0.998)
    a = np.zeros(period + 2)
    a[0], a[period], a[period + 1] = 1.0, -g / 2.0, -g / 2.0
    excite = np.zeros(n)
    excite[: min(period, n)] = rng.uniform(-1.0, 1.0, min(period, n))
    return lfilter([1.0], a, excite)


def pluck_music(rng: np.random.Generator, n: int) -> np.ndarray:
    """Unit-RMS music: plucked-string melody and accompaniment on a pentatonic scale, a
    sine bass and hi-hat noise ticks."""
    out = np.zeros(n)
    beat = int(SAMPLE_RATE * 60.0 / rng.uniform(70.0, 160.0))
    root = rng.uniform(196.0, 330.0)
    scale = np.array([0, 2, 4, 7, 9, 12, 14, 16])
    note_len = min(n, int(1.2 * SAMPLE_RATE))
    t_bass = np.arange(2 * beat) / SAMPLE_RATE
    for k, start in enumerate(range(0, n, beat)):
        voices = 1 + int(rng.random() < 0.5)
        for _ in range(voices):
            f0 = root * 2.0 ** (int(rng.choice(scale)) / 12.0)
            seg = _pluck(rng, f0, note_len)[: n - start]
            out[start : start + seg.size] += rng.uniform(0.5, 1.0) * seg
        if k % 2 == 0:
            bass = np.sin(2 * np.pi * root / 4 * t_bass) * np.exp(-t_bass / 0.4)
            seg = bass[: n - start]
            out[start : start + seg.size] += 0.6 * seg
        tick = rng.standard_normal(400) * np.exp(-np.arange(400) / 60.0)
        tick = np.diff(tick, prepend=0.0)  # high-passed: a hi-hat, not a thump
        seg = tick[: n - start]
        out[start : start + seg.size] += 0.3 * seg
    return out / _rms(out)


def fan_noise(rng: np.random.Generator, n: int) -> np.ndarray:
    """Unit-RMS fan or extractor hood: low-passed broadband noise and the blades' tone."""
    cut = rng.uniform(800.0, 3000.0)
    x = sosfilt(butter(2, cut, fs=SAMPLE_RATE, output="sos"), rng.standard_normal(n))
    x /= _rms(x)
    t = np.arange(n) / SAMPLE_RATE
    blade = rng.uniform(90.0, 300.0)
    for h in (1, 2, 3):
        x += rng.uniform(0.1, 0.5) / h * np.sin(2 * np.pi * blade * h * t + rng.uniform(0, 6.3))
    return x / _rms(x)


def beeper(rng: np.random.Generator, n: int) -> np.ndarray:
    """Unit-RMS appliance beeps (oven, microwave, washer): square-ish tone in groups of
    2-4 beeps, repeated, with quiet between."""
    f = rng.uniform(1800.0, 4200.0)
    beep_s, gap_s = rng.uniform(0.08, 0.25), rng.uniform(0.06, 0.2)
    count = int(rng.integers(2, 5))
    cycle = int(SAMPLE_RATE * (count * (beep_s + gap_s) + rng.uniform(0.8, 3.0)))
    t = np.arange(n) / SAMPLE_RATE
    in_cycle = (np.arange(n) % cycle) / SAMPLE_RATE
    on = (in_cycle < count * (beep_s + gap_s)) & ((in_cycle % (beep_s + gap_s)) < beep_s)
    tone = np.tanh(3.0 * np.sin(2 * np.pi * f * t))
    x = tone * uniform_filter1d(on.astype(float), 48) + 1e-3 * rng.standard_normal(n)
    return x / _rms(x)


def _talker(rng: np.random.Generator, n: int, utterances: Sequence[np.ndarray]) -> np.ndarray:
    """One talker saying utterances back to back with short pauses, from a random start."""
    out = np.zeros(n)
    t = -int(rng.integers(0, SAMPLE_RATE))
    while t < n:
        u = to_level(np.asarray(utterances[int(rng.integers(len(utterances)))]), -26.0, True)
        lo, hi = max(t, 0), min(t + u.size, n)
        if hi > lo:
            out[lo:hi] += u[lo - t : hi - t]
        t += u.size + int(rng.uniform(0.1, 0.7) * SAMPLE_RATE)
    return out


def babble(
    rng: np.random.Generator,
    n: int,
    utterances: Sequence[np.ndarray],
    talkers: tuple[int, int] = (4, 8),
) -> np.ndarray:
    """Unit-RMS café babble: several talkers at once, each at its own level."""
    k = int(rng.integers(talkers[0], talkers[1] + 1))
    out = sum(
        (_talker(rng, n, utterances) * 10.0 ** (rng.uniform(-4.0, 4.0) / 20.0) for _ in range(k)),
        np.zeros(n),
    )
    return out / _rms(out)


def tv_sound(rng: np.random.Generator, n: int, utterances: Sequence[np.ndarray]) -> np.ndarray:
    """Unit-RMS television: one or two presenters, compressed as broadcasts are, over a
    music bed some of the time."""
    speech = _talker(rng, n, utterances)
    if rng.random() < 0.5:
        speech += 0.8 * _talker(rng, n, utterances)
    env = np.sqrt(uniform_filter1d(speech**2, 800) + 1e-8)
    speech = speech / env**0.5  # broadcast compression: quiet syllables come up
    out = speech / _rms(speech)
    if rng.random() < 0.6:
        out += 10.0 ** (rng.uniform(-18.0, -8.0) / 20.0) * pluck_music(rng, n)
    return out / _rms(out)


def background(
    rng: np.random.Generator, kind: str, n: int, utterances: Sequence[np.ndarray]
) -> np.ndarray:
    """Unit-RMS background of `kind` (NOISE_KINDS); talkers speak from `utterances`."""
    if kind in ("babble", "tv") and not utterances:
        raise ValueError(f"{kind} needs utterances to speak")
    if kind == "babble":
        return babble(rng, n, utterances)
    if kind == "tv":
        return tv_sound(rng, n, utterances)
    if kind == "music":
        return pluck_music(rng, n)
    if kind == "fan":
        return fan_noise(rng, n)
    if kind == "beeper":
        return beeper(rng, n)
    raise ValueError(f"unknown background {kind!r}; choose one of {', '.join(NOISE_KINDS)}")


# --- field devices -------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldDevice:
    """A device of the field simulation, reported under one of the device types A-E."""

    name: str
    device_type: str
    description: str
    rt60_s: tuple[float, float]
    distance_m: tuple[float, float]
    band_hz: tuple[float, float]
    level_db: tuple[float, float]  # active speech level at the converter before the front end
    snr_db: tuple[float, float]  # active speech to background at the microphone
    agc: bool = False
    noise_suppression: bool = False
    link_loss: tuple[float, float] | None = None  # mu-law link's packet loss, when it has one
    clip_level: float | None = None
    bits: int = 16


FIELD_DEVICES: dict[str, FieldDevice] = {
    d.device_type: d
    for d in (
        FieldDevice(
            "den-speaker", "A",
            "smart speaker on a shelf in a den: far talker, AGC and noise suppression",
            (0.4, 0.9), (2.0, 5.0), (80.0, 7500.0), (-45.0, -30.0), (-3.0, 12.0),
            agc=True, noise_suppression=True,
        ),
        FieldDevice(
            "cafe-phone", "B",
            "phone on a café table, talker across it: babble, AGC and noise suppression",
            (0.3, 0.6), (1.0, 2.0), (150.0, 7000.0), (-38.0, -24.0), (-3.0, 10.0),
            agc=True, noise_suppression=True,
        ),
        FieldDevice(
            "tv-mic", "C",
            "microphone in a television: its own sound loud in the room, AGC",
            (0.5, 1.0), (2.0, 5.0), (100.0, 6000.0), (-45.0, -30.0), (-3.0, 8.0),
            agc=True,
        ),
        FieldDevice(
            "bt-speakerphone", "D",
            "Bluetooth speakerphone: 8 kHz mu-law link with packet loss, AGC",
            (0.3, 0.6), (1.0, 2.5), (200.0, 7000.0), (-40.0, -26.0), (0.0, 15.0),
            agc=True, link_loss=(0.01, 0.08),
        ),
        FieldDevice(
            "kitchen-hub", "E",
            "kitchen display: tiled room, hot fixed gain that clips, 12-bit converter",
            (0.6, 1.0), (1.0, 4.0), (120.0, 7000.0), (-26.0, -14.0), (-3.0, 10.0),
            clip_level=0.25, bits=12,
        ),
    )
}  # fmt: skip


def front_end(
    rng: np.random.Generator, device: FieldDevice, at_mic: np.ndarray, level_db: float
) -> np.ndarray:
    """What `device` records of the sound `at_mic`: its band, its input level
    (`level_db`, the active level of the speech at the converter), then AGC, noise
    suppression, clipping, the link and the converter's bit depth, each where it has them."""
    x = band_limit(at_mic, *device.band_hz)
    x = x * 10.0 ** (level_db / 20.0)
    x = x + rng.standard_normal(x.size) * 10.0 ** (-80.0 / 20.0)  # converter self-noise
    if device.noise_suppression:
        x = spectral_gate(x, max_reduction_db=float(rng.uniform(10.0, 24.0)))
    if device.agc:
        x = agc(x, target_db=float(rng.uniform(-26.0, -16.0)))
    if device.clip_level is not None:
        x = hard_clip(x, device.clip_level)
    if device.link_loss is not None:
        x = mulaw_link(x, rng, float(rng.uniform(*device.link_loss)), float(rng.uniform(0.2, 0.5)))
    return quantize(np.clip(x, -1.0, 1.0), device.bits)


def field_capture(
    rng: np.random.Generator,
    device: FieldDevice,
    room: ImageSourceRoom,
    speech: np.ndarray | None,
    noise: np.ndarray | None,
) -> np.ndarray:
    """One recording by `device` in `room`: the talker's dry `speech` (None: no one
    talks) and the unit-RMS `noise` (None: only the room's own hiss), mixed at the
    microphone at a drawn SNR (to the speech's active level), through the front end."""
    if speech is None and noise is None:
        raise ValueError("a recording needs speech, noise or both")
    n = speech.size if speech is not None else noise.size if noise is not None else 0
    at_mic = np.zeros(n)
    if speech is not None:
        at_mic += to_level(reverberate(speech, room.speech_rir), 0.0, active=True)
    if noise is not None:
        snr = float(rng.uniform(*device.snr_db))
        at_mic += to_level(reverberate(noise, room.noise_rir), -snr)
    hiss = sosfilt(butter(1, 2000.0, fs=SAMPLE_RATE, output="sos"), rng.standard_normal(n))
    at_mic += to_level(hiss, -55.0)  # the room's own air noise, 55 dB under the talker
    if speech is None:
        at_mic = to_level(at_mic, 0.0)  # no talker: the noise is the scene's level
    return front_end(rng, device, at_mic, float(rng.uniform(*device.level_db)))


# --- training augmentation toward field conditions -----------------------------------------

# Generator keys: the held-out corpus draws its rooms from [seed, device, HELD_OUT_ROOMS, i],
# training from [seed, TRAINING_ROOMS]; two keys of different shape never share a stream.
HELD_OUT_ROOMS = 7101
TRAINING_ROOMS = 7202


def training_rooms(seed: int, n: int = 24) -> tuple[np.ndarray, ...]:
    """`n` image-source room responses (talker to microphone) for training augmentation,
    drawn apart from every held-out room of the field corpus (another generator key), over
    a wider range: RT60 0.2-1.0 s, 0.5-5 m. About a second each: make them once."""
    rng = np.random.default_rng([seed, TRAINING_ROOMS])
    return tuple(
        image_source_room(rng, (0.2, 1.0), (0.5, 5.0)).speech_rir.astype(np.float32)
        for _ in range(n)
    )


@dataclass(frozen=True)
class FieldAugmentSettings:
    """How often each field stage is applied to a training window, and its ranges."""

    rir_prob: float = 0.3
    agc_prob: float = 0.3
    suppress_prob: float = 0.15
    link_prob: float = 0.15
    link_loss: tuple[float, float] = (0.0, 0.06)
    clip_prob: float = 0.1
    clip_ratio: tuple[float, float] = (0.15, 0.6)  # clip level over the window's peak
    bits_prob: float = 0.1
    bits: tuple[int, int] = (8, 12)


DEFAULT_FIELD_AUGMENT = FieldAugmentSettings()


def field_augment(
    wave: np.ndarray,
    rng: np.random.Generator,
    rirs: Sequence[np.ndarray] = (),
    settings: FieldAugmentSettings = DEFAULT_FIELD_AUGMENT,
) -> np.ndarray:
    """One copy of `wave` (float, 16 kHz) through a random subset of the field stages, in a
    device's order: a room from `rirs` (training_rooms; none when empty), noise
    suppression, AGC, clipping, the narrowband link and a coarse converter. The same length,
    float32 in [-1, 1]; deterministic for a given generator."""
    s = settings
    x = np.asarray(wave, dtype=np.float64)
    level = _rms(x)
    if rirs and rng.random() < s.rir_prob:
        x = reverberate(x, np.asarray(rirs[int(rng.integers(len(rirs)))], dtype=np.float64))
        x *= level / _rms(x)
    if rng.random() < s.suppress_prob:
        x = spectral_gate(x, max_reduction_db=float(rng.uniform(10.0, 24.0)))
    if rng.random() < s.agc_prob:
        x = agc(x, target_db=float(rng.uniform(-30.0, -14.0)))
    if rng.random() < s.clip_prob:
        x = hard_clip(x, float(rng.uniform(*s.clip_ratio)) * float(np.max(np.abs(x)) + 1e-12))
    if rng.random() < s.link_prob:
        x = mulaw_link(x, rng, float(rng.uniform(*s.link_loss)), float(rng.uniform(0.2, 0.5)))
    x = np.clip(x, -1.0, 1.0)
    if rng.random() < s.bits_prob:
        x = quantize(x, int(rng.integers(s.bits[0], s.bits[1] + 1)))
    return x.astype(np.float32)
