"""Does a speech engine say the wake phrase well enough to serve as positives? A shipped
model that never heard the engine scores its speakers' wake phrases against their
near-miss phrases and other speech, each alone in a quiet window: if the model separates
them, the phrase carries its words. Prints, per base voice and in all, the share of wake
phrases over the model's shipped threshold, the share of near misses and of other speech
over it, and the AUC of wake phrases against the rest.

    python -m wakefl.tools.bench.engine_intelligibility [--speakers 24] [--model full] [--seed 0]

Today's engine: GnuSpeech (tools/corpus/gnuspeech.py), its speakers drawn between its
shipped voices (tools/corpus/voices.py `draw_gnuspeech_voice`).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from wakefl.errors import ConfigError
from wakefl.tools.acoustics.device_acoustics import scale_to
from wakefl.tools.corpus.plan import HEY_NOVA_CONFUSABLES, OTHER_SPEECH
from wakefl.tools.corpus.speech_synthesis import synthesize
from wakefl.tools.corpus.voices import draw_gnuspeech_voice

PHRASE = "hey nova"
_LEVEL_DB = -23.0  # the speech's RMS in the window


def _window(speech: np.ndarray, samples: int) -> np.ndarray:
    """The utterance centred in a quiet window (cut to the window when longer)."""
    out = np.zeros(samples, dtype=np.float32)
    speech = scale_to(speech.astype(np.float64), _LEVEL_DB)[:samples]
    start = (samples - speech.size) // 2
    out[start : start + speech.size] = speech
    return out


def _auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(a wake phrase outscores a non-phrase), ties counted half."""
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins) / (pos.size * neg.size)


def _row(name: str, kinds: dict[str, list[float]], threshold: float) -> str:
    share = {k: np.mean(np.asarray(v) >= threshold) for k, v in kinds.items()}
    pos = np.asarray(kinds["phrase"])
    neg = np.asarray(kinds["near miss"] + kinds["other"])
    return (
        f"| {name} | {len(pos)} | {share['phrase']:.0%} | {share['near miss']:.0%} | "
        f"{share['other']:.0%} | {_auc(pos, neg):.2f} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--speakers", type=int, default=24)
    ap.add_argument("--model", choices=("small", "full"), default="full")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 1 <= args.speakers <= 1000:
        raise ConfigError(f"--speakers must be 1-1000, got {args.speakers}")
    from wakefl.models.kws_cnn.pretrained import pretrained_card, pretrained_path
    from wakefl.tools.evaluation.model_scoring import TorchScorer, score_windows

    scorer = TorchScorer(pretrained_path(args.model))
    threshold = float(pretrained_card(args.model)["threshold"])
    rng = np.random.default_rng(args.seed)
    texts = [("phrase", PHRASE)] + [("near miss", t) for t in HEY_NOVA_CONFUSABLES[:3]]
    texts += [("other", t) for t in OTHER_SPEECH[:2]]
    by_voice: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _ in range(args.speakers):
        voice = draw_gnuspeech_voice(rng)
        windows = np.stack([_window(synthesize(voice, t), scorer.window_samples) for _, t in texts])
        scores = score_windows(scorer, windows, progress=False)
        for (kind, _), score in zip(texts, scores, strict=True):
            by_voice[voice.voice][kind].append(float(score))
            by_voice["all"][kind].append(float(score))
    print(
        f"GnuSpeech, {args.speakers} speakers, shipped `{args.model}` at its threshold {threshold:.4f}"
    )
    print(
        "| voice | speakers | wake phrases over it | near misses over it | other speech over it | AUC |"
    )
    print("|---|---|---|---|---|---|")
    for name in sorted(k for k in by_voice if k != "all") + ["all"]:
        print(_row(name, by_voice[name], threshold))
    return 0


if __name__ == "__main__":
    from wakefl.tools.script_errors import run_script

    raise SystemExit(run_script(main, __file__))
