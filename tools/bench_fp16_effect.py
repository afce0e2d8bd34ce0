"""What sending a model as fp16 instead of fp32 costs: bytes per update, and the FA/FR
effect of the rounding, per device type.

The model goes through the real wire path (`messages.encode` with wire_dtype fp16, then
`decode`), and both versions score each device type's test clips. The fp32 model plays
the baseline: relative FA/FR of the fp16 copy at the baseline's operating point (target
FR) with matched FR — 1.0 means no effect.

    .venv/bin/python tools/bench_fp16_effect.py --data CORPUS/manifest.csv [--model CKPT]

Without --model, the warm-start model of the corpus is trained (or taken from the cache).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _wire_round_trip(params: Any) -> tuple[dict[str, int], dict[str, Any]]:
    """Bytes of one update and the parameters a server decodes from it, per wire dtype."""
    from wakefl.sdk import messages

    sizes, decoded = {}, {}
    for wire in ("fp32", "fp16"):
        up = messages.Uplink(
            fleet="default",
            run_id="bench",
            device_id="d",
            device_type="A",
            round_id=1,
            params=params,
            num_samples=1,
        )
        payload = messages.encode(up, wire_dtype=wire)
        sizes[wire] = len(payload)
        decoded[wire] = messages.decode_as(payload, messages.Uplink).params
    return sizes, decoded


def _compare_scores(model: Any, model16: Any, data: str, split: str, target_fr: float) -> None:
    """Per device type: how far the fp16 copy's scores move, and its relative FA/FR."""
    import numpy as np

    from wakefl.sdk.dataset import WakeWordDataset
    from wakefl.sdk.local_training import predict_scores
    from wakefl.sdk.manifest import device_types, read_manifest
    from wakefl.sdk.wake_metrics import local_relative_report

    print(f"\n{'type':>5} {'clips':>6} {'max |d score|':>14} {'rel FA':>8} {'rel FR':>8}  note")
    rel_fa = []
    for dt in device_types(read_manifest(data)):
        ds = WakeWordDataset(data, dt, split, window_samples=model.cfg.window_samples)
        s32 = predict_scores(model, ds)
        s16 = predict_scores(model16, ds)
        rep = local_relative_report(s32, s16, ds.labels, target_fr=target_fr)
        fa, fr = rep.get("relative_fa"), rep.get("relative_fr")
        if fa is not None:
            rel_fa.append(fa)
        fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        print(
            f"{dt:>5} {len(ds):>6} {np.abs(s32 - s16).max():>14.2e} {fmt(fa):>8} {fmt(fr):>8}  "
            f"{rep.get('uncertainty', '')}"
        )
    if rel_fa:
        print(f"\nrelative FA of the fp16 copy, mean over device types: {np.mean(rel_fa):.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="corpus manifest.csv")
    ap.add_argument("--model", default=None, help="checkpoint (.safetensors with its .json config)")
    ap.add_argument("--width", type=float, default=0.25, help="warm-start width without --model")
    ap.add_argument("--epochs", type=int, default=8, help="warm-start epochs without --model")
    ap.add_argument("--split", default="test", choices=("val", "test"))
    ap.add_argument("--target-fr", type=float, default=0.05)
    args = ap.parse_args(argv)

    import torch

    from wakefl.models.kws_cnn import get_flat_params, load_model, set_flat_params

    torch.set_num_threads(1)
    if args.model is None:
        from wakefl.tools.warm_start import train_or_load_baseline

        ckpt = train_or_load_baseline(args.data, args.width, epochs=args.epochs)
    else:
        ckpt = Path(args.model)
    model = load_model(ckpt)
    params = get_flat_params(model)

    sizes, decoded = _wire_round_trip(params)
    err = (decoded["fp16"] - params).abs()
    print(f"model {ckpt}: {params.numel():,} parameters")
    print(
        f"bytes per update: fp32 {sizes['fp32']:,}, fp16 {sizes['fp16']:,} "
        f"({sizes['fp16'] / sizes['fp32']:.3f}x)"
    )
    print(f"fp16 rounding: max |delta param| {err.max():.2e}, mean {err.mean():.2e}")

    model16 = load_model(ckpt)
    set_flat_params(model16, decoded["fp16"])
    _compare_scores(model, model16, args.data, args.split, args.target_fr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
