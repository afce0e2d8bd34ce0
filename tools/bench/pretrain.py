"""How fast `wakefl model pretrain` trains, where the time goes, and whether a CUDA run is
the CPU run.

Three figures per device, in samples per second, on the corpus given:
- batch preparation alone (augmentation in 1 and in `--workers` processes),
- the optimizer step alone (forward, backward, AdamW on prepared batches),
- the training loop as it runs (prepared batches feeding the step).
The CPU figures are the reference measured in the same run; each CUDA figure is also
given as a ratio to its CPU twin. With CUDA present, the same steps from the same weights
run on both devices, and the largest weight difference and the loss trajectories are
printed: the two runs see the same batches and masks, so they differ by rounding only.

    python -m wakefl.tools.bench.pretrain --corpus CORPUS/manifest.csv [--width 1.0]
        [--arch v2,norm=group,...] [--steps 60] [--workers 8] [--devices cpu,cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.recorded_paths import recorded_path


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def preparation_rate(data: Any, s: Any, steps: int, workers: int) -> float:
    """Samples per second of augmented batches from `workers` processes (0 = in this one)."""
    from wakefl.tools.training.data import batch_stream

    it = batch_stream(data, 0, s, workers=workers, end_step=steps + 2)
    next(it)  # the workers' start-up is not throughput
    t0 = time.perf_counter()
    n = sum(1 for _ in it)
    return n * s.batch_size / (time.perf_counter() - t0)


def step_rate(data: Any, s: Any, steps: int) -> float:
    """Samples per second of optimizer steps on batches prepared beforehand."""
    import torch

    from wakefl.tools.training.data import make_batch
    from wakefl.tools.training.pretrain import seeded_model, train_step

    model, opt = seeded_model(s)
    batches = [make_batch(data, k, s) for k in range(min(steps, 8))]
    gen = torch.Generator()
    for k in range(3):  # warm-up: allocator, cuDNN algorithm choice
        xt, yt = (torch.from_numpy(a) for a in batches[k % len(batches)])
        train_step(model, opt, xt, yt, k, gen, s)
    _sync(s.device)
    t0 = time.perf_counter()
    for k in range(steps):
        x, y = batches[k % len(batches)]
        train_step(model, opt, torch.from_numpy(x), torch.from_numpy(y), k, gen, s)
    _sync(s.device)
    return steps * s.batch_size / (time.perf_counter() - t0)


def run_steps(data: Any, s: Any, steps: int) -> tuple[float, list[float], Any]:
    """The training loop for `steps` steps from seeded weights: samples per second after
    the first step (the workers' start and the first kernels are not throughput), the
    losses, and the final weights (on the CPU)."""
    import torch

    from wakefl.tools.training.data import batch_stream
    from wakefl.tools.training.pretrain import seeded_model, train_step

    model, opt = seeded_model(s)
    gen = torch.Generator()
    losses: list[float] = []
    t0 = 0.0
    for step, (x, y) in enumerate(batch_stream(data, 0, s, workers=s.workers, end_step=steps)):
        losses.append(train_step(model, opt, x, y, step, gen, s))
        if step == 0:
            t0 = time.perf_counter()
    _sync(s.device)
    rate = (steps - 1) * s.batch_size / (time.perf_counter() - t0)
    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return rate, losses, weights


def measure(data: Any, s: Any, steps: int) -> dict[str, Any]:
    """The three rates of one device, and the loop's losses and weights."""
    loop, losses, weights = run_steps(data, s, steps)
    return {
        "device": s.device,
        "prepare_1_worker": preparation_rate(data, s, steps, 0),
        f"prepare_{s.workers}_workers": preparation_rate(data, s, steps, s.workers),
        "step": step_rate(data, s, steps),
        "loop": loop,
        "losses": losses,
        "_weights": weights,
    }


def agreement(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """How far two devices' runs of the same steps are apart. The first step's loss
    differs by the kernels' rounding alone (same weights, batch and masks); later steps
    amplify it, as any two floating-point orders of the same training would."""
    wa, wb = a["_weights"], b["_weights"]
    la, lb = np.array(a["losses"]), np.array(b["losses"])
    return {
        "first_step_loss_difference": float(abs(la[0] - lb[0])),
        "max_loss_difference_first_5_steps": float(np.abs(la[:5] - lb[:5]).max()),
        "max_loss_difference": float(np.abs(la - lb).max()),
        "max_weight_difference_at_end": max(
            float((wa[k].float() - wb[k].float()).abs().max()) for k in wa
        ),
        "max_weight": max(float(wa[k].float().abs().max()) for k in wa),
    }


def _table(results: list[dict[str, Any]], workers: int) -> str:
    ref = results[0]
    keys = ("prepare_1_worker", f"prepare_{workers}_workers", "step", "loop")
    lines = [f"{'samples/s':<22}" + "".join(f"{r['device']:>16}" for r in results)]
    for key in keys:
        cells = [f"{r[key]:>16,.0f}" for r in results[:1]]
        cells += [f"{r[key]:>8,.0f} ({r[key] / ref[key]:4.1f}x)" for r in results[1:]]
        lines.append(f"{key:<22}" + "".join(cells))
    return "\n".join(lines)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, required=True, help="a corpus manifest")
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--arch", default="v1", help="as `wakefl model pretrain --arch`")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--devices", default="cpu,cuda", help="cpu first: it is the reference")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    from wakefl.tools.training.data import load_pretrain_data
    from wakefl.tools.training.settings import PretrainSettings, model_config

    a = _args(argv)
    devices = [d for d in a.devices.split(",") if d == "cpu" or torch.cuda.is_available()]
    if not devices or devices[0] != "cpu" or a.steps < 2 or a.workers < 1:
        raise ConfigError("--devices must start with cpu; --steps >= 2 and --workers >= 1")
    torch.set_num_threads(a.threads)
    base = PretrainSettings(
        width=a.width,
        arch=a.arch,
        batch_size=a.batch_size,
        mel_warp=0.1,
        workers=a.workers,
        threads=a.threads,
    )
    window = model_config(a.arch, a.width).window_samples
    data = load_pretrain_data(a.corpus, window, 6.0, progress=False, seed=base.seed)
    results = [measure(data, dataclasses.replace(base, device=d), a.steps) for d in devices]
    print(
        f"width {a.width}, arch {a.arch}, batch {a.batch_size}, {a.steps} steps, torch threads {a.threads}"
    )
    print(_table(results, a.workers))
    report: dict[str, Any] = {
        "settings": vars(a) | {"corpus": recorded_path(a.corpus)},
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
    }
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name()
    if len(results) > 1:
        report["agreement"] = agreement(results[0], results[1])
        print("cpu vs cuda after the same steps:", json.dumps(report["agreement"]))
    report["results"] = [{k: v for k, v in r.items() if k != "_weights"} for r in results]
    if a.json is not None:
        a.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
