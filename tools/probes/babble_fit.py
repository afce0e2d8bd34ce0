"""Does a model miss the phrase under other speech because it never fit that, or because
what it fit does not carry over? One window per wake-phrase clip of a corpus, as the
manifest has it (the training simulator's rooms and devices), scored clean and with babble
over the whole window at an active-speech ratio (tools/augmentation/context_speech.py):

- training's babble: talkers and babble cut from the corpus's own training negatives
  (tools/augmentation/speech_backgrounds.py, what `--context-speech` and
  `--speech-backgrounds` mix in);
- the context probe's babble: 4-8 of the held-out speakers' voices at once
  (field_acoustics.babble of their sentences, as tools/probes/context_conditions.py makes it);
- with `--kinds`, also training's babble cut from its everyday speech only, or from its
  near-rhymes of the phrase only: does what the babble says matter, or only that it is speech?
- with `--agc`, also each window through the field devices' AGC (up to 30 dB of gain, what
  `--field-augment` applies to a share of the training windows), as training applies it (to
  the window alone) and as the context probe's "quiet, AGC" recordings have it (after the
  probe's second of room tone, too quiet to pass the AGC's gate: the gain holds its maximum).

Training-split phrases under training's babble are what training saw: if they are missed
there, the model has not fit it. Test-split phrases under the probe's babble are what it
never saw. Each row: the share of windows at or above the model's threshold, and the median
score.

    python -m wakefl.tools.probes.babble_fit --corpus corpus-pretrain \\
        --model full=pretrained:full [--model leg=run/last.safetensors@0.99] \\
        [--clips 150] [--ratios 10 5 0] [--kinds training everyday near-rhyme probe] \\
        [--agc] [--json fit.json]

`--profile` and `--seed` name the corpus's recipe, whose held-out speakers speak the probe's
babble (the pretraining corpus's defaults)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.tools.probes.context_probe import thresholded_models

MAX_CLIPS = 2000  # per split: 2,000 windows at 7 ratios is a few minutes of `full`
BABBLE_VOICES = 6  # held-out speakers whose sentences make the probe's babble
# Babble kinds: training's from all the training negatives (what `--context-speech` mixes
# in), the context probe's, and training's from its everyday speech only or its near-rhymes
# only (what `--speech-source` chooses between: data.py narrow_to_speech_source). A kind's
# position seeds its draws: new kinds go last, so earlier fits reproduce.
KINDS = ("training", "probe", "everyday", "near-rhyme")
# The training negatives each of training's kinds cuts its talkers from (plan.clip_content).
NEGATIVE_CONTENTS = {"training": None, "everyday": ("other",), "near-rhyme": ("conf",)}
DEFAULT_KINDS = ("training", "probe")


def clip_windows(
    corpus: Path,
    split: str,
    label: int,
    count: int,
    n: int,
    draw: Sequence[int],
    contents: Sequence[str] | None = None,
) -> np.ndarray:
    """[count, n] windows of `split`'s clips with `label` (and, when given, one of
    `contents`: plan.clip_content), at most all of them, picked by a generator seeded with
    `draw` and decoded as every scorer decodes clips (model_scoring.load_clip_windows)."""
    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.corpus.plan import clip_content
    from wakefl.tools.evaluation.model_scoring import load_clip_windows

    rows = [
        r
        for r in read_manifest(corpus / "manifest.csv")
        if r.split == split and r.label == label and r.kind == "clip"
        if contents is None or clip_content(r.path) in contents
    ]
    if not rows:
        what = "wake-phrase" if label == 1 else "negative"
        what += "" if contents is None else f" ({'/'.join(contents)})"
        raise ConfigError(f"{corpus}: no {what} clips in its {split} split")
    pick = np.random.default_rng(list(draw)).choice(len(rows), min(count, len(rows)), replace=False)
    return load_clip_windows([rows[i] for i in pick], corpus, 16000, n, progress=False)


def probe_babble_speech(profile: str, seed: int, phrase: str) -> list[np.ndarray]:
    """Sentences of the recipe's held-out speakers, dry: the probe's babble source."""
    from wakefl.tools.corpus.plan import OTHER_SPEECH, PROFILES
    from wakefl.tools.corpus.speakers import make_pretrain_speakers
    from wakefl.tools.corpus.speech_synthesis import synthesize

    if profile not in PROFILES:
        raise ConfigError(f"no corpus profile {profile!r}")
    pool = [s for s in make_pretrain_speakers(seed, PROFILES[profile], phrase) if s.split == "test"]
    if not pool:
        raise ConfigError(f"{profile} with seed {seed} has no held-out speakers")
    return [synthesize(s.voice, t) for s in pool[:BABBLE_VOICES] for t in OTHER_SPEECH[:3]]


def under_babble(
    windows: np.ndarray, kind: str, snr_db: float, sources: dict[str, Any], seed: int
) -> np.ndarray:
    """`windows` with babble of `kind` over the whole window at `snr_db` below the phrase's
    active speech; the same draws for every model."""
    from wakefl.tools.acoustics.field_acoustics import babble
    from wakefl.tools.augmentation.context_speech import around

    rng = np.random.default_rng([seed, 7073, KINDS.index(kind), int(round(snr_db * 10))])
    n = windows.shape[1]
    out = np.empty_like(windows)
    for i, w in enumerate(windows):
        if kind == "probe":
            bg = babble(rng, 2 * n, sources["probe"])
        else:
            bank = sources[kind].babble
            bg = bank[int(rng.integers(len(bank)))]
        start = int(rng.integers(0, bg.size - n + 1))
        out[i] = around(w, np.asarray(bg[start : start + n], np.float32), "over", snr_db)
    return out


def through_agc(windows: np.ndarray, after_quiet: bool, seed: int) -> np.ndarray:
    """`windows` through the field devices' AGC with up to 30 dB of gain: on each window
    alone, or `after_quiet`, after the context probe's lead of room tone (its level and
    length, tools/probes/context_conditions.py), cut off again; the same draws every run."""
    from wakefl.tools.acoustics.field_acoustics import agc
    from wakefl.tools.probes.context_conditions import LEAD_S, ROOM_TONE_DB

    rng = np.random.default_rng([seed, 7074])
    lead = int(LEAD_S * 16000) if after_quiet else 0
    out = np.empty_like(windows)
    for i, w in enumerate(windows):
        tone = rng.standard_normal(lead) * 10.0 ** (ROOM_TONE_DB / 20.0)
        x = agc(np.concatenate([tone, np.asarray(w, np.float64)]), max_gain_db=30.0)
        out[i] = np.clip(x[lead:], -1.0, 1.0)
    return out


def fit_rows(
    scorer: Any, sets: dict[str, np.ndarray], threshold: float
) -> dict[str, dict[str, float]]:
    """Share at or above `threshold` and median score of each named set of windows."""
    from wakefl.tools.evaluation.model_scoring import score_windows

    out = {}
    for name, x in sets.items():
        s = score_windows(scorer, x, progress=False)
        out[name] = {"detected": float(np.mean(s >= threshold)), "median": float(np.median(s))}
    return out


def window_sets(args: argparse.Namespace, n: int) -> dict[str, np.ndarray]:
    """Every (split, babble kind, ratio) set of windows, clean sets first."""
    from wakefl.tools.augmentation.speech_backgrounds import SpeechBackgrounds

    # Training's babble is cut from 400 of the training split's negative clips (of the
    # kind's contents).
    sources: dict[str, Any] = {}
    for kind in args.kinds:
        if kind == "probe":
            sources[kind] = probe_babble_speech(args.profile, args.seed, args.phrase)
            continue
        draw = [args.seed, 7072] + ([] if kind == "training" else [KINDS.index(kind)])
        neg = clip_windows(args.corpus, "train", 0, 400, n, draw, NEGATIVE_CONTENTS[kind])
        sources[kind] = SpeechBackgrounds.make(neg, args.seed, n_each=16, seconds=2 * n / 16000)
    sets: dict[str, np.ndarray] = {}
    clean = {
        s: clip_windows(args.corpus, s, 1, args.clips, n, [args.seed, 7071])
        for s in ("train", "test")
    }
    for split, x in clean.items():
        sets[f"{split}, clean"] = x
    for split, x in clean.items():
        if args.agc:
            sets[f"{split}, AGC"] = through_agc(x, False, args.seed)
            sets[f"{split}, AGC after quiet"] = through_agc(x, True, args.seed)
        for kind in args.kinds:
            for snr in args.ratios:
                sets[f"{split}, {kind} babble {snr:g} dB"] = under_babble(
                    x, kind, snr, sources, args.seed
                )
    return sets


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--corpus",
        type=Path,
        required=True,
        metavar="DIR",
        help="a corpus folder or its manifest.csv",
    )
    ap.add_argument("--model", action="append", required=True, metavar="LABEL=WEIGHTS[@T]")
    ap.add_argument("--clips", type=int, default=150, help="phrase clips per split")
    ap.add_argument("--ratios", type=float, nargs="+", default=[10.0, 5.0, 0.0], metavar="DB")
    ap.add_argument(
        "--kinds",
        nargs="+",
        choices=KINDS,
        default=list(DEFAULT_KINDS),
        help="babble kinds: training's (from every training negative), its everyday speech "
        "only, its near-rhymes only, the probe's (held-out speakers' sentences)",
    )
    ap.add_argument(
        "--agc",
        action="store_true",
        help="also score each phrase window through an AGC, alone and after a second of quiet",
    )
    ap.add_argument("--profile", default="pretrain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phrase", default="hey nova")
    ap.add_argument("--json", type=Path, default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not 1 <= args.clips <= MAX_CLIPS:
        raise ConfigError(f"--clips must be 1-{MAX_CLIPS}, got {args.clips}")
    if not all(-20.0 <= r <= 40.0 for r in args.ratios):
        raise ConfigError(f"--ratios must be in [-20, 40] dB, got {args.ratios}")
    if args.corpus.name == "manifest.csv":  # the manifest itself names its folder
        args.corpus = args.corpus.parent
    if not (args.corpus / "manifest.csv").is_file():
        raise ConfigError(f"--corpus {args.corpus}: no manifest.csv")
    models = thresholded_models(args.model)
    from wakefl.tools.evaluation.model_scoring import TorchScorer

    thresholds = {label: thr for label, (_, thr) in models.items()}
    scorers = {label: TorchScorer(path) for label, (path, _) in models.items()}
    sets = window_sets(args, next(iter(scorers.values())).window_samples)
    results: dict[str, dict[str, Any]] = {
        label: {"threshold": thr, "sets": fit_rows(scorers[label], sets, thr)}
        for label, thr in thresholds.items()
    }
    print(f"babble fit: {args.clips} phrase clips per split of {args.corpus}")
    print(
        "| windows | "
        + " | ".join(f"{k} ({r['threshold']:.4f})" for k, r in results.items())
        + " |"
    )
    print("|---|" + "---|" * len(results))
    for name in sets:
        cells = [
            f"{100 * r['sets'][name]['detected']:.1f} % ({r['sets'][name]['median']:.3f})"
            for r in results.values()
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps({"clips": args.clips, "models": results}, indent=1))
    return 0


if __name__ == "__main__":
    from wakefl.tools.script_errors import run_script

    raise SystemExit(run_script(main, __file__))
