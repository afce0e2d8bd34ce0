"""What sending a model as fp16 instead of fp32 costs: bytes per update, and the FA/FR
effect of the rounding, per device type. With `--codec int8-delta` (or fp16-delta): what a
compressed update costs instead: each device type's personalized model (the model
fine-tuned on its training clips) against the model a server decodes from its update.

The model goes through the real wire path (`messages.encode` with wire_dtype fp16, then
`decode`), and both versions score each device type's test clips. The fp32 model plays
the baseline: relative FA/FR of the fp16 copy at the baseline's operating point (target
FR) with matched FR — 1.0 means no effect.

    .venv/bin/python tools/bench/fp16_effect.py --data CORPUS/manifest.csv [--model CKPT]
        [--codec int8-delta]

Without --model, the warm-start model of the corpus is trained (or taken from the cache).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _wire_round_trip(params: Any) -> tuple[dict[str, int], dict[str, Any]]:
    """Bytes of one update and the parameters a server decodes from it, per wire dtype."""
    from wakefl.protocol import messages

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


def _personalize(model: Any, data: str, device_type: str, epochs: int, seed: int) -> Any:
    """A copy of `model` fine-tuned on one device type's training clips (Adam, lr 1e-3):
    what a device's update holds relative to the round's global model."""
    import copy

    from wakefl.sdk.dataset import WakeWordDataset
    from wakefl.sdk.local_training import train_supervised

    personal = copy.deepcopy(model)
    ds = WakeWordDataset(data, device_type, "train", window_samples=model.cfg.window_samples)
    train_supervised(personal, ds, epochs=epochs, lr=1e-3, batch_size=16, seed=seed, progress=False)
    return personal.eval()


def _delta_pairs(model: Any, data: str, codec: str, epochs: int) -> Any:
    """Per device type: (the personalized model exactly, the model a server decodes from
    its `codec` update against `model`), and the update's size against fp32."""
    from wakefl.models.kws_cnn import get_flat_params
    from wakefl.protocol import update_codec

    base = get_flat_params(model)
    print(f"{codec}: {update_codec.size_ratio(base.numel(), codec):.3f}x the fp32 bytes")

    def pair(dt: str) -> tuple[Any, Any]:
        personal = _personalize(model, data, dt, epochs, seed=sum(map(ord, dt)))
        params = get_flat_params(personal)
        decoded = update_codec.verified_decode(update_codec.encode(params, base, codec), base)
        err = (decoded - params).abs()
        print(
            f"  {dt}: |update| {float((params - base).abs().max()):.2e}, "
            f"decode error max {float(err.max()):.2e}"
        )
        return personal, _with_params(personal, decoded)

    return pair


def _with_params(model: Any, flat: Any) -> Any:
    import copy

    from wakefl.models.kws_cnn import set_flat_params

    out = copy.deepcopy(model)
    set_flat_params(out, flat)
    return out.eval()


def _compare_scores(pairs: Any, data: str, split: str, target_fr: float, window: int) -> None:
    """Per device type: how far the copy's scores move from the exact model's, and its
    relative FA/FR against it, with the bootstrap interval."""
    import numpy as np

    from wakefl.sdk.dataset import WakeWordDataset
    from wakefl.sdk.local_training import predict_scores
    from wakefl.sdk.manifest import device_types, read_manifest
    from wakefl.sdk.wake_metrics import local_relative_report

    print(f"\n{'type':>5} {'clips':>6} {'max |d score|':>14} {'rel FA':>8} {'rel FR':>8}  CI, note")
    rel_fa = []
    for dt in device_types(read_manifest(data)):
        ds = WakeWordDataset(data, dt, split, window_samples=window)
        exact, copy_ = pairs(dt)
        s32 = predict_scores(exact, ds)
        s16 = predict_scores(copy_, ds)
        rep = local_relative_report(s32, s16, ds.labels, target_fr=target_fr)
        fa, fr = rep.get("relative_fa"), rep.get("relative_fr")
        if fa is not None:
            rel_fa.append(fa)
        fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        ci = "[" + ", ".join(fmt(v) for v in rep["ci"]) + "]"
        print(
            f"{dt:>5} {len(ds):>6} {np.abs(s32 - s16).max():>14.2e} {fmt(fa):>8} {fmt(fr):>8}  "
            f"{ci} {rep.get('uncertainty', '')}"
        )
    if rel_fa:
        print(f"\nrelative FA of the copy, mean over device types: {np.mean(rel_fa):.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="corpus manifest.csv")
    ap.add_argument("--model", default=None, help="checkpoint (.safetensors with its .json config)")
    ap.add_argument("--width", type=float, default=0.25, help="warm-start width without --model")
    ap.add_argument("--epochs", type=int, default=8, help="warm-start epochs without --model")
    ap.add_argument("--split", default="test", choices=("val", "test"))
    ap.add_argument("--target-fr", type=float, default=0.05)
    ap.add_argument(
        "--codec",
        default="fp16",
        choices=("fp16", "fp16-delta", "int8-delta"),
        help="fp16: the model itself in fp16 (default); a delta codec: each device type's "
        "personalized model sent relative to the model as an update",
    )
    ap.add_argument(
        "--local-epochs", type=int, default=2, help="fine-tuning epochs for a delta codec"
    )
    args = ap.parse_args(argv)

    import torch

    from wakefl.models.kws_cnn import get_flat_params, load_model, set_flat_params

    torch.set_num_threads(1)
    if args.model is None:
        from wakefl.tools.training.warm_start import train_or_load_baseline

        ckpt = train_or_load_baseline(args.data, args.width, epochs=args.epochs)
    else:
        ckpt = Path(args.model)
    model = load_model(ckpt)
    params = get_flat_params(model)

    window = model.cfg.window_samples
    if args.codec != "fp16":
        print(f"model {ckpt}: {params.numel():,} parameters")
        pairs = _delta_pairs(model, args.data, args.codec, args.local_epochs)
        _compare_scores(pairs, args.data, args.split, args.target_fr, window)
        return 0
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
    _compare_scores(lambda dt: (model, model16), args.data, args.split, args.target_fr, window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
