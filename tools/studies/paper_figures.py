"""The paper study's figures (`wakefl.tools.studies.paper_experiment`): the evaluation sets and
the scorer, relative FA at matched FR against the warm start with its bootstrap interval,
the paired FA ratio against the best other method, and the records the report reads."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from wakefl.sdk.served_model_gate import unit_draws
from wakefl.sdk.wake_metrics import (
    baseline_threshold,
    clip_fa_curve,
    fa_at,
    fr_at,
    matched_fa_thresholds,
    matched_threshold,
    percentile_interval,
    relative_by_subset,
    relative_fr_at_matched_clip_fa,
    safe_ratio,
)
from wakefl.tools.studies.paper_rules import ALL_STATES

# The row field of the relative FR at matched FA per clip (`matched_fa_record`).
MATCHED_FA = "relative_fr_at_matched_clip_fa"


@dataclass
class EvalSet:
    """One device type's held-out clips with the warm-start model's scores on them."""

    device_type: str
    dataset: Any  # the clips' waveforms [N, window] (or a dataset of (wave, label) items)
    labels: np.ndarray
    states: np.ndarray
    speakers: np.ndarray  # the bootstrap's resampling unit of each clip (`bootstrap_units`)
    baseline_scores: np.ndarray


class Scorer:
    """Scores flat parameter vectors on evaluation sets with one reusable model; results are
    cached by a hash of the parameters, so methods whose personalized model equals their
    global model are scored once."""

    def __init__(self, model: Any, batch_size: int) -> None:
        self.model = model
        self.batch_size = batch_size
        self._cache: dict[tuple[str, str], np.ndarray] = {}

    @staticmethod
    def _key(params: Any) -> str:
        return hashlib.sha1(params.detach().contiguous().numpy().tobytes()).hexdigest()

    def __call__(self, params: Any, ev: EvalSet, split: str) -> np.ndarray:
        from wakefl.models.kws_cnn import set_flat_params
        from wakefl.sdk.local_training import predict_scores

        key = (self._key(params), f"{split}:{ev.device_type}")
        if key not in self._cache:
            set_flat_params(self.model, params)
            self._cache[key] = predict_scores(self.model, ev.dataset, batch_size=self.batch_size)
        return self._cache[key]


def relative_records(
    ev: EvalSet,
    cand_scores: np.ndarray,
    states: Sequence[str],
    target_fr: float,
    n_boot: int,
    seed: int,
    repeats: int = 1,
) -> dict[str, dict[str, Any]]:
    """Relative FA/FR (with a speaker-bootstrap CI) of candidate scores on `ev`, per entry
    of `states` (a device state, or "all" for every clip), by the one routine `wakefl eval`
    uses too (`wakefl.sdk.wake_metrics.relative_by_subset`): both models at their operating
    points on the whole device type's clips, each state counted at those thresholds.
    `repeats` > 1: `cand_scores` holds that many models' scores of the same clips one after
    the other (a device type's fleet of personalized models), compared with the baseline's
    scores repeated alike at one shared threshold."""
    labels = np.tile(ev.labels, repeats)
    clip_states = np.tile(ev.states, repeats)
    masks = {
        st: np.ones(labels.size, bool) if st == ALL_STATES else clip_states == st for st in states
    }
    _, cells = relative_by_subset(
        np.tile(ev.baseline_scores, repeats),
        cand_scores,
        labels,
        np.tile(ev.speakers, repeats),
        masks,
        target_fr,
        n_boot,
        seed,
    )
    out = {st: study_record(cell) for st, cell in cells.items()}
    if ALL_STATES in out and (labels == 1).any() and (labels == 0).any():
        out[ALL_STATES][MATCHED_FA] = matched_fa_record(
            np.tile(ev.baseline_scores, repeats),
            cand_scores,
            labels,
            np.tile(ev.speakers, repeats),
            target_fr,
            n_boot,
            seed,
        )
    return out


def matched_fa_record(
    base: np.ndarray,
    cand: np.ndarray,
    labels: np.ndarray,
    units: np.ndarray,
    target_fr: float,
    n_boot: int,
    seed: int,
) -> dict[str, Any]:
    """Relative FR at matched FA per clip (wake_metrics.relative_fr_at_matched_clip_fa):
    how many fewer wake words the candidate misses at the baseline's false-accept rate, with
    a speaker-bootstrap interval; rounded for byte-stable output."""
    pos, neg = labels == 1, labels == 0
    res = relative_fr_at_matched_clip_fa(
        base[pos], base[neg], cand[pos], cand[neg], target_fr,
        (units[pos], units[neg]), n_boot, seed,
    )  # fmt: skip
    lo, hi = res.relative_fr_ci
    return {
        "relative_fr": stable_round(res.relative_fr),
        "relative_fr_ci": [stable_round(lo), stable_round(hi)],
        "unbounded": res.unbounded,
        "baseline_fr": stable_round(res.baseline_fr),
        "candidate_fr": stable_round(res.candidate_fr),
        "fa_level": stable_round(res.fa_level),
        "note": res.note,
    }


def study_record(cell: Any) -> dict[str, Any]:
    """The study's row fields of one `CellFigures`, rounded for byte-stable output."""
    lo, hi = cell.relative_fa_ci
    return {
        "n_positive": cell.n_positive,
        "n_negative": cell.n_negative,
        "baseline_fa_count": cell.baseline_fa_count,
        "candidate_fa_count": cell.candidate_fa_count,
        "relative_fa": stable_round(cell.relative_fa),
        "relative_fr": stable_round(cell.relative_fr),
        "relative_fa_ci": [stable_round(lo), stable_round(hi)],
        "baseline_fr": stable_round(cell.baseline_fr),
        "baseline_fa": stable_round(cell.baseline_fa),
        "candidate_fr": stable_round(cell.candidate_fr),
        "candidate_fa": stable_round(cell.candidate_fa),
        "note": cell.note,
    }


def paired_fa_ratio(
    ev: EvalSet,
    scores_a: np.ndarray,
    scores_b: np.ndarray,
    target_fr: float,
    n_boot: int,
    seed: int,
    level: float = 0.95,
) -> dict[str, Any]:
    """FA of candidate A over FA of candidate B, both at the FR the warm-start baseline has
    at its operating point on `ev` (so it equals relative_fa(A) / relative_fa(B)), with a
    paired percentile bootstrap over the same resampling units as the cells' intervals:
    every replicate redraws the units, refixes the baseline's threshold and rematches both
    candidates. A ratio whose CI lies wholly below (above) 1 says A beats (loses to) B
    beyond the resampling noise of the test speakers."""
    base, a, b = ev.baseline_scores, np.asarray(scores_a), np.asarray(scores_b)

    def ratio(ip: np.ndarray, ineg: np.ndarray) -> float:
        fr_b = fr_at(base[ip], baseline_threshold(base[ip], target_fr))
        fa_a = fa_at(a[ineg], matched_threshold(a[ip], fr_b))
        fa_b = fa_at(b[ineg], matched_threshold(b[ip], fr_b))
        r, _ = safe_ratio(fa_a, fa_b, "FA")
        return math.inf if r is None else r

    return _paired(ev, ratio, n_boot, seed, level)


def paired_fr_ratio(
    ev: EvalSet,
    scores_a: np.ndarray,
    scores_b: np.ndarray,
    target_fr: float,
    n_boot: int,
    seed: int,
    level: float = 0.95,
) -> dict[str, Any]:
    """FR of candidate A over FR of candidate B, both held to the clip FA the warm-start
    baseline has at its operating point on `ev` (each at its lowest threshold within it, as
    in wake_metrics.relative_fr_at_matched_clip_fa, so it equals relative FR at matched FA
    of A over that of B), with the paired bootstrap of `paired_fa_ratio`. Below 1 beyond the
    CI: A misses fewer wake words than B at the same false accepts."""
    base, a, b = ev.baseline_scores, np.asarray(scores_a), np.asarray(scores_b)

    def held_fr(c: np.ndarray, ip: np.ndarray, ineg: np.ndarray, fa_level: float) -> float:
        _, tc, _, _ = matched_fa_thresholds(
            base[ip], c[ip], clip_fa_curve(base[ineg]), clip_fa_curve(c[ineg]), fa_level
        )
        return fr_at(c[ip], tc)

    def ratio(ip: np.ndarray, ineg: np.ndarray) -> float:
        fa_level = fa_at(base[ineg], baseline_threshold(base[ip], target_fr))
        r, _ = safe_ratio(held_fr(a, ip, ineg, fa_level), held_fr(b, ip, ineg, fa_level), "FR")
        return math.inf if r is None else r

    return _paired(ev, ratio, n_boot, seed, level)


def _paired(
    ev: EvalSet,
    ratio: Callable[[np.ndarray, np.ndarray], float],
    n_boot: int,
    seed: int,
    level: float,
) -> dict[str, Any]:
    """`ratio` on all of `ev`'s clips, with its percentile interval over replicates that
    redraw whole speakers (the cells' resampling units)."""
    labels = ev.labels
    pos_idx, neg_idx = np.flatnonzero(labels == 1), np.flatnonzero(labels == 0)
    if pos_idx.size == 0 or neg_idx.size == 0:
        return {"ratio": None, "ci": [None, None]}
    point = ratio(pos_idx, neg_idx)
    # The served-model gate's own draws (whole speakers, replicates without a wake word or
    # without another clip skipped), so the study's intervals are the gate's.
    draws = unit_draws(
        np.random.default_rng([seed, 17]), np.asarray(ev.speakers), labels == 1, labels == 0, n_boot
    )
    lo, hi = percentile_interval([ratio(ip, ineg) for ip, ineg in draws], level)
    return {"ratio": _finite_or_none(point), "ci": [stable_round(lo), stable_round(hi)]}


def _finite_or_none(x: float) -> float | None:
    return None if math.isinf(x) else stable_round(x)


def stable_round(x: float | None) -> float | None:
    # Rounded so that the JSON and the tables are byte-stable across platforms' last bits.
    return None if x is None else round(float(x), 6)


def gate_record(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: rec[k] for k in ("relative_fa", "relative_fa_ci", "relative_fr", "note")}
