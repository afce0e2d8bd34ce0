"""`wakefl model pretrain`: train the wake-word model offline on the pretraining corpus.
This module is the training loop; beside it are the run's settings (tools/training/settings.py),
its data and batches (tools/training/data.py), validation (tools/training/validation.py), checkpoints
(tools/training/checkpoints.py), distillation (tools/training/distillation.py) and publishing
a run as a shipped model (tools/training/publish.py).

Every batch is drawn fresh: a third wake-phrase clips, the rest negatives (clips of confusable
phrases, other speech and background, and random 1.5 s cuts of the training streams), each
augmented on the fly (tools/augmentation/wave_augment.py) and with SpecAugment-style masks on the log-mel
input. The learning rate warms up linearly, then follows a cosine to 5%. Three options target
what the benchmark still misses: `mel_warp` scales each example's spectrum like another
vocal tract (tools/augmentation/mel_warp.py: voices of engines training never heard), `time_warp`
stretches one part of each example and compresses the other (tools/augmentation/time_warp.py: another
speaker's timing), and `hard_negative_share` draws part of the negatives from a pool of the
training negatives the model currently scores highest (tools/training/hard_negatives.py: the false
accepts that set the threshold).

Validation measures what a device maker ships for: the false-reject rate of the validation
clips at the threshold where the streaming detector (its smoothing and refractory period)
makes at most `val_fa_per_hour` false accepts per hour on the validation streams. The best
model by that figure is kept.

Checkpoints: `state.safetensors` (weights and optimizer moments) + `state.json` (step, best
figure, history) every `checkpoint_minutes`, written atomically. `--resume` continues from
them; the batch of step k depends only on (seed, k), so a resumed run sees the same data a
run without the kill would have seen (with mining on: on (seed, k) and the pool, whose
descriptors the checkpoint carries).
When the run's folder is gone (a new machine) but its step-k weights were committed,
`--init-from WEIGHTS --start-step k` continues it: the same schedule and data from step k,
the optimizer moments started afresh and the rate warmed up again over `warmup_steps`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.progress_bars import bar_disabled
from wakefl.tools.training.checkpoints import load_state, save_best, save_last, save_state
from wakefl.tools.training.data import (
    PretrainData,
    batch_stream,
    load_pretrain_data,
    narrow_to_speech_source,
)
from wakefl.tools.training.distillation import distill_loss, load_teacher
from wakefl.tools.training.hard_negatives import has_pool, mine_pool, restore_pool
from wakefl.tools.training.logit_margin import logit_margin_loss, positive_margin_loss
from wakefl.tools.training.settings import (
    BALANCE_KEYS,
    HISTORY,
    STATE_INFO,
    WIDEN_NOISE,
    PretrainSettings,
    continued_lr_at,
    distillation_in_range,
    gain_alpha_at,
)
from wakefl.tools.training.validation import better, validate

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from wakefl.models.kws_cnn import KwsCnn


KEPT = ("width", "phrase", "seed", "batch_size")  # what --resume must not change


def _settings_match(saved: dict[str, Any], s: PretrainSettings) -> None:
    # Runs from before `arch` existed were version 1.
    for key, made in (*((k, saved.get(k)) for k in KEPT), ("arch", saved.get("arch", "v1"))):
        if made != getattr(s, key):
            raise ConfigError(
                f"--resume: the checkpoint was made with {key}={made!r}, "
                f"this run asks for {getattr(s, key)!r}"
            )


def spec_mask(feats: Tensor, generator: torch.Generator) -> Tensor:
    """Two frequency bands (up to 6 mel bins) and two time spans (up to 12 frames) per
    example, set to the example's mean log-mel."""
    import torch

    b, f, t = feats.shape
    out = feats.clone()
    mean = feats.mean(dim=(1, 2), keepdim=True)
    for size, dim, limit in ((6, 1, f), (12, 2, t)):
        for _ in range(2):
            width = torch.randint(0, size + 1, (b,), generator=generator)
            start = (torch.rand(b, generator=generator) * (limit - width)).long()
            idx = torch.arange(limit)
            m = (idx[None, :] >= start[:, None]) & (idx[None, :] < (start + width)[:, None])
            # Drawn on the CPU generator wherever the model runs, so a step's masks are
            # the same on either device.
            m = (m[:, :, None] if dim == 1 else m[:, None, :]).to(feats.device)
            out = torch.where(m, mean, out)
    return out


def augmented_log_mel(
    model: KwsCnn,
    wave: Tensor,
    generator: torch.Generator,
    masks: bool,
    mel_warp: float = 0.0,
    time_warp: float = 0.0,
) -> Tensor:
    """The model's log-mel input of `wave`, warped in frequency and time and masked. Each
    draws from `generator` only when it is on, so a run without the time warp is the run
    it was before that option existed."""
    # A window cache holds log-mel already (window_cache.py).
    x = model.frontend(wave) if wave.dim() == 2 else wave
    if mel_warp > 0:
        import torch

        from wakefl.tools.augmentation.mel_warp import warp_log_mel

        cfg = model.cfg
        u = torch.rand(x.shape[0], generator=generator).numpy()
        f_max = cfg.f_max if cfg.f_max is not None else cfg.sample_rate / 2.0
        x = warp_log_mel(x, 1.0 + mel_warp * (2.0 * u - 1.0), cfg.f_min, f_max)
    if time_warp > 0:
        from wakefl.tools.augmentation.time_warp import draw_warp, warp_time

        x = warp_time(x, *draw_warp(x.shape[0], x.shape[2], time_warp, generator))
    if masks:
        x = spec_mask(x, generator)
    return x


def _start_info(
    out: Path,
    s: PretrainSettings,
    manifest: Path,
    model: Any,
    opt: Any,
    resume: bool,
    init_from: Path | None,
    extra: Sequence[Path] = (),
) -> dict[str, Any]:
    """The run's state info: a new run (from `init_from`'s weights when given) or the saved
    one (model and optimizer restored) when resuming, which must name the same `extra`
    corpora."""
    info: dict[str, Any] = {
        "settings": asdict(s),
        "step": 0,
        "best": None,
        "seconds": 0.0,
        "manifest": str(manifest),
    }
    if init_from is not None and not (resume and (out / STATE_INFO).exists()):
        from wakefl.models.kws_cnn import load_model

        model.load_state_dict(_start_weights(load_model(init_from), model, init_from, s))
        info["init_from"] = str(init_from)
    if resume and (out / STATE_INFO).exists():
        try:
            saved = json.loads((out / STATE_INFO).read_text(encoding="utf-8"))["settings"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot resume from {out}: {exc}") from None
        _settings_match(saved, s)
        info = load_state(out, model, opt)
        info["settings"] = asdict(s)
    _same_extras(info, out, extra)
    return info


def _start_weights(start: Any, model: Any, init_from: Path, s: PretrainSettings) -> Any:
    """The state dict a new run starts from: `start`'s own, or a narrower model widened to
    the run's width (function-preserving, with symmetry-breaking noise)."""
    import dataclasses

    import torch

    from wakefl.models.kws_cnn.widen import widen

    # A version-1 model starts a version-2 run: the parameters have the same shapes, and
    # only the frontend's settings must agree.
    same_choices = {**model.cfg.architecture_choices(), "version": model.cfg.version}
    if dataclasses.replace(start.cfg, width=model.cfg.width, **same_choices) != model.cfg:
        raise ConfigError(f"--init-from {init_from}: its frontend differs")
    if start.cfg.width > model.cfg.width:
        raise ConfigError(
            f"--init-from {init_from}: width {start.cfg.width} is wider than the run's {s.width}"
        )
    if start.cfg.width < model.cfg.width:
        gen = torch.Generator().manual_seed(s.seed)
        start = widen(start.float(), model.cfg.width, noise=WIDEN_NOISE, generator=gen)
    return start.state_dict()


def train_step(
    model: KwsCnn,
    opt: torch.optim.Optimizer,
    x: Tensor,
    y: Tensor,
    step: int,
    gen: torch.Generator,
    s: PretrainSettings,
    teacher: KwsCnn | None = None,
    continued_at: int | None = None,
) -> float:
    """One optimizer step at the schedule's learning rate (warmed up again from
    `continued_at`, where a run continued from committed weights); returns the batch loss."""
    import torch
    import torch.nn.functional as F

    for g in opt.param_groups:
        g["lr"] = continued_lr_at(step, s, continued_at)
    if s.gain_ramp_samples > 0:
        model.set_gain_alpha(gain_alpha_at(step, s, s.model_config().gain_alpha))
    gen.manual_seed(s.seed * 1_000_003 + step)  # the masks of step k depend on k alone
    feats = augmented_log_mel(model, x.to(s.device), gen, s.spec_masks, s.mel_warp, s.time_warp)
    logits = model.classify(feats)
    loss = F.cross_entropy(logits, y.to(s.device))
    if s.logit_margin > 0:
        loss = loss + logit_margin_loss(logits, y.to(s.device), s.logit_margin)
    if s.positive_margin > 0 or s.logit_cap > 0:
        loss = loss + positive_margin_loss(logits, y.to(s.device), s.positive_margin, s.logit_cap)
    if teacher is not None and s.distill_weight > 0:
        # The teacher's frontend is the student's (load_teacher checks), so it is given the
        # very same augmented view rather than computing it again.
        with torch.no_grad():
            taught = teacher.classify(feats)
        loss = (1.0 - s.distill_weight) * loss + s.distill_weight * distill_loss(
            logits, taught, s.distill_temperature
        )
    if not torch.isfinite(loss):
        raise ConfigError(f"the training loss became {loss.item()} at step {step}; lower --lr")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def _validate_and_record(
    out: Path,
    model: KwsCnn,
    data: PretrainData,
    s: PretrainSettings,
    info: dict[str, Any],
    step: int,
    running: float,
) -> dict[str, Any]:
    """Validate after `step`, append the record to the history, keep the best model."""
    metrics = validate(model, data, s)
    record = {
        "step": step + 1,
        "samples": (step + 1) * s.batch_size,
        "loss": running,
        "lr": continued_lr_at(step, s, info.get("continued_at_step")),
        "seconds": info["seconds"],
        **metrics,
    }
    with (out / HISTORY).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    if better(metrics, info["best"]):
        info["best"] = record
        save_best(
            out,
            model,
            metrics,
            {"step": step + 1, "samples": record["samples"], "phrase": s.phrase, "width": s.width},
        )
    return metrics


def seeded_model(s: PretrainSettings) -> tuple[KwsCnn, torch.optim.AdamW]:
    """The model of `s.width` seeded by `s.seed` on `s.device`, and its AdamW optimizer."""
    import torch

    from wakefl.models.kws_cnn import KwsCnn

    torch.manual_seed(s.seed)
    model = KwsCnn(s.model_config()).to(s.device)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    return model, opt


def _new_run(out: Path, s: PretrainSettings, resume: bool) -> tuple[KwsCnn, torch.optim.AdamW]:
    """The seeded model and its AdamW optimizer, for a new run in `out` (refused when `out`
    holds one and `resume` is off, or the settings name an unknown balance or an impossible
    distillation) or one to resume."""
    import torch

    if s.balance_by not in ("", *BALANCE_KEYS):
        raise ConfigError(
            f"balance_by must be one of {BALANCE_KEYS} or empty, not {s.balance_by!r}"
        )
    if s.distill_from and not distillation_in_range(s.distill_weight, s.distill_temperature):
        raise ConfigError(
            "distillation needs a weight in (0, 1] and a temperature in (0, 100], got "
            f"{s.distill_weight} and {s.distill_temperature}"
        )
    torch.set_num_threads(max(1, s.threads))
    out.mkdir(parents=True, exist_ok=True)
    if not resume and (out / STATE_INFO).exists():
        raise ConfigError(
            f"{out} already holds a pretraining run; pass --resume to continue it "
            "or choose a new --out"
        )
    return seeded_model(s)


def _check_start_step(
    start_step: int, s: PretrainSettings, resume: bool, init_from: Path | None
) -> None:
    """A run continued from committed weights starts inside its schedule, from those weights
    and nowhere else: a run in --out carries its own step."""
    if start_step == 0:
        return
    if init_from is None or resume:
        raise ConfigError(
            "--start-step continues committed weights: give --init-from, not --resume"
        )
    if not 0 < start_step < s.total_steps:
        raise ConfigError(
            f"--start-step {start_step} is outside the run's {s.total_steps} steps "
            f"(--samples {s.samples} at batch {s.batch_size})"
        )


def _out_of_time(
    t0: float, max_minutes: float | None, steps_done: int, max_steps: int | None
) -> bool:
    """Whether this call has run `max_minutes` since `t0` or taken `max_steps` steps."""
    return (max_minutes is not None and time.monotonic() - t0 > max_minutes * 60) or (
        max_steps is not None and steps_done >= max_steps
    )


@dataclass
class _Run:
    """What the training loop works on, across the segments between two minings: the run's
    objects, its clock and its running loss."""

    out: Path
    model: KwsCnn
    opt: torch.optim.AdamW
    data: PretrainData
    s: PretrainSettings
    info: dict[str, Any]
    gen: torch.Generator  # of the spectrogram masks and the warp
    bar: Any  # tqdm progress bar
    t0: float
    last_ckpt: float
    seconds0: float
    start_step: int
    max_minutes: float | None
    max_steps: int | None
    running: float | None = None
    teacher: KwsCnn | None = None  # the frozen teacher model when distilling
    cache: Any = None  # window_cache.WindowCache when the run trains over one
    cache_pool: np.ndarray | None = None  # the mined cache indices, when mining over a cache


def _same_extras(info: dict[str, Any], out: Path, extra: Sequence[Path]) -> None:
    """Record the add-on corpora of a new run; a resumed run must name the same ones, or
    its batches and mined pool would change under it."""
    extras = [str(p) for p in extra]
    if info.setdefault("extra_manifests", extras) != extras:
        raise ConfigError(
            f"--resume: the run in {out} was trained with --extra-corpus "
            f"{info['extra_manifests'] or 'none'}, this run names {extras or 'none'}"
        )


def _segment_end(step: int, s: PretrainSettings) -> int:
    """The step before which the pool is next renewed (the run's end without mining)."""
    if s.hard_negative_share <= 0:
        return s.total_steps
    return min(s.total_steps, (step // s.mine_every_steps + 1) * s.mine_every_steps)


def _train_segment(run: _Run, first: int, end: int) -> tuple[int, bool]:
    """Train steps `first` to `end`; returns the next step and whether the run stops (done,
    or out of time in this call)."""
    s, info = run.s, run.info
    step = first
    batches = (
        (run.cache.batch(k, s, run.cache_pool) for k in range(first, min(end, s.total_steps)))
        if run.cache is not None
        else batch_stream(run.data, first, s, workers=s.workers, end_step=end)
    )
    for step, (x, y) in enumerate(batches, start=first):
        loss = train_step(
            run.model, run.opt, x, y, step, run.gen, s, run.teacher, info.get("continued_at_step")
        )
        run.running = loss if run.running is None else 0.98 * run.running + 0.02 * loss
        info["step"] = step + 1
        info["seconds"] = run.seconds0 + time.monotonic() - run.t0
        run.bar.update(1)
        done = step + 1 >= s.total_steps
        out_of_time = _out_of_time(
            run.t0, run.max_minutes, step + 1 - run.start_step, run.max_steps
        )
        if (step + 1) % s.eval_every_steps == 0 or done or out_of_time:
            metrics = _validate_and_record(run.out, run.model, run.data, s, info, step, run.running)
            run.bar.set_postfix(
                loss=f"{run.running:.3f}",
                frr=f"{metrics['frr']:.3f}",
                best=f"{info['best']['frr']:.3f}",
            )
        if done or out_of_time or time.monotonic() - run.last_ckpt > s.checkpoint_minutes * 60:
            save_state(run.out, run.model, run.opt, info)
            save_last(run.out, run.model)
            run.last_ckpt = time.monotonic()
        if done or out_of_time:
            return step + 1, True
    return end, False


def _progress_bar(s: PretrainSettings, step: int, progress: bool) -> Any:
    """The run's tqdm bar over its steps, starting at `step`."""
    from tqdm import tqdm

    return tqdm(
        total=s.total_steps,
        initial=step,
        desc=f"pretrain w{s.width}",
        unit="step",
        disable=bar_disabled(progress),
    )


def _load_data(
    manifest: Path, window: int, s: PretrainSettings, progress: bool, extra: Sequence[Path]
) -> PretrainData:
    """The run's decoded audio: validation from `s.val_corpus` when set, the field
    augmentation's rooms and the speech backgrounds when they are on."""
    val = Path(s.val_corpus) if s.val_corpus else None
    rooms = 24 if s.field_augment > 0 else 0
    data = load_pretrain_data(
        manifest, window, s.val_stream_seconds, progress, s.seed, extra, val, rooms
    )
    if s.speech_backgrounds > 0 or s.context_speech > 0:
        from wakefl.tools.augmentation.speech_backgrounds import SpeechBackgrounds

        speech = narrow_to_speech_source(data, s.speech_source)
        data.speech = SpeechBackgrounds.make(speech, s.seed)
    return data


def _window_cache(run: _Run, manifest: Path, extra: list[Path], progress: bool) -> Any:
    """The run's window cache, rendered first where it lacks chunks."""
    import copy

    from wakefl.tools.training.window_cache import (
        WindowCache,
        render_settings,
        render_window_cache,
    )

    s = run.s
    frontend = copy.deepcopy(run.model.frontend).cpu().float().eval()
    cfg = {k: v for k, v in run.model.cfg.to_dict().items() if k in FRONTEND_KEYS}
    meta = render_settings(s, manifest, extra, cfg)
    folder = Path(s.window_cache)
    render_window_cache(folder, run.data, s, frontend, meta, s.cache_windows, progress)
    return WindowCache.load(folder)


# The model settings a cached window depends on (its log-mel frontend).
FRONTEND_KEYS = ("sample_rate", "window_s", "n_mels", "win_ms", "hop_ms", "n_fft", "f_min", "f_max")


def pretrain(
    manifest: Path,
    out: Path,
    s: PretrainSettings,
    resume: bool = False,
    init_from: Path | None = None,
    max_minutes: float | None = None,
    progress: bool = True,
    max_steps: int | None = None,
    extra: Sequence[Path] = (),
    start_step: int = 0,
) -> dict[str, Any]:
    """Train (or resume) into `out`; returns the final state info. Stops at `s.samples` or
    after `max_minutes` or `max_steps` in this call (checkpointing first). `init_from` starts a
    new run from saved weights (no optimizer state), at `start_step` of the schedule when
    given; `extra` corpora add training audio."""
    import torch

    from wakefl.sdk.atomic_files import write_atomic

    _check_start_step(start_step, s, resume, init_from)
    model, opt = _new_run(out, s, resume)
    info = _start_info(out, s, manifest, model, opt, resume, init_from, extra)
    if start_step:
        info.update(step=start_step, continued_at_step=start_step)
    teacher = load_teacher(s, model, info, out)  # checked before the corpus's long decode
    data = _load_data(manifest, model.cfg.window_samples, s, progress, extra)
    step = int(info["step"])
    bar = _progress_bar(s, step, progress)
    now = time.monotonic()
    run = _Run(
        out=out,
        model=model,
        opt=opt,
        data=data,
        s=s,
        info=info,
        gen=torch.Generator(),
        bar=bar,
        t0=now,
        last_ckpt=now,
        seconds0=float(info["seconds"]),
        start_step=step,
        max_minutes=max_minutes,
        max_steps=max_steps,
        teacher=teacher,
    )
    if s.window_cache:
        run.cache = _window_cache(run, manifest, list(extra), progress)
    if s.hard_negative_share > 0 and info.get("hard_pool"):
        restore_pool(run)
    model.train()
    stopped = False
    while step < s.total_steps and not stopped:
        if s.hard_negative_share > 0 and (step % s.mine_every_steps == 0 or not has_pool(run)):
            mine_pool(run, step)
        step, stopped = _train_segment(run, step, _segment_end(step, s))
    bar.close()
    write_atomic(out / STATE_INFO, (json.dumps(info, indent=1) + "\n").encode())
    return info
