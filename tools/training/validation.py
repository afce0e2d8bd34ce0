"""Pretraining's validation: the false-reject rate of the validation clips at the
threshold where the streaming detector's firing rule (edge_runtime/detection_rule.py)
makes at most `val_fa_per_hour` false accepts per hour on the validation streams, and which
of two models is better by it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from wakefl.edge_runtime.detection_rule import (
    DEFAULT_HOP_S,
    DEFAULT_REFRACTORY_S,
    DEFAULT_SMOOTHING,
    count_events,
    hop_samples,
    refractory_hops,
    smoothed,
    stream_windows,
)
from wakefl.tools.training.data import PretrainData
from wakefl.tools.training.settings import PretrainSettings

if TYPE_CHECKING:
    from wakefl.models.kws_cnn import KwsCnn


def threshold_for_fa(
    streams_scores: list[np.ndarray], hours: float, fa_per_hour: float, refractory_hops: int
) -> float:
    """The lowest threshold at which the streams give at most `fa_per_hour` false accepts
    per hour (bisection: the event count falls as the threshold rises)."""
    allowed = math.floor(fa_per_hour * hours + 1e-9)
    lo, hi = 0.0, 1.0 + 1e-9

    def events(t: float) -> int:
        return sum(count_events(sc, t, refractory_hops) for sc in streams_scores)

    if events(lo) <= allowed:
        return lo
    for _ in range(30):
        mid = (lo + hi) / 2
        if events(mid) <= allowed:
            hi = mid
        else:
            lo = mid
    return hi


def score_batches(model: KwsCnn, windows: np.ndarray, batch: int = 256) -> np.ndarray:
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.from_numpy(np.ascontiguousarray(windows[i : i + batch], dtype=np.float32))
            out.append(model.predict_proba(x.to(next(model.parameters()).device)).cpu().numpy())
    return np.concatenate(out) if out else np.zeros(0)


def validate(model: KwsCnn, data: PretrainData, s: PretrainSettings) -> dict[str, float]:
    """FRR on validation clips at the threshold giving `val_fa_per_hour` on the validation
    streams, plus clip-level figures that stay informative before any stream fires."""
    was = model.training
    model.eval()
    try:
        clip_scores = score_batches(model, data.val_clips)
        hop = hop_samples(DEFAULT_HOP_S, 16000)
        stream_scores = [
            smoothed(score_batches(model, stream_windows(w, data.window, hop)), DEFAULT_SMOOTHING)
            for w in data.val_streams
        ]
    finally:
        model.train(was)
    pos = clip_scores[data.val_labels == 1]
    neg = clip_scores[data.val_labels == 0]
    hours = sum(w.size for w in data.val_streams) / 16000 / 3600
    thr = (
        threshold_for_fa(
            stream_scores,
            hours,
            s.val_fa_per_hour,
            refractory_hops(DEFAULT_REFRACTORY_S, DEFAULT_HOP_S, 16000),
        )
        if stream_scores
        else float(np.quantile(neg, 0.99))
    )
    return {
        "threshold": float(thr),
        "frr": float(np.mean(pos < thr)),
        "clip_far": float(np.mean(neg >= thr)),
        "frr_at_half": float(np.mean(pos < 0.5)),
        "far_at_half": float(np.mean(neg >= 0.5)),
        "val_stream_hours": float(hours),
    }


def better(a: dict[str, float], b: dict[str, float] | None) -> bool:
    """Lower FRR at the fixed FA/h wins; on a tie, fewer clip false accepts at 0.5."""
    if b is None:
        return True
    return (a["frr"], a["far_at_half"] + a["frr_at_half"]) < (
        b["frr"],
        b["far_at_half"] + b["frr_at_half"],
    )
