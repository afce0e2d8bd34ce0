"""Publishing a pretraining run as a shipped model: the shipped threshold (from the
validation clips, or from a detection benchmark's streams), fp16 weights, and models mixed
from several runs (a blend of two, a soup of several)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.operating_point import with_shipped_threshold
from wakefl.tools.training.checkpoints import copy_weights
from wakefl.tools.training.settings import BEST, BEST_CARD, HISTORY, STATE_INFO, STATE_WEIGHTS
from wakefl.tools.training.validation import score_batches

if TYPE_CHECKING:
    from torch import Tensor

    from wakefl.models.kws_cnn import KwsCnn


def shipped_operating_point(model: KwsCnn, manifest: Path, target_frr: float) -> dict[str, float]:
    """The shipped threshold: where the validation clips' false-reject rate is `target_frr`
    (a device maker ships a detector that hears its owner), with the clip false-accept rate
    there. The stream false accepts per hour at it are what the detection benchmark reports."""
    from wakefl.sdk.dataset import load_clip
    from wakefl.sdk.manifest import read_manifest

    rows = [r for r in read_manifest(manifest) if r.kind == "clip" and r.split == "val"]
    if not any(r.label == 1 for r in rows):
        raise ConfigError(f"{manifest}: no validation wake-phrase clips to set the threshold on")
    waves = np.stack([load_clip(r.resolve(manifest), model.cfg.window_samples) for r in rows])
    scores = score_batches(model, waves)
    labels = np.array([r.label for r in rows])
    pos, neg = scores[labels == 1], scores[labels == 0]
    thr = float(np.quantile(pos, target_frr, method="lower"))
    return {
        "threshold": thr,
        "val_frr": float(np.mean(pos < thr)),
        "val_clip_far": float(np.mean(neg >= thr)),
        "target_frr": target_frr,
    }


def _last_checkpoint(run: Path, model: KwsCnn, best_card: dict[str, Any]) -> dict[str, Any]:
    """Load the run's last checkpoint into `model` (the best model's architecture) and
    return its card: the best card's settings with the validation figures of that step.
    The validation criterion is noisy on a few validation streams; a benchmark on more
    audio may prefer the last step (MODEL_CARD.md, how `full` was made)."""
    from safetensors.torch import load_file

    try:
        info = json.loads((run / STATE_INFO).read_text(encoding="utf-8"))
        tensors = load_file(str(run / STATE_WEIGHTS))
        history = [json.loads(x) for x in (run / HISTORY).read_text().splitlines() if x.strip()]
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{run}: no readable last checkpoint ({exc})") from None
    step = info.get("step")
    metrics = next((h for h in reversed(history) if h.get("step") == step), None)
    if metrics is None:
        raise ConfigError(f"{run}: the last checkpoint (step {step}) was not validated")
    copy_weights(model, tensors, f"{run}: the last checkpoint does not fit the model")
    keys = ("threshold", "frr", "clip_far", "frr_at_half", "far_at_half", "val_stream_hours")
    validation = {k: metrics[k] for k in keys if k in metrics}
    return {
        **best_card,
        "threshold": metrics["threshold"],
        "validation": validation,
        "step": step,
        "samples": metrics.get("samples"),
        "checkpoint": "last",
    }


def stream_operating_point(
    bench_json: Path, digest: str, fa_per_hour: float = 0.5
) -> dict[str, Any]:
    """The one-threshold-for-all-types operating point at `fa_per_hour` that `bench_detection
    --split val` set on the validation streams, refused unless that benchmark scored these
    very weights (their `weights_digest`) and its streams resolve the FA rate. A target
    other than 0.5 is read from the points `--pooled-fa-per-hour` added."""
    from wakefl.tools.bench.detection_scoring import is_fa_target

    src = f"set-threshold --from {bench_json}"
    if not is_fa_target(fa_per_hour):
        raise ConfigError(f"{src}: an FA/h target is in (0, 10], got {fa_per_hour}")
    try:
        bench = json.loads(Path(bench_json).read_text(encoding="utf-8"))
        rows = bench["fp32"]["validation"]
        if not isinstance(rows, dict):
            raise TypeError(f"validation is a {type(rows).__name__}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{src}: not the JSON of a `bench_detection --split val` run ({exc!r})"
        ) from None
    pooled = _pooled_at(rows, fa_per_hour, src)
    try:
        thr = float(pooled["threshold"])
    except (KeyError, ValueError, TypeError) as exc:
        raise ConfigError(f"{src}: its operating point has no threshold ({exc!r})") from None
    if bench.get("weights_digest") != digest:
        raise ConfigError(
            f"{src}: it scored other weights ({bench.get('model')}); score these with "
            "`bench_detection --weights W --split val --json JSON` and give that JSON"
        )
    target = pooled.get("fa_per_hour_target")
    if not pooled.get("resolved"):
        raise ConfigError(
            f"{src}: {pooled.get('stream_hours')} h of validation stream cannot resolve "
            f"{target} FA/h (build and add `--profile pretrain-valstreams`)"
        )
    if not 0.0 < thr <= 1.0:
        raise ConfigError(
            f"{src}: no threshold keeps the validation streams within {target} FA/h "
            f"(it reports {thr})"
        )
    return {"set_on": "validation streams, all device types", **pooled}


def _pooled_at(rows: dict[str, Any], fa_per_hour: float, src: str) -> dict[str, Any]:
    """The report's one-for-all-types point at `fa_per_hour`: `_pooled` (0.5 FA/h) or one
    of `_pooled_by_target`."""
    from wakefl.tools.bench.detection_scoring import FA_TARGETS, pooled_target_key

    key = pooled_target_key(fa_per_hour)
    extra = rows.get("_pooled_by_target")
    if key == pooled_target_key(FA_TARGETS[0]):  # the rate `_pooled` is set at
        found = rows.get("_pooled")
    else:
        found = extra.get(key) if isinstance(extra, dict) else None
    if not isinstance(found, dict):
        raise ConfigError(
            f"{src}: no point at {key} FA/h in that report; score the validation split "
            f"with `bench_detection --split val --pooled-fa-per-hour {key}`"
        )
    return found


def near_rhyme_operating_point(probe_json: Path, digest: str, fa_per_hour: float) -> dict[str, Any]:
    """The lowest threshold whose false accepts `near_rhyme_rate` projected onto the
    validation streams within `fa_per_hour`, refused unless it scored these very weights."""
    from wakefl.tools.probes.near_rhyme_rate import target_key, threshold_key

    src = f"set-threshold --near-rhymes {probe_json}"
    try:
        probe = json.loads(Path(probe_json).read_text(encoding="utf-8"))
        mine = [r for r in probe.values() if r.get("weights_digest") == digest]
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{src}: not the JSON of a near_rhyme_rate run ({exc!r})") from None
    if not mine:
        raise ConfigError(
            f"{src}: it scored other weights; score these with `python -m "
            "wakefl.tools.probes.near_rhyme_rate --model LABEL=W --json JSON`"
        )
    key = target_key(fa_per_hour)
    try:
        thr = float(mine[0]["thresholds"][key])
        at = mine[0]["at"][threshold_key(thr)]["all types"]
        found = {
            "projected_fa_per_hour": float(at["projected_fa_per_hour"]),
            "speakers": int(mine[0]["speakers"]),
            "pairs": int(mine[0]["pairs"]),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"{src}: no threshold for {key} FA/h in it ({exc!r}); run it with --fa-per-hour {key}"
        ) from None
    if not 0.0 < thr <= 1.0:
        raise ConfigError(f"{src}: no threshold keeps the projection within {key} FA/h")
    return {
        "set_on": "near-rhyme streams, projected onto the validation streams",
        "fa_per_hour_target": fa_per_hour,
        "threshold": thr,
        **found,
    }


def set_stream_threshold(
    weights: Path, bench_json: Path, fa_per_hour: float = 0.5, near_rhymes: Path | None = None
) -> dict[str, Any]:
    """Ship `weights` (a published model: its card and config JSON beside it) at the
    threshold that `bench_detection --split val` set on the validation streams of all
    device types (`stream_operating_point`); the clip-set threshold it replaces stays in
    the card. With the JSON of a `near_rhyme_rate` run on the same weights, at the higher
    of that and the one its projection sets for the same rate (`near_rhyme_operating_point`):
    the validation streams' few speakers have promised fewer false accepts than held-out
    speakers gave. Returns the new card."""
    from wakefl.models.kws_cnn import read_config, weights_digest
    from wakefl.models.kws_cnn.checkpoint import config_path
    from wakefl.models.kws_cnn.pretrained import card_beside
    from wakefl.sdk.atomic_files import write_atomic

    read_config(weights)  # a model this code can load, or a clear error
    card = card_beside(weights)
    if card is None:
        raise ConfigError(f"{weights}: no card beside it; publish the model first")
    digest = weights_digest(weights)
    point = stream_operating_point(bench_json, digest, fa_per_hour)
    card.setdefault("clip_threshold", card["threshold"])
    card["stream_operating_point"] = point
    card["threshold"] = point["threshold"]
    card.pop("near_rhyme_operating_point", None)  # a point set before, on other terms
    if near_rhymes is not None:
        rhymes = near_rhyme_operating_point(near_rhymes, digest, fa_per_hour)
        card["near_rhyme_operating_point"] = rhymes
        card["threshold"] = max(point["threshold"], rhymes["threshold"])
    meta = with_shipped_threshold(
        json.loads(config_path(weights).read_text(encoding="utf-8")), card["threshold"]
    )
    # The card first: a crash between the two leaves the config's old threshold, which
    # a second run mends; never a config that claims a threshold its card lacks.
    card_path = Path(weights).with_suffix(".card.json")
    write_atomic(card_path, (json.dumps(card, indent=1) + "\n").encode())
    write_atomic(config_path(weights), (json.dumps(meta, indent=2) + "\n").encode())
    return card


def _run_manifest(run: Path) -> Path | None:
    """The corpus manifest a run was trained on, when it is still there."""
    if not (run / STATE_INFO).exists():
        return None
    saved = json.loads((run / STATE_INFO).read_text(encoding="utf-8")).get("manifest")
    return Path(saved) if saved and Path(saved).exists() else None


def _round_to_fp16(model: KwsCnn) -> dict[str, Tensor]:
    """The model's parameters in fp16, as they ship. The model takes the rounded values
    too, so that a threshold set with it holds for the shipped file."""
    import torch

    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in model.named_parameters()}
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(tensors[k].float())
    return tensors


def publish(
    run: Path,
    name: str,
    dest: Path | None = None,
    manifest: Path | None = None,
    target_frr: float = 0.05,
    checkpoint: str = "best",
) -> Path:
    """Copy a run's best model (or, with `checkpoint="last"`, its last checkpoint) into the
    shipped-models folder as fp16 safetensors, with its JSON config and operating-point
    card. With a corpus `manifest` (default: the run's own) the shipped threshold is set on
    its validation clips at `target_frr`, scored with the fp16 weights that ship; otherwise
    the run's validation threshold is kept (`set_stream_threshold` may replace it later)."""
    from wakefl.models.kws_cnn import load_model
    from wakefl.models.kws_cnn.pretrained import NAMES, PRETRAINED_DIR

    if name not in NAMES:
        raise ConfigError(f"a shipped model is one of {', '.join(NAMES)}, got {name!r}")
    if checkpoint not in ("best", "last"):
        raise ConfigError(f"checkpoint must be best or last, got {checkpoint!r}")
    dest = PRETRAINED_DIR if dest is None else dest
    dest.mkdir(parents=True, exist_ok=True)
    model = load_model(run / BEST)
    card = json.loads((run / BEST_CARD).read_text(encoding="utf-8"))
    if checkpoint == "last":
        card = _last_checkpoint(run, model, card)
    tensors = _round_to_fp16(model)
    manifest = manifest if manifest is not None else _run_manifest(run)
    if manifest is not None:
        card["threshold_at_val_fa_per_hour"] = card["threshold"]
        card["operating_point"] = shipped_operating_point(model, manifest, target_frr)
        card["threshold"] = card["operating_point"]["threshold"]
    meta = json.loads((run / "best.json").read_text(encoding="utf-8"))
    return _write_shipped(dest / f"{name}.safetensors", tensors, model.cfg, card, meta)


DETECTOR_SETTINGS = ("hop_s", "smoothing", "refractory_s", "phrase", "width")


def publish_blend(
    first: Path,
    second: Path,
    alpha: float,
    name: str,
    manifest: Path,
    dest: Path | None = None,
    target_frr: float = 0.05,
) -> Path:
    """Ship the blend (1 - alpha) * first + alpha * second of two published models as
    fp16 model `name`, at the threshold its fp16 weights give on the validation clips of
    `manifest` at `target_frr` (as `publish` does; `set_stream_threshold` may replace it).
    Its card names both parents by weights digest, so the blend can be made again."""
    from wakefl.models.kws_cnn import load_model, weights_digest
    from wakefl.models.kws_cnn.blend import blend

    settings = _check_parents((first, second), name)
    model = blend(load_model(first), load_model(second), alpha)
    parents = {
        "alpha": float(alpha),
        "first": {"file": Path(first).name, "weights_digest": weights_digest(first)},
        "second": {"file": Path(second).name, "weights_digest": weights_digest(second)},
    }
    card = (settings, {"blend": parents})
    return _publish_mixed(model, first, card, name, manifest, dest, target_frr)


def publish_soup(
    weights: Sequence[Path],
    shares: Sequence[float],
    name: str,
    manifest: Path,
    dest: Path | None = None,
    target_frr: float = 0.05,
) -> Path:
    """Ship the weighted average of several published models (`average`) as fp16 model
    `name`, at its threshold on `manifest`'s validation clips, as `publish_blend` does.
    Its card lists each parent's weights digest and share."""
    from wakefl.models.kws_cnn import load_model, weights_digest
    from wakefl.models.kws_cnn.blend import average

    settings = _check_parents(weights, name)
    model = average([load_model(w) for w in weights], shares)
    parents = [
        {"file": Path(w).name, "weights_digest": weights_digest(w), "share": float(s)}
        for w, s in zip(weights, shares, strict=True)
    ]
    card = (settings, {"soup": parents})
    return _publish_mixed(model, weights[0], card, name, manifest, dest, target_frr)


def _check_parents(weights: Sequence[Path], name: str) -> dict[str, Any]:
    """The detector settings every parent ships; ConfigError unless `name` is a shipped
    model's name and every parent is a published model (a card beside it), all shipping
    the same detector settings."""
    from wakefl.models.kws_cnn.pretrained import NAMES, card_beside

    if name not in NAMES:
        raise ConfigError(f"a shipped model is one of {', '.join(NAMES)}, got {name!r}")
    settings = []
    for w in weights:
        card = card_beside(w)
        if card is None:
            raise ConfigError(f"{w}: no card beside it; mix published models only")
        settings.append({k: card.get(k) for k in DETECTOR_SETTINGS})
    if any(s != settings[0] for s in settings[1:]):
        raise ConfigError(f"the models ship different detector settings: {settings}")
    return settings[0]


def _publish_mixed(
    model: Any,
    config_from: Path,
    card_parts: tuple[dict[str, Any], dict[str, Any]],
    name: str,
    manifest: Path,
    dest: Path | None,
    target_frr: float,
) -> Path:
    """Round a mixed model to fp16, set its threshold on the validation clips and ship it
    with `config_from`'s config JSON and a card of its parents' detector settings, its
    operating point and its provenance (`card_parts`: settings, provenance)."""
    from wakefl.models.kws_cnn.checkpoint import config_path
    from wakefl.models.kws_cnn.pretrained import PRETRAINED_DIR

    tensors = _round_to_fp16(model)
    point = shipped_operating_point(model, manifest, target_frr)
    settings, provenance = card_parts
    card = {**settings, "threshold": point["threshold"], "operating_point": point, **provenance}
    meta = json.loads(config_path(config_from).read_text(encoding="utf-8"))
    dest = PRETRAINED_DIR if dest is None else dest
    dest.mkdir(parents=True, exist_ok=True)
    return _write_shipped(dest / f"{name}.safetensors", tensors, model.cfg, card, meta)


def _write_shipped(
    out: Path, tensors: dict[str, Any], cfg: Any, card: dict[str, Any], meta: dict[str, Any]
) -> Path:
    """Write a shipped model's fp16 weights, config JSON and card; the weights last, by an
    atomic rename, so a crash never leaves a half-written model under its name."""
    from safetensors.torch import save_file

    from wakefl.sdk.atomic_files import write_atomic

    tmp = out.with_name(f".{out.stem}.tmp.safetensors")
    save_file(
        tensors, str(tmp), metadata={"architecture": "kws_cnn", "config": json.dumps(cfg.to_dict())}
    )
    # The config JSON also carries the shipped threshold, where `wakefl eval
    # --at-shipped-threshold` looks for a model's operating point.
    meta = with_shipped_threshold(meta, card["threshold"])
    write_atomic(out.with_suffix(".json"), (json.dumps(meta, indent=2) + "\n").encode())
    write_atomic(out.with_suffix(".card.json"), (json.dumps(card, indent=1) + "\n").encode())
    tmp.chmod(0o644)  # shipped with the package: readable by every user
    tmp.replace(out)
    return out
