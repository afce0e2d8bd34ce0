"""Where do a model's misses come from? Held-out speakers say the wake phrase (alone, or
inside a sentence said in one breath) in held-out rooms, under each probe condition
(tools/probes/context_conditions.py); the streaming detector's rule (hop 0.1 s, 3-window
smoothing) scores each recording, and a recording counts as detected when it fires.
Prints the detection rate per condition and broken down by background kind, active-speech
ratio, placement (over the phrase or only outside it), AGC and noise suppression on or
off, RT60, distance, and carrier sentences against isolated phrases.

    python -m wakefl.tools.probes.context_probe --model full=pretrained:full \\
        --model v2=run/best.safetensors [--speakers 16] [--fa-streams corpus/manifest.csv] \\
        [--json probe.json]

Each model runs at the threshold given after its weights (`LABEL=WEIGHTS@0.97`), else at
its card's threshold, or with `--fa-streams` at the lowest threshold
that gives at most `--fa-per-hour` false accepts per hour on that manifest's held-out
(test) streams, scored with the same rule, so models are compared at the same FA/h."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.recorded_paths import recorded_path
from wakefl.tools.probes.context_conditions import (
    CARRIERS,
    Condition,
    held_out_rooms,
    probe_conditions,
    render,
)

PHRASE = "hey nova"
MAX_SPEAKERS = 60  # a probe of 60 speakers is 2,280 recordings of 3.5 s
RT60_BINS = (
    (0.0, 0.45, "RT60 < 0.45 s"),
    (0.45, 0.7, "RT60 0.45-0.7 s"),
    (0.7, 9.0, "RT60 > 0.7 s"),
)
DIST_BINS = ((0.0, 1.5, "< 1.5 m"), (1.5, 2.5, "1.5-2.5 m"), (2.5, 99.0, "> 2.5 m"))


@dataclass(frozen=True)
class Recording:
    speaker: str
    condition: Condition
    rt60_s: float
    distance_m: float
    wave: np.ndarray


def probe_recordings(
    speakers: int, seed: int, profile: str = "pretrain", phrase: str = PHRASE
) -> list[Recording]:
    """Every (speaker, condition) recording: `speakers` held-out (test-split) speakers of
    the corpus recipe `profile` with `seed`, each in a held-out room of its own, saying
    `phrase` (alone, and in the carrier sentences in its place)."""
    from wakefl.tools.corpus.plan import OTHER_SPEECH, PROFILES
    from wakefl.tools.corpus.speakers import make_pretrain_speakers
    from wakefl.tools.corpus.speech_synthesis import synthesize

    if profile not in PROFILES:
        raise ConfigError(f"no corpus profile {profile!r} to draw the probe's speakers from")
    pool = [s for s in make_pretrain_speakers(seed, PROFILES[profile], phrase) if s.split == "test"]
    if len(pool) < speakers:
        raise ConfigError(
            f"the probe asks for {speakers} held-out speakers; {profile} with seed {seed} "
            f"has {len(pool)}"
        )
    rng = np.random.default_rng([seed, 6061])
    order = rng.permutation(len(pool))
    chosen = [pool[i] for i in order[:speakers]]
    others = [pool[i] for i in order[speakers : speakers + 6]] or chosen
    babble_speech = [synthesize(s.voice, t) for s in others for t in OTHER_SPEECH[:3]]
    rooms = held_out_rooms(seed, len(chosen))
    out = []
    for k, (spk, room) in enumerate(zip(chosen, rooms, strict=True)):
        said = synthesize(spk.voice, phrase)
        carrier = synthesize(spk.voice, CARRIERS[k % len(CARRIERS)].replace(PHRASE, phrase))
        for c, cond in enumerate(probe_conditions()):
            r = np.random.default_rng([seed, 6062, k, c])
            wave = render(carrier if cond.carrier else said, room, cond, r, babble_speech)
            out.append(Recording(spk.speaker_id, cond, room.rt60_s, room.distance_m, wave))
    return out


def recording_scores(scorer: Any, recordings: list[Recording]) -> np.ndarray:
    """The highest smoothed posterior of each recording under the detector's rule."""
    from wakefl.edge_runtime.detection_rule import (
        DEFAULT_HOP_S,
        DEFAULT_SMOOTHING,
        hop_samples,
        smoothed,
        stream_windows,
    )
    from wakefl.tools.evaluation.model_scoring import score_windows

    hop = hop_samples(DEFAULT_HOP_S, 16000)
    per = [stream_windows(r.wave, scorer.window_samples, hop) for r in recordings]
    raw = score_windows(scorer, np.concatenate(per), progress=False)
    out, at = np.empty(len(recordings)), 0
    for i, w in enumerate(per):
        out[i] = smoothed(raw[at : at + len(w)], DEFAULT_SMOOTHING).max()
        at += len(w)
    return out


def stream_threshold(scorer: Any, manifest: Path, fa_per_hour: float) -> tuple[float, float]:
    """The lowest threshold with at most `fa_per_hour` events per hour on `manifest`'s test
    streams, and their hours."""
    from wakefl.edge_runtime import load_audio
    from wakefl.edge_runtime.detection_rule import (
        DEFAULT_HOP_S,
        DEFAULT_REFRACTORY_S,
        DEFAULT_SMOOTHING,
        hop_samples,
        refractory_hops,
        smoothed,
        stream_windows,
    )
    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.evaluation.model_scoring import score_windows
    from wakefl.tools.training.validation import threshold_for_fa

    rows = [r for r in read_manifest(manifest) if r.kind == "stream" and r.split == "test"]
    if not rows:
        raise ConfigError(f"--fa-streams {manifest}: no test streams")
    hop = hop_samples(DEFAULT_HOP_S, 16000)
    scores, seconds = [], 0.0
    for row in rows:
        wave = load_audio(row.resolve(manifest), 16000)
        seconds += wave.size / 16000
        raw = score_windows(
            scorer, stream_windows(wave, scorer.window_samples, hop), 256, progress=False
        )
        scores.append(smoothed(raw, DEFAULT_SMOOTHING))
    hours = seconds / 3600
    refractory = refractory_hops(DEFAULT_REFRACTORY_S, DEFAULT_HOP_S, 16000)
    return threshold_for_fa(scores, hours, fa_per_hour, refractory), hours


def breakdown(recordings: list[Recording], detected: np.ndarray) -> dict[str, dict[str, float]]:
    """Detection rates per condition and per group of conditions."""
    groups: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for r, hit in zip(recordings, detected, strict=True):
        c = r.condition
        groups["condition"][c.name].append(bool(hit))
        groups["background"][c.kind].append(bool(hit))
        if c.snr_db is not None:
            groups["ratio (dB)"][f"{c.snr_db:g}"].append(bool(hit))
            groups["placement"][c.placement].append(bool(hit))
        groups["AGC"]["on" if c.agc else "off"].append(bool(hit))
        groups["noise suppression"]["on" if c.suppress else "off"].append(bool(hit))
        groups["utterance"]["carrier sentence" if c.carrier else "isolated phrase"].append(
            bool(hit)
        )
        groups["RT60"][next(n for lo, hi, n in RT60_BINS if lo <= r.rt60_s < hi)].append(bool(hit))
        groups["distance"][next(n for lo, hi, n in DIST_BINS if lo <= r.distance_m < hi)].append(
            bool(hit)
        )
    return {g: {k: float(np.mean(v)) for k, v in rows.items()} for g, rows in groups.items()}


def miss_breakdown(
    recordings: list[Recording], peaks: np.ndarray, thresholds: dict[str, float]
) -> dict[str, dict[str, dict[str, float]]]:
    """FRR (the share of recordings not detected) per group of conditions at each named
    threshold: `peaks` are the recordings' highest smoothed posteriors."""
    return {
        name: {
            group: {key: 1.0 - rate for key, rate in rates.items()}
            for group, rates in breakdown(recordings, peaks >= t).items()
        }
        for name, t in thresholds.items()
    }


def model_arg(text: str) -> tuple[str, tuple[Path, float | None]]:
    """LABEL=WEIGHTS or LABEL=pretrained:NAME, with @THRESHOLD to score at that threshold."""
    label, sep, where = text.partition("=")
    if not sep or not label:
        raise ConfigError(f"--model takes LABEL=WEIGHTS[@T] or LABEL=pretrained:NAME, got {text!r}")
    where, at, given = where.partition("@")
    threshold = None
    if at:
        try:
            threshold = float(given)
        except ValueError:
            threshold = float("nan")
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"--model {label}: threshold {given!r} is not in [0, 1]")
    if where.startswith("pretrained:"):
        from wakefl.models.kws_cnn.pretrained import pretrained_path

        return label, (pretrained_path(where.split(":", 1)[1]), threshold)
    path = Path(where)
    if not path.is_file():
        raise ConfigError(f"--model {label}: no such weights file {path}")
    return label, (path, threshold)


def thresholded_models(specs: list[str]) -> dict[str, tuple[Path, float]]:
    """--model LABEL=WEIGHTS[@T] arguments as {label: (weights, threshold)}, a threshold not
    given read off the card beside the weights: every one resolved before any audio, so a
    missing card fails at once."""
    models = dict(model_arg(m) for m in specs)
    return {
        label: (path, given if given is not None else card_threshold(path))
        for label, (path, given) in models.items()
    }


def card_threshold(path: Path) -> float:
    from wakefl.models.kws_cnn.pretrained import card_beside

    card = card_beside(path)
    if card is None or "threshold" not in card:
        raise ConfigError(
            f"{path}: no card with a threshold beside it; give one as LABEL=WEIGHTS@T (or --fa-streams)"
        )
    return float(card["threshold"])


def _table(results: dict[str, Any], group: str) -> list[str]:
    labels = list(results)
    keys = list(next(iter(results.values()))["breakdown"][group])
    lines = [f"| {group} | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for key in keys:
        cells = [f"{results[m]['breakdown'][group][key]:.0%}" for m in labels]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", action="append", required=True, metavar="LABEL=WEIGHTS[@T]")
    ap.add_argument("--speakers", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fa-streams", type=Path, default=None, metavar="MANIFEST")
    ap.add_argument("--fa-per-hour", type=float, default=0.5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not 1 <= args.speakers <= MAX_SPEAKERS:
        raise ConfigError(f"--speakers must be 1-{MAX_SPEAKERS}, got {args.speakers}")
    if not 0.0 <= args.fa_per_hour <= 100.0:
        raise ConfigError(f"--fa-per-hour must be in [0, 100], got {args.fa_per_hour}")
    models = dict(model_arg(m) for m in args.model)
    from wakefl.tools.evaluation.model_scoring import TorchScorer

    recordings = probe_recordings(args.speakers, args.seed)
    results: dict[str, Any] = {}
    for label, (path, given) in models.items():
        scorer = TorchScorer(path)
        if given is not None:
            thr, source = given, "given"
        elif args.fa_streams is not None:
            thr, hours = stream_threshold(scorer, args.fa_streams, args.fa_per_hour)
            source = f"<= {args.fa_per_hour:g} FA/h on {hours:.2f} h of held-out streams"
        else:
            thr, source = card_threshold(path), "its card"
        peaks = recording_scores(scorer, recordings)
        detected = peaks >= thr
        results[label] = {
            "weights": recorded_path(path),
            "threshold": thr,
            "threshold_source": source,
            "breakdown": breakdown(recordings, detected),
        }
    print(f"context probe: {args.speakers} held-out speakers, {len(probe_conditions())} conditions")
    for label, r in results.items():
        print(f"- {label}: threshold {r['threshold']:.4f} ({r['threshold_source']})")
    for group in next(iter(results.values()))["breakdown"]:
        print()
        print("\n".join(_table(results, group)))
    if args.json is not None:
        payload = {
            "speakers": args.speakers,
            "seed": args.seed,
            "conditions": [asdict(c) for c in probe_conditions()],
            "models": results,
        }
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    from wakefl.tools.script_errors import run_script

    raise SystemExit(run_script(main, __file__))
