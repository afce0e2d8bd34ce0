"""How many decisions does a model's int8 export change, and would another calibration
change fewer? Each model is exported to fp32 and to int8 as `wakefl model export --int8`
does, once per calibration, and both are scored by onnxruntime on the same windows: clips
of a corpus's validation split (phrases and negatives) and the shipped calibration set's
held-out windows played as a stream at the detector's 0.1 s hop (what the export's own
agreement check scores). Calibrations:

- `shipped`: the shipped calibration set's calibration windows (what exports use), or
  `shipped-stream`: the same windows played as a stream at the 0.1 s hop, every offset
  a device scores;
- `minmax` (what exports use) or `percentile` activation ranges
  (models/kws_cnn/quantize.py CALIBRATION_METHODS).

For each: the decisions at the model's threshold that int8 changes (of them, phrases
missed or detected anew), the median and 95th percentile of the change of the logit, and
how many clips score within 0.01 of the threshold in fp32, where a small change flips a
decision.

    python -m wakefl.tools.probes.int8_calibration --corpus corpus-pretrain \\
        --model full=pretrained:full [--model leg=run/full.safetensors@0.988] \\
        [--clips 750] [--json int8.json]"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.recorded_paths import recorded_path
from wakefl.tools.probes.babble_fit import clip_windows
from wakefl.tools.probes.context_probe import thresholded_models

MAX_CLIPS = 5000  # per label
NEAR = 0.01  # "near the threshold": within this of it, in fp32
CALIBRATIONS = ("shipped", "shipped-stream")


def calibration_sets(window: int, hop: int) -> dict[str, np.ndarray]:
    """CALIBRATIONS' windows: the shipped calibration set's, alone or as a stream."""
    from wakefl.models.kws_cnn.quantize import bundled_calibration, bundled_stream

    shipped, _ = bundled_calibration("calibration")
    return {"shipped": shipped, "shipped-stream": bundled_stream("calibration", window, hop)[0]}


def _logit(p: np.ndarray) -> np.ndarray:
    q = np.clip(p, 1e-7, 1 - 1e-7)
    return np.log(q / (1 - q))


def compare(fp32: np.ndarray, int8: np.ndarray, labels: np.ndarray, threshold: float) -> dict:
    """What int8 changes of fp32's decisions on the same windows (`labels` 1 = phrase)."""
    a, b = fp32 >= threshold, int8 >= threshold
    change = np.abs(_logit(fp32) - _logit(int8))
    phrase = labels == 1
    return {
        "windows": int(fp32.size),
        "differ": int(np.count_nonzero(a != b)),
        "phrases_missed_anew": int(np.count_nonzero(phrase & a & ~b)),
        "phrases_detected_anew": int(np.count_nonzero(phrase & ~a & b)),
        "negatives_differ": int(np.count_nonzero(~phrase & (a != b))),
        "median_logit_change": float(np.median(change)),
        "p95_logit_change": float(np.percentile(change, 95)),
    }


Scores = dict[str, tuple[np.ndarray, np.ndarray]]  # export: (clip scores, held-out scores)


def export_scores(weights: Path, windows: np.ndarray, methods: list[str]) -> Scores:
    """The scores of one weights file's fp32 export ("fp32") and of each calibration's int8
    export, on `windows` and on the held-out stream windows."""
    from wakefl.edge_runtime import OnnxScorer
    from wakefl.edge_runtime.detection_rule import hop_samples
    from wakefl.models.kws_cnn import export_onnx, load_model
    from wakefl.models.kws_cnn.quantize import bundled_stream
    from wakefl.operating_point import DEFAULT_HOP_S
    from wakefl.tools.evaluation.model_scoring import score_windows

    model = load_model(weights).eval()
    window, hop = model.cfg.window_samples, hop_samples(DEFAULT_HOP_S, model.cfg.sample_rate)
    held_out, _ = bundled_stream("held_out", window, hop)
    exports: dict[str, dict[str, Any]] = {"fp32": {}} | {
        f"{name}, {method}": {
            "int8": True, "calibration_windows": calib, "calibration_method": method
        }
        for name, calib in calibration_sets(window, hop).items()
        for method in methods
    }  # fmt: skip
    scores: Scores = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, kw) in enumerate(exports.items()):
            scorer = OnnxScorer(export_onnx(model, Path(tmp) / f"{i}.onnx", **kw))
            # In batches: one onnxruntime call holds the activations of all its windows,
            # about 1.6 MB a full-width window (0.76 GB peak for 300, 0.29 GB for 64).
            clips = score_windows(scorer, windows, progress=False)
            scores[name] = (clips, score_windows(scorer, held_out, progress=False))
    return scores


def model_rows(scores: Scores, labels: np.ndarray, threshold: float) -> dict[str, Any]:
    """One model's fp32 export against each calibration's int8 export, at `threshold`."""
    from wakefl.models.kws_cnn.quantize import decision_agreement

    ref, ref_held = scores["fp32"]
    rows: dict[str, Any] = {}
    for name, (clips, held_out) in scores.items():
        if name == "fp32":
            continue
        held = decision_agreement(ref_held, held_out, threshold)  # what the export checks
        rows[name] = {
            **compare(ref, clips, labels, threshold),
            "held_out_stream": {
                "windows": held["windows"],
                "differ": held["windows"] - held["agree"],
            },
        }
    near = int(np.count_nonzero(np.abs(ref - threshold) < NEAR))
    return {"threshold": threshold, "near_threshold": near, "calibrations": rows}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True, metavar="DIR", help="a corpus folder")
    ap.add_argument("--model", action="append", required=True, metavar="LABEL=WEIGHTS[@T]")
    ap.add_argument("--clips", type=int, default=750, help="validation clips per label")
    ap.add_argument("--methods", nargs="+", default=["minmax", "percentile"])
    ap.add_argument("--seed", type=int, default=0, help="which clips")
    ap.add_argument("--json", type=Path, default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    from wakefl.models.kws_cnn.quantize import check_calibration_method

    args = _parser().parse_args(argv)
    if not 1 <= args.clips <= MAX_CLIPS:
        raise ConfigError(f"--clips must be 1-{MAX_CLIPS}, got {args.clips}")
    for method in args.methods:
        check_calibration_method(method)
    if not (args.corpus / "manifest.csv").is_file():
        raise ConfigError(f"--corpus {args.corpus}: no manifest.csv")
    models = thresholded_models(args.model)
    from wakefl.models.kws_cnn import load_model

    n = load_model(next(iter(models.values()))[0]).cfg.window_samples
    parts = [clip_windows(args.corpus, "val", y, args.clips, n, (args.seed, y)) for y in (1, 0)]
    windows = np.concatenate(parts)
    labels = np.repeat([1, 0], [len(p) for p in parts])
    # One set of exports per weights file: labels that differ only in threshold share them.
    scores = {path: export_scores(path, windows, args.methods) for path, _ in models.values()}
    results = {
        label: {"weights": recorded_path(path), **model_rows(scores[path], labels, thr)}
        for label, (path, thr) in models.items()
    }
    print(f"int8 calibration: {len(windows)} validation clips of {args.corpus}")
    print("| model | calibration | decisions that differ (phrases missed / found anew) | "
          "median / p95 logit change | held-out stream windows that differ |")  # fmt: skip
    print("|---|---|---|---|---|")
    for label, r in results.items():
        for name, row in r["calibrations"].items():
            held = row["held_out_stream"]
            print(
                f"| {label} ({r['threshold']:.4f}, {r['near_threshold']} near it) | {name} | "
                f"{row['differ']} ({row['phrases_missed_anew']} / {row['phrases_detected_anew']}) | "
                f"{row['median_logit_change']:.3f} / {row['p95_logit_change']:.3f} | "
                f"{held['differ']} of {held['windows']} |"
            )
    if args.json is not None:
        payload = {"clips_per_label": args.clips, "seed": args.seed, "models": results}
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    from wakefl.tools.script_errors import run_script

    raise SystemExit(run_script(main, __file__))
