"""How a model scores one engine's wake phrase when its timing changes.

`python -m wakefl.tools.evaluation.probe_timing --weights W [--voices pico:en-US,espeak-ng:en-us]`

For each voice, the phrase is synthesized dry (no room, no device), spoken with and without
a comma between its words, and then re-timed: the first word stretched or compressed by a
factor, the rest left as it was, or the reverse (tools/corpus/word_timing.py: librosa's phase
vocoder, which keeps the pitch); the last column cuts out the pause after the first word.
Each version is centred in the model's window over faint noise and scored. The table shows
which timings the model accepts. It is a probe, not a benchmark: one utterance per voice,
no device acoustics.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from wakefl.tools.corpus.word_timing import phrase_split, retime, run_together

DEFAULT_VOICES = (
    "espeak-ng:en-us:160:50",
    "flite:slt:100:170",
    "festival:cmu_us_slt_arctic_hts:100:0",
    "pico:en-GB:100:100",
    "pico:en-US:100:100",
)
# (first word, rest): 1 = as synthesized.
TIMINGS = ((1.0, 1.0), (0.6, 1.0), (1.5, 1.0), (1.0, 0.7), (1.0, 1.4))
LEVEL_RMS = 0.03  # the speech's level in the window
NOISE_RMS = 3e-4  # the faint noise under it: no real capture is digital silence


def parse_voice(text: str) -> Any:
    """`engine:voice[:rate:pitch]` (the Voice fields; variant empty)."""
    from wakefl.errors import ConfigError
    from wakefl.tools.corpus.speech_synthesis import Voice

    parts = text.split(":")
    if len(parts) not in (2, 4):
        raise ConfigError(f"voice {text!r}: expected engine:voice[:rate:pitch]")
    rate, pitch = (int(parts[2]), int(parts[3])) if len(parts) == 4 else (100, 100)
    return Voice(parts[0], parts[1], "", rate, pitch)


def in_window(speech: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    out = np.zeros(n)
    speech = speech[:n]
    start = (n - speech.size) // 2
    out[start : start + speech.size] = speech
    out *= LEVEL_RMS / max(float(np.sqrt((out**2).mean())), 1e-12)
    return (out + rng.normal(0.0, NOISE_RMS, n)).astype(np.float32)


def probe(scorer: Any, voices: list[Any], phrase: str) -> list[dict[str, Any]]:
    from wakefl.tools.corpus.plan import phrase_variants
    from wakefl.tools.corpus.speech_synthesis import synthesize

    rng = np.random.default_rng(0)
    # The corpus's own spellings, run together and with a comma; "!" changes no timing.
    spellings = [p for p in phrase_variants(phrase) if not p.endswith("!")]
    rows = []
    for v in voices:
        for text in spellings:
            wave = synthesize(v, text)
            split = phrase_split(wave, text)
            versions = [retime(wave, split, a, b) for a, b in TIMINGS]
            versions.append(run_together(wave, text, 1.0))
            windows = np.stack([in_window(x, scorer.window_samples, rng) for x in versions])
            rows.append(
                {"voice": v.describe(), "text": text, "scores": scorer.score(windows).tolist()}
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    from wakefl.tools.evaluation.model_scoring import load_scorer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", required=True, help="model weights (.safetensors or .onnx)")
    ap.add_argument(
        "--voices", default=",".join(DEFAULT_VOICES), help="engine:voice[:rate:pitch],..."
    )
    ap.add_argument("--phrase", default="hey nova")
    a = ap.parse_args(argv)
    rows = probe(load_scorer(a.weights), [parse_voice(t) for t in a.voices.split(",")], a.phrase)
    head = " ".join(f"{f'{x:g}/{y:g}':>8}" for x, y in TIMINGS)
    print(f"{'voice':<44} {'text':<10} {head} {'no pause':>8}   (first word / rest)")
    for r in rows:
        print(f"{r['voice']:<44} {r['text']:<10} " + " ".join(f"{s:8.3f}" for s in r["scores"]))
    return 0


if __name__ == "__main__":
    from wakefl.tools.script_errors import run_script

    raise SystemExit(run_script(main, __file__))
