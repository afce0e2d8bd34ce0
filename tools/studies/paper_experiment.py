"""The Self-FL paper's wake-word study on the wakefl corpus (paper Section 5, Tables 2, 5, 6
and Figures 11-12): Self-FL against FedAvg-w/-e, DITTO-w/-e, Per-FedAvg, pFedMe, pFedVEM,
local fine-tuning and local-only training, all started from the same warm-start model and
judged by relative FA at matched FR against it on held-out test speakers.

Settings:
* "full-participation": 5 clients, one per device type, every client active every round.
* "sampling-0.25" / "sampling-0.1": 20 clients, 4 per device type (each device type's
  training speakers split into 4 disjoint groups), activity rate C; Self-FL client-level
  against cluster-level (clusters = device types), reported per device state.

Tuning: every method gets the same grid of learning rates (the one hyperparameter every
method has); each grid point is a full federated run in the full-participation setting,
scored on the validation speakers, and the best point's run is then evaluated on the test
speakers. The sampling settings reuse Self-FL's selected learning rate.

Evaluation: per device type, the warm start's threshold is fixed where its FR meets the
target on all of that device type's test clips and each candidate's is matched to that FR;
device-state rows count within the state at those thresholds. Intervals: paired percentile
bootstrap over test speakers (background-only clips each their own unit). Each Self-FL cell
is also compared with the best other method of that cell by a paired bootstrap of the FA
ratio ("comparisons").

The served-model gate ("gate"): for every client of every Self-FL run, the gate a device
runs (`wakefl.sdk.served_model_gate.decide_served_model`) decides, on its device type's
validation speakers, whether the client serves its personalized model, the global model or
keeps the warm start (one decision at the end of the run, from the warm start: the device
serves the warm start until the gate admits another model); the served model is then scored
on the test speakers like the other cells, beside the client's personalized model alone.

The result is a plain dict `{"config": ..., "rows": [...], "step_counts": [...],
"comparisons": [...], "gate": [...]}`; `wakefl.tools.studies.paper_report` turns it into the
Markdown tables and the plots.
"""

from __future__ import annotations

import hashlib
import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.errors import ConfigError, NonFiniteError
from wakefl.progress_bars import bar_disabled
from wakefl.recorded_paths import recorded_path

SETTING_FULL = "full-participation"
ACTIVITY_RATES = (0.25, 0.1)
STATES = ("normal", "playback", "alarm")
ALL_STATES = "all"

# Methods of paper Table 2, in its row order (local-only training added as a floor).
METHODS: tuple[str, ...] = (
    "selffl", "selffl-alg2", "fedavg-w", "fedavg-e", "ditto-w", "ditto-e",
    "perfedavg", "pfedme", "pfedvem", "finetune", "local",
)  # fmt: skip
METHOD_LABELS: dict[str, str] = {
    "selffl": "Self-FL (Alg. 1)",
    "selffl-alg2": "Self-FL (Alg. 2)",
    "fedavg-w": "FedAvg-w",
    "fedavg-e": "FedAvg-e",
    "ditto-w": "DITTO-w",
    "ditto-e": "DITTO-e",
    "perfedavg": "Per-FedAvg (FO)",
    "pfedme": "pFedMe",
    "pfedvem": "pFedVEM",
    "finetune": "Local fine-tuning",
    "local": "Local only",
    "selffl-client": "Self-FL client-level",
    "selffl-cluster": "Self-FL cluster-level",
}
# Self-FL's deviations from the paper switched back to the paper's rules (docs/SELF_FL.md,
# "Deliberate deviations"), each an ablation row: `run_paper_study(selffl_ablations=...)`.
SELFFL_ABLATIONS: dict[str, dict[str, Any]] = {
    "paper-rules": {
        "eqn10": "paper",
        "eqn10_max_factor": None,
        "step_rate_loss": "sum",
        "early_variance": False,
        "max_local_epochs": None,
    },
    "paper-eqn10": {"eqn10": "paper", "eqn10_max_factor": None},
    "paper-rate": {"step_rate_loss": "sum"},
    "no-early-variance": {"early_variance": False},
    "no-data-cap": {"max_local_epochs": None},
}
# Methods whose "global" model is not a federated model (local-only keeps the warm start).
NO_GLOBAL = frozenset({"local"})
# Selection score given to a grid point whose relative FA is unbounded (baseline FA = 0).
_UNBOUNDED_SCORE = 1e3


@dataclass(frozen=True)
class StudyProfile:
    """Sizes of one run of the study. `local_steps` is the fixed step count of the
    baselines (20 in the paper), `l_max` Self-FL's cap (40 in the paper)."""

    name: str
    corpus_profile: str
    width: float
    rounds: int
    sampling_rounds: int
    batch_size: int
    local_steps: int
    l_max: int
    inner_steps: int  # pFedMe's inner proximal steps per local step
    converge_steps: int  # Self-FL Algorithm 2's extra steps towards local convergence
    lr_grid: tuple[float, ...]
    warm_epochs: int
    n_boot: int
    target_fr: float
    clients_per_type: int = 4
    eval_batch_size: int = 64


PROFILES: dict[str, StudyProfile] = {
    "tiny": StudyProfile("tiny", "tiny", width=0.125, rounds=3, sampling_rounds=6,
                         batch_size=16, local_steps=4, l_max=8, inner_steps=2,
                         converge_steps=8, lr_grid=(0.05,), warm_epochs=4, n_boot=100,
                         target_fr=0.1),
    "small": StudyProfile("small", "small", width=0.25, rounds=8, sampling_rounds=16,
                          batch_size=32, local_steps=10, l_max=20, inner_steps=3,
                          converge_steps=20, lr_grid=(0.01, 0.03, 0.1), warm_epochs=8,
                          n_boot=1000, target_fr=0.05),
    "full": StudyProfile("full", "full", width=1.0, rounds=30, sampling_rounds=60,
                         batch_size=32, local_steps=20, l_max=40, inner_steps=5,
                         converge_steps=100, lr_grid=(0.01, 0.02, 0.05), warm_epochs=12,
                         n_boot=1000, target_fr=0.05),
}  # fmt: skip


def resolve_profile(
    name: str, width: float | None = None, rounds: int | None = None
) -> StudyProfile:
    """The named profile, with the width and round count optionally overridden (the sampling
    settings keep their ratio of rounds to the full-participation rounds)."""
    if name not in PROFILES:
        raise ConfigError(f"unknown study profile {name!r}; choose one of {', '.join(PROFILES)}")
    prof = PROFILES[name]
    if width is not None:
        if not 0.0 < width <= 4.0:
            raise ConfigError(f"--width must be in (0, 4], got {width}")
        prof = replace(prof, width=float(width))
    if rounds is not None:
        if rounds < 1:
            raise ConfigError(f"--rounds must be >= 1, got {rounds}")
        ratio = prof.sampling_rounds / prof.rounds
        prof = replace(prof, rounds=int(rounds), sampling_rounds=max(1, round(rounds * ratio)))
    return prof


# --------------------------------------------------------------------------------------
# Pure rules: hyperparameters, client splits, selection
# --------------------------------------------------------------------------------------


def method_hyperparams(
    method: str, lr: float, prof: StudyProfile, head: slice | None = None
) -> dict[str, Any]:
    """Keyword hyperparameters of `method` for grid point `lr`. Every method's own
    learning rate(s) follow the grid point; step counts follow the profile, as in the
    paper (fixed `local_steps` for the baselines, cap `l_max` for Self-FL)."""
    k = prof.local_steps
    if method in ("selffl", "selffl-alg2"):
        hp: dict[str, Any] = {
            "lr": lr,
            "batch_size": prof.batch_size,
            "l_max": prof.l_max,
            "warmup_steps": k,
        }
        if method == "selffl-alg2":
            hp["converge_steps"] = prof.converge_steps
        return hp
    if method in ("fedavg-w", "fedavg-e", "local"):
        return {"lr": lr, "local_steps": k}
    if method in ("ditto-w", "ditto-e"):
        return {"lr": lr, "local_steps": k}
    if method == "perfedavg":
        return {"alpha": lr, "beta": lr, "local_steps": k}
    if method == "pfedme":
        return {"lr": lr, "personal_lr": lr, "local_steps": k, "inner_steps": prof.inner_steps}
    if method == "pfedvem":
        return {"head": head, "lr": lr, "local_steps": k}
    if method == "finetune":
        return {"lr": lr, "local_steps": k, "finetune_steps": k}
    raise ConfigError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def split_speakers(counts: dict[str, int], n_clients: int) -> list[list[str]]:
    """Partition speakers into `n_clients` disjoint groups of similar clip counts: largest
    speaker first onto the currently smallest group (ties by name, so it is deterministic)."""
    if len(counts) < n_clients:
        raise ConfigError(
            f"cannot split {len(counts)} training speakers into {n_clients} clients: "
            "use a larger corpus profile"
        )
    groups: list[list[str]] = [[] for _ in range(n_clients)]
    sizes = [0] * n_clients
    for spk in sorted(counts, key=lambda s: (-counts[s], s)):
        i = min(range(n_clients), key=lambda j: (sizes[j], j))
        groups[i].append(spk)
        sizes[i] += counts[spk]
    return [sorted(g) for g in groups]


def selection_score(values: Sequence[float | None]) -> float:
    """Mean relative FA over device types and models on the validation speakers (lower is
    better); an unbounded ratio counts as a large penalty rather than breaking the mean."""
    vals = [_UNBOUNDED_SCORE if v is None else float(v) for v in values]
    return float(np.mean(vals)) if vals else _UNBOUNDED_SCORE


def client_id(device_type: str, index: int | None = None) -> str:
    return device_type if index is None else f"{device_type}-{index}"


# --------------------------------------------------------------------------------------
# Evaluation sets and scoring
# --------------------------------------------------------------------------------------


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
    from wakefl.sdk.wake_metrics import relative_by_subset

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
        out[ALL_STATES]["relative_fr_at_matched_clip_fa"] = matched_fa_record(
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
    from wakefl.sdk.wake_metrics import relative_fr_at_matched_clip_fa

    pos, neg = labels == 1, labels == 0
    res = relative_fr_at_matched_clip_fa(
        base[pos], base[neg], cand[pos], cand[neg], target_fr,
        (units[pos], units[neg]), n_boot, seed,
    )  # fmt: skip
    lo, hi = res.relative_fr_ci
    return {
        "relative_fr": _round(res.relative_fr),
        "relative_fr_ci": [_round(lo), _round(hi)],
        "unbounded": res.unbounded,
        "baseline_fr": _round(res.baseline_fr),
        "candidate_fr": _round(res.candidate_fr),
        "fa_level": _round(res.fa_level),
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
        "relative_fa": _round(cell.relative_fa),
        "relative_fr": _round(cell.relative_fr),
        "relative_fa_ci": [_round(lo), _round(hi)],
        "baseline_fr": _round(cell.baseline_fr),
        "baseline_fa": _round(cell.baseline_fa),
        "candidate_fr": _round(cell.candidate_fr),
        "candidate_fa": _round(cell.candidate_fa),
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
    from wakefl.sdk.wake_metrics import (
        baseline_threshold,
        fa_at,
        fr_at,
        matched_threshold,
        percentile_interval,
        safe_ratio,
    )

    labels = ev.labels
    base, a, b = ev.baseline_scores, np.asarray(scores_a), np.asarray(scores_b)

    def ratio(ip: np.ndarray, ineg: np.ndarray) -> float:
        fr_b = fr_at(base[ip], baseline_threshold(base[ip], target_fr))
        fa_a = fa_at(a[ineg], matched_threshold(a[ip], fr_b))
        fa_b = fa_at(b[ineg], matched_threshold(b[ip], fr_b))
        r, _ = safe_ratio(fa_a, fa_b, "FA")
        return math.inf if r is None else r

    pos_idx, neg_idx = np.flatnonzero(labels == 1), np.flatnonzero(labels == 0)
    if pos_idx.size == 0 or neg_idx.size == 0:
        return {"ratio": None, "ci": [None, None]}
    point = ratio(pos_idx, neg_idx)
    keys = np.unique(ev.speakers)
    members = [np.flatnonzero(ev.speakers == k) for k in keys]
    is_pos = labels == 1
    rng = np.random.default_rng([seed, 17])
    values: list[float] = []
    for _ in range(n_boot):
        drawn = np.concatenate([members[i] for i in rng.integers(0, keys.size, keys.size)])
        ip, ineg = drawn[is_pos[drawn]], drawn[~is_pos[drawn]]
        if ip.size and ineg.size:
            values.append(ratio(ip, ineg))
    lo, hi = percentile_interval(values, level)
    return {"ratio": _finite_or_none(point), "ci": [_round(lo), _round(hi)]}


def _finite_or_none(x: float) -> float | None:
    return None if math.isinf(x) else _round(x)


SELFFL_METHODS = ("selffl", "selffl-alg2")


def compare_with_best_other(
    study: PaperStudy,
    runs: dict[str, MethodRun],
    rows: Sequence[dict[str, Any]],
    n_boot: int,
) -> list[dict[str, Any]]:
    """For each Self-FL variant, model and device type (full participation, all states):
    the other method with the lowest relative FA on the test set, and the paired ratio of
    Self-FL's FA to that method's FA. Picking the best competitor on the test set itself
    favours the competitor, so a Self-FL win here is conservative."""
    idx = {
        (r["method"], r["model"], r["device_type"]): r
        for r in rows
        if r["setting"] == SETTING_FULL and r["state"] == ALL_STATES
    }
    out: list[dict[str, Any]] = []
    for sf in SELFFL_METHODS:
        if sf not in runs:
            continue
        for model in ("global", "personalized"):
            for dt in study.device_types:
                others = {
                    m: idx[(m, model, dt)]["relative_fa"]
                    for m in runs
                    if m not in SELFFL_METHODS
                    and (m, model, dt) in idx
                    and idx[(m, model, dt)]["relative_fa"] is not None
                }
                if not others or (sf, model, dt) not in idx:
                    continue
                best = min(sorted(others), key=lambda m: others[m])
                a, _ = study.candidate_scores(runs[sf], model, dt, "test")
                b, _ = study.candidate_scores(runs[best], model, dt, "test")
                cmp_ = paired_fa_ratio(
                    study.evalsets["test"][dt], a, b, study.prof.target_fr, n_boot, study.seed
                )
                out.append(
                    {
                        "setting": SETTING_FULL,
                        "method": sf,
                        "model": model,
                        "device_type": dt,
                        "state": ALL_STATES,
                        "best_other": best,
                        "best_other_relative_fa": others[best],
                        "ratio_to_best_other": cmp_["ratio"],
                        "ratio_to_best_other_ci": cmp_["ci"],
                    }
                )
    return out


def _round(x: float | None) -> float | None:
    # Rounded so that the JSON and the tables are byte-stable across platforms' last bits.
    return None if x is None else round(float(x), 6)


# --------------------------------------------------------------------------------------
# The study
# --------------------------------------------------------------------------------------


@dataclass
class MethodRun:
    """A finished federated run, reduced to what evaluation needs."""

    method: str
    lr: float
    global_params: Any
    personal: dict[str, Any]  # client id -> personalized flat parameters
    records: list[Any]
    participation: dict[str, int]
    seconds: float


class PaperStudy:
    """Holds the corpus, the warm-start model and the clients; runs methods and evaluates."""

    def __init__(
        self,
        manifest: Path,
        prof: StudyProfile,
        seed: int,
        cache_dir: Path | None,
        progress: bool,
        log: Callable[[str], None],
        baseline: str | None = None,
    ) -> None:
        import torch

        from wakefl.models.kws_cnn import KwsCnn, get_flat_params, head_slice, load_model
        from wakefl.sdk.manifest import read_manifest
        from wakefl.tools.training.warm_start import resolve_baseline

        self.prof, self.seed, self.progress, self.log = prof, seed, progress, log
        self.manifest = manifest
        rows = read_manifest(manifest)
        self.device_types = sorted(
            {r.device_type for r in rows if r.kind == "clip" and r.split == "train"}
        )
        if not self.device_types:
            raise ConfigError(f"{manifest}: no training clips")
        log(f"[study] warm start ({baseline or 'pretrained'}), width {prof.width}")
        ckpt = resolve_baseline(
            baseline,
            manifest,
            width=prof.width,
            seed=seed,
            cache_dir=cache_dir,
            epochs=prof.warm_epochs,
            progress=progress,
        )
        self.baseline_path = ckpt
        start = load_model(ckpt)
        self.cfg = start.cfg
        self.initial = get_flat_params(start)
        torch.manual_seed(seed)
        self.model = KwsCnn(self.cfg)  # one shared model: every oracle loads its params
        self.head = head_slice(self.model)
        self.scorer = Scorer(self.model, prof.eval_batch_size)
        self._load_clips(manifest, seed)

    def _load_clips(self, manifest: Path, seed: int) -> None:
        """Each device type's training set, and its validation and test clips stacked and
        scored by the warm start."""
        import torch

        from wakefl.sdk.dataset import WakeWordDataset
        from wakefl.tools.evaluation.evaluate import bootstrap_units

        ws = self.cfg.window_samples
        self.train: dict[str, Any] = {}
        self.evalsets: dict[str, dict[str, EvalSet]] = {"val": {}, "test": {}}
        for dt in self.device_types:
            self.train[dt] = WakeWordDataset(manifest, dt, "train", window_samples=ws, seed=seed)
            for split in ("val", "test"):
                ds = WakeWordDataset(manifest, dt, split, window_samples=ws, seed=seed)
                # One stacked tensor: every model scores these clips, and batching a tensor
                # skips the per-item collation of a DataLoader.
                waves = torch.stack([ds[i][0] for i in range(len(ds))])
                self.evalsets[split][dt] = EvalSet(
                    device_type=dt,
                    dataset=waves,
                    labels=ds.labels.copy(),
                    states=np.array([r.state for r in ds.rows]),
                    speakers=bootstrap_units([r.speaker for r in ds.rows]),
                    baseline_scores=np.zeros(0),
                )
                self.evalsets[split][dt].baseline_scores = self.scorer(
                    self.initial, self.evalsets[split][dt], split
                )

    # ---- clients --------------------------------------------------------------------
    def problems(self, per_type: int | None) -> tuple[dict[str, Any], dict[str, str]]:
        """Local problems: one client per device type (`per_type=None`) or `per_type`
        clients per device type over disjoint speaker groups; and client -> device type."""
        from torch.utils.data import Subset

        from wakefl.sdk.local_training import TorchLocalProblem

        problems: dict[str, Any] = {}
        groups: dict[str, str] = {}
        for dt in self.device_types:
            ds = self.train[dt]
            if per_type is None:
                problems[client_id(dt)] = TorchLocalProblem(self.model, ds, self.prof.batch_size)
                groups[client_id(dt)] = dt
                continue
            counts: dict[str, int] = {}
            for r in ds.rows:
                counts[r.speaker] = counts.get(r.speaker, 0) + 1
            for i, spk in enumerate(split_speakers(counts, per_type)):
                keep = set(spk)
                idx = [j for j, r in enumerate(ds.rows) if r.speaker in keep]
                cid = client_id(dt, i)
                problems[cid] = TorchLocalProblem(self.model, Subset(ds, idx), self.prof.batch_size)
                groups[cid] = dt
        return problems, groups

    # ---- runs -----------------------------------------------------------------------
    def run_method(
        self,
        method: str,
        lr: float,
        problems: dict[str, Any],
        groups: dict[str, str],
        rounds: int,
        activity_rate: float,
        cluster: bool = False,
        overrides: dict[str, Any] | None = None,
    ) -> MethodRun:
        from tqdm import tqdm

        from wakefl.sdk.selffl.registry import make_strategy
        from wakefl.sdk.selffl.simulation import run_simulation

        hp = method_hyperparams(method, lr, self.prof, self.head)
        if cluster:
            hp["cluster_by_group"] = True
        hp.update(overrides or {})
        strategy = make_strategy(method, **hp)
        start = time.perf_counter()
        label = METHOD_LABELS.get(method, method) + (" cluster" if cluster else "")
        bar = tqdm(
            total=rounds,
            desc=f"{label} lr={lr:g} C={activity_rate:g}",
            unit="round",
            disable=bar_disabled(self.progress),
            leave=False,
        )
        try:
            sim = run_simulation(
                strategy,
                problems,
                self.initial,
                rounds=rounds,
                activity_rate=activity_rate,
                seed=self.seed,
                groups=groups,
                on_round=lambda *_: bar.update(1),
            )
        finally:
            bar.close()
        return MethodRun(
            method=method,
            lr=lr,
            global_params=strategy.global_params(sim.server),
            personal=self._personalized(strategy, sim, problems, rounds),
            records=sim.records,
            participation=dict(sim.participation),
            seconds=time.perf_counter() - start,
        )

    def _personalized(
        self, strategy: Any, sim: Any, problems: dict[str, Any], rounds: int
    ) -> dict[str, Any]:
        """Client id -> its personalized flat parameters after the run (each client's
        generator seeded for round `rounds` + 1)."""
        from wakefl.sdk.selffl.simulation import client_generator

        return {
            cid: strategy.personalized_params(
                sim.server,
                sim.clients[cid],
                problems[cid],
                client_generator(self.seed, rounds + 1, i),
                client_id=cid,
            )
            .detach()
            .clone()
            for i, cid in enumerate(sorted(problems))
        }

    # ---- evaluation -----------------------------------------------------------------
    def candidate_scores(
        self, run: MethodRun, model: str, dt: str, split: str
    ) -> tuple[np.ndarray, int]:
        ev = self.evalsets[split][dt]
        if model == "global":
            return self.scorer(run.global_params, ev, split), 1
        clients = sorted(c for c in run.personal if c == dt or c.startswith(dt + "-"))
        scores = [self.scorer(run.personal[c], ev, split) for c in clients]
        return np.concatenate(scores), len(scores)

    def collect_det(self, det: dict[str, dict[str, Any]], setting: str, run: MethodRun) -> None:
        """Test scores of the baseline and of `run`'s models, for the DET plots."""
        for model in ("global", "personalized"):
            if model == "global" and run.method in NO_GLOBAL:
                continue
            for dt in self.device_types:
                ev = self.evalsets["test"][dt]
                cell = det.setdefault(f"{setting}/{model}", {}).setdefault(
                    dt, {"labels": ev.labels, "scores": {"baseline": ev.baseline_scores}}
                )
                scores, repeats = self.candidate_scores(run, model, dt, "test")
                if repeats == 1:
                    cell["scores"][run.method] = scores

    def diverged_rows(
        self, method: str, states: Sequence[str], failures: dict[str, str]
    ) -> list[dict[str, Any]]:
        """Cells of a method none of whose grid points trained to finite parameters."""
        note = "diverged: " + "; ".join(f"lr={k}: {v}" for k, v in failures.items())
        return [
            {
                "model": model,
                "device_type": dt,
                "state": state,
                "personalized_models": 0,
                "relative_fa": None,
                "relative_fr": None,
                "relative_fa_ci": [None, None],
                "note": note,
            }
            for model in ("global", "personalized")
            if not (model == "global" and method in NO_GLOBAL)
            for dt in self.device_types
            for state in states
        ]

    def evaluate(
        self, run: MethodRun, split: str, states: Sequence[str], n_boot: int
    ) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for model in ("global", "personalized"):
            if model == "global" and run.method in NO_GLOBAL:
                continue
            for dt in self.device_types:
                scores, repeats = self.candidate_scores(run, model, dt, split)
                recs = relative_records(
                    self.evalsets[split][dt],
                    scores,
                    states,
                    self.prof.target_fr,
                    n_boot,
                    self.seed,
                    repeats,
                )
                for state in states:
                    out.append(
                        {
                            "model": model,
                            "device_type": dt,
                            "state": state,
                            "personalized_models": repeats,
                            **recs[state],
                        }
                    )
        return out

    # ---- the served-model gate ------------------------------------------------------
    def gate_rows(self, setting: str, label: str, run: MethodRun) -> list[dict[str, Any]]:
        """Per client of `run`: the gate's choice on the validation speakers of its device
        type, and the test-set relative FA/FR (all states) of the model it then serves and
        of its personalized model."""
        from wakefl.sdk.served_model_gate import decide_served_model

        out = []
        for cid in sorted(run.personal):
            dt = next(d for d in self.device_types if cid == d or cid.startswith(d + "-"))
            val, test = self.evalsets["val"][dt], self.evalsets["test"][dt]
            params = {"personalized": run.personal[cid]}
            if run.method not in NO_GLOBAL:
                params["global"] = run.global_params
            val_scores = {name: self.scorer(p, val, "val") for name, p in params.items()}
            decisions = {
                ties: decide_served_model(
                    val.labels,
                    val.baseline_scores,
                    val_scores,
                    units=val.speakers,
                    served_name="baseline",
                    target_fr=self.prof.target_fr,
                    n_boot=self.prof.n_boot,
                    seed=self.seed,
                    ties=ties,
                )
                for ties in ("keep", "switch")
            }
            models = {
                "served": params.get(decisions["keep"].serve, self.initial),
                "served_ties_switch": params.get(decisions["switch"].serve, self.initial),
                "personalized": params["personalized"],
            }
            recs = {
                name: _gate_record(
                    relative_records(
                        test,
                        self.scorer(p, test, "test"),
                        (ALL_STATES,),
                        self.prof.target_fr,
                        self.prof.n_boot,
                        self.seed,
                    )[ALL_STATES]
                )
                for name, p in models.items()
            }
            out.append(
                {
                    "setting": setting,
                    "method": label,
                    "client": cid,
                    "device_type": dt,
                    "serves": decisions["keep"].serve,
                    "reason": decisions["keep"].reason,
                    "serves_ties_switch": decisions["switch"].serve,
                    **recs,
                }
            )
        return out


def _gate_record(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: rec[k] for k in ("relative_fa", "relative_fa_ci", "relative_fr", "note")}


def _step_rows(
    setting: str, method: str, run: MethodRun, groups: dict[str, str]
) -> list[dict[str, Any]]:
    # sigma_m^2 is what Eqn 16 turned into the client's step count (0 during the warm-up
    # rounds, whose count is the fixed warm-up value); sigma0^2 is the inter-client variance
    # the server computed from this round's updates, used by the next round's rule.
    rows = []
    for rec in run.records:
        for cid, steps in sorted(rec.local_steps.items()):
            rows.append(
                {
                    "setting": setting,
                    "method": method,
                    "client": cid,
                    "device_type": groups[cid],
                    "round": rec.round_id,
                    "local_steps": int(steps),
                    "sigma_sq": _round(rec.sigma_sq.get(cid, 0.0)),
                    "sigma0_sq": _round(rec.sigma0_sq),
                }
            )
    return rows


@dataclass
class _StudyTables:
    """What the study's phases collect for the report."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    step_counts: list[dict[str, Any]] = field(default_factory=list)
    tuning: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    det: dict[str, dict[str, Any]] = field(default_factory=dict)
    selected: dict[str, MethodRun] = field(default_factory=dict)
    gate: list[dict[str, Any]] = field(default_factory=list)


def run_paper_study(
    out_dir: str | Path,
    profile: str = "tiny",
    seed: int = 0,
    rounds: int | None = None,
    width: float | None = None,
    manifest: str | Path | None = None,
    cache_dir: str | Path | None = None,
    methods: Sequence[str] = METHODS,
    sampling_rates: Sequence[float] = ACTIVITY_RATES,
    progress: bool = True,
    log: Callable[[str], None] = print,
    command: str = "",
    baseline: str | None = None,
    selffl_ablations: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the whole study; write `results.json`, `results.md` and the figures into
    `out_dir`; return the result dict. Builds the corpus of the profile into
    `out_dir/corpus` unless `manifest` names an existing one. Every method starts from
    `baseline` (warm_start.resolve_baseline: by default the shipped model of the width).
    `selffl_ablations` (names of SELFFL_ABLATIONS) add Self-FL rows with those rules, at
    the selected learning rate, in settings of their own ("ablation-...")."""
    import torch

    from wakefl.tools.studies.paper_report import write_report

    prof = resolve_profile(profile, width=width, rounds=rounds)
    _check_study_methods(methods, sampling_rates)
    _check_ablations(methods, selffl_ablations)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    manifest_path = _study_manifest(out, manifest, prof, seed, progress, log)
    study = PaperStudy(
        manifest_path, prof, seed, Path(cache_dir) if cache_dir else None, progress, log, baseline
    )
    tables = _StudyTables()
    _full_participation(study, prof, methods, tables, log)
    comparisons = compare_with_best_other(study, tables.selected, tables.rows, prof.n_boot)
    tables.selected.clear()
    selffl_lr = (tables.tuning.get("selffl") or {}).get("selected_lr") or prof.lr_grid[0]
    _client_sampling(study, prof, sampling_rates, selffl_lr, tables, log)
    _selffl_ablations(study, prof, sampling_rates, selffl_lr, selffl_ablations, tables, log)
    config = _study_config(
        study, prof, seed, methods, sampling_rates, manifest_path, tables, selffl_lr, command, out
    )
    result = {
        "config": config,
        "rows": tables.rows,
        "step_counts": tables.step_counts,
        "comparisons": comparisons,
        "gate": tables.gate,
    }
    _describe_ablations(config, selffl_ablations)
    config["seconds_total"] = round(time.perf_counter() - t0, 1)
    write_report(result, out, tables.det)
    return result


def _describe_ablations(config: dict[str, Any], selffl_ablations: Sequence[str]) -> None:
    """Record the ablations' rules in the config and label their Self-FL rows."""
    config["selffl_ablations"] = {a: SELFFL_ABLATIONS[a] for a in selffl_ablations}
    config["method_labels"].update(
        {
            f"{m}+{a}": f"{METHOD_LABELS[m]}, {a}"
            for a in selffl_ablations
            for m in ("selffl", "selffl-client")
        }
    )


def _check_study_methods(methods: Sequence[str], sampling_rates: Sequence[float]) -> None:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(
            f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}"
        )
    if "selffl" not in methods and sampling_rates:
        raise ConfigError("the sampling settings run Self-FL: include 'selffl' in the methods")


def _study_manifest(
    out: Path,
    manifest: str | Path | None,
    prof: StudyProfile,
    seed: int,
    progress: bool,
    log: Callable[[str], None],
) -> Path:
    """The corpus the study runs on: `manifest`, or the profile's corpus built (or reused)
    under `out/corpus`."""
    if manifest is not None:
        manifest_path = Path(manifest)
        if not manifest_path.is_file():
            raise ConfigError(f"manifest not found: {manifest_path}")
        return manifest_path
    from wakefl.tools.corpus.build import build_corpus

    existing = out / "corpus" / "manifest.csv"
    if existing.is_file() and _corpus_matches(out / "corpus", prof.corpus_profile, seed):
        log(f"[study] reusing corpus {existing}")
        return existing
    log(f"[study] building the {prof.corpus_profile} corpus into {out / 'corpus'}")
    return build_corpus(out / "corpus", seed=seed, profile=prof.corpus_profile, progress=progress)


def _tune_method(
    study: PaperStudy,
    prof: StudyProfile,
    method: str,
    problems: Any,
    groups: dict[str, str],
    log: Callable[[str], None],
) -> tuple[MethodRun | None, dict[str, float | None], dict[str, str]]:
    """Every learning rate of the grid in the full-participation setting; the run with the
    best validation score (None when every grid point diverged), the scores, the failures."""
    best: tuple[float, MethodRun] | None = None
    scores: dict[str, float | None] = {}
    failures: dict[str, str] = {}
    for lr in prof.lr_grid:
        log(f"[study] {SETTING_FULL}: {METHOD_LABELS[method]} lr={lr:g}")
        try:
            run = study.run_method(method, lr, problems, groups, prof.rounds, 1.0)
        except NonFiniteError as exc:
            # A diverging grid point is a result, not a crash of the whole study.
            failures[f"{lr:g}"] = str(exc)
            scores[f"{lr:g}"] = None
            log(f"[study]   diverged: {exc}")
            continue
        if len(prof.lr_grid) > 1:
            val = study.evaluate(run, "val", (ALL_STATES,), n_boot=1)
            score = selection_score([r["relative_fa"] for r in val])
        else:
            score = float("nan")  # a one-point grid needs no selection
        scores[f"{lr:g}"] = _round(score) if math.isfinite(score) else None
        if best is None or score < best[0]:
            best = (score, run)
    return (None if best is None else best[1]), scores, failures


def _full_participation(
    study: PaperStudy,
    prof: StudyProfile,
    methods: Sequence[str],
    tables: _StudyTables,
    log: Callable[[str], None],
) -> None:
    """Table 2: every method tuned on the validation speakers, reported on the test ones."""
    problems, groups = study.problems(None)
    for method in methods:
        run, scores, failures = _tune_method(study, prof, method, problems, groups, log)
        hp = method_hyperparams(method, prof.lr_grid[0] if run is None else run.lr, prof)
        tables.tuning[method] = {
            "selected_lr": None if run is None else run.lr,
            "validation_score": scores,
            "diverged": failures,
            "hyperparams": _describe(hp),
        }
        if run is None:
            tables.rows += [
                {"setting": SETTING_FULL, "method": method, **rec}
                for rec in study.diverged_rows(method, (ALL_STATES, *STATES), failures)
            ]
            continue
        tables.selected[method] = run
        tables.timings[f"{SETTING_FULL}/{method}"] = round(run.seconds, 1)
        for rec in study.evaluate(run, "test", (ALL_STATES, *STATES), prof.n_boot):
            tables.rows.append({"setting": SETTING_FULL, "method": method, **rec})
        study.collect_det(tables.det, SETTING_FULL, run)
        if method.startswith("selffl"):
            tables.step_counts += _step_rows(SETTING_FULL, method, run, groups)
            tables.gate += study.gate_rows(SETTING_FULL, method, run)


def _client_sampling(
    study: PaperStudy,
    prof: StudyProfile,
    sampling_rates: Sequence[float],
    selffl_lr: float,
    tables: _StudyTables,
    log: Callable[[str], None],
) -> None:
    """Tables 5 and 6: client- vs cluster-level Self-FL at each activity rate."""
    if not sampling_rates:
        return
    problems, groups = study.problems(prof.clients_per_type)
    for rate in sampling_rates:
        setting = f"sampling-{rate:g}"
        for level, cluster in (("selffl-client", False), ("selffl-cluster", True)):
            log(
                f"[study] {setting}: {METHOD_LABELS[level]} lr={selffl_lr:g}, "
                f"{len(problems)} clients, {prof.sampling_rounds} rounds"
            )
            run = study.run_method(
                "selffl", selffl_lr, problems, groups, prof.sampling_rounds, rate, cluster=cluster
            )
            tables.timings[f"{setting}/{level}"] = round(run.seconds, 1)
            for rec in study.evaluate(run, "test", (ALL_STATES, *STATES), prof.n_boot):
                tables.rows.append({"setting": setting, "method": level, **rec})
            tables.step_counts += _step_rows(setting, level, run, groups)
            tables.gate += study.gate_rows(setting, level, run)


def _check_ablations(methods: Sequence[str], ablations: Sequence[str]) -> None:
    unknown = [a for a in ablations if a not in SELFFL_ABLATIONS]
    if unknown:
        raise ConfigError(
            f"unknown Self-FL ablation(s) {', '.join(unknown)}; choose from "
            f"{', '.join(SELFFL_ABLATIONS)}"
        )
    if ablations and "selffl" not in methods:
        raise ConfigError("the Self-FL ablations need 'selffl' in the methods")


def _selffl_ablations(
    study: PaperStudy,
    prof: StudyProfile,
    sampling_rates: Sequence[float],
    selffl_lr: float,
    ablations: Sequence[str],
    tables: _StudyTables,
    log: Callable[[str], None],
) -> None:
    """Self-FL (Alg. 1) with some of its deviations switched back to the paper's rules:
    full participation and client-level sampling, at the selected learning rate, in
    settings "ablation-full-participation" and "ablation-sampling-<C>" (the tables of the
    main settings are left as they are)."""
    if not ablations:
        return
    runs: list[tuple[str, str, int | None, int, float]] = [
        (f"ablation-{SETTING_FULL}", "selffl", None, prof.rounds, 1.0)
    ]
    if sampling_rates:
        runs += [
            (
                f"ablation-sampling-{rate:g}",
                "selffl-client",
                prof.clients_per_type,
                prof.sampling_rounds,
                rate,
            )
            for rate in sampling_rates
        ]
    for setting, level, per_type, rounds, rate in runs:
        problems, groups = study.problems(per_type)
        for name in ablations:
            label = f"{level}+{name}"
            log(f"[study] {setting}: Self-FL with {name} lr={selffl_lr:g}")
            run = study.run_method(
                "selffl",
                selffl_lr,
                problems,
                groups,
                rounds,
                rate,
                overrides=SELFFL_ABLATIONS[name],
            )
            tables.timings[f"{setting}/{label}"] = round(run.seconds, 1)
            for rec in study.evaluate(run, "test", (ALL_STATES, *STATES), prof.n_boot):
                tables.rows.append({"setting": setting, "method": label, **rec})
            tables.step_counts += _step_rows(setting, label, run, groups)


def _study_config(
    study: PaperStudy,
    prof: StudyProfile,
    seed: int,
    methods: Sequence[str],
    sampling_rates: Sequence[float],
    manifest_path: Path,
    tables: _StudyTables,
    selffl_lr: float,
    command: str,
    out: Path,
) -> dict[str, Any]:
    """results.json's `config`: what ran, on what (paths relative to `out`), how tuned."""
    import torch

    train_sizes = {dt: len(study.train[dt]) for dt in study.device_types}
    return {
        "profile": asdict(prof),
        "seed": seed,
        "methods": list(methods),
        "method_labels": {
            m: METHOD_LABELS[m] for m in (*methods, "selffl-client", "selffl-cluster")
        },
        "device_types": study.device_types,
        "states": list(STATES),
        "settings": [SETTING_FULL, *(f"sampling-{r:g}" for r in sampling_rates)],
        "activity_rates": list(sampling_rates),
        "manifest": recorded_path(manifest_path, out),
        "baseline_checkpoint": recorded_path(study.baseline_path, out),
        "model_params": int(study.initial.numel()),
        "train_clips_per_device_type": train_sizes,
        "test_clips_per_device_type": {
            dt: len(study.evalsets["test"][dt].labels) for dt in study.device_types
        },
        "tuning": {
            "grid": {"lr": list(prof.lr_grid)},
            "selection": (
                "mean relative FA (global and personalized models, every device "
                "type) on the validation speakers; the same grid for every method"
            ),
            "per_method": tables.tuning,
            "sampling_lr": selffl_lr,
        },
        "evaluation": {
            "target_fr": prof.target_fr,
            "ci": (
                "95% percentile bootstrap over test speakers, each background-only clip its "
                "own unit (paired, matching redone per replicate)"
            ),
            "n_boot": prof.n_boot,
            "personalized_sampling": (
                "the 4 personalized models of a device type score every "
                "test clip of it; pooled at one matched-FR threshold"
            ),
        },
        "timings_s": tables.timings,
        "command": command,
        "commit": source_revision(),
        "platform": {"python": platform.python_version(), "torch": torch.__version__},
    }


def _corpus_matches(folder: Path, profile: str, seed: int) -> bool:
    """Whether `folder` holds a synthetic build of today's `profile` with `seed`: a corpus
    left by an earlier version of the profile (other sizes) must not be reused."""
    from wakefl.tools.corpus.build import read_corpus_info
    from wakefl.tools.corpus.plan import PROFILES as CORPUS_PROFILES

    info = read_corpus_info(folder)
    if not isinstance(info, dict):
        return False
    want = asdict(CORPUS_PROFILES[profile]) if profile in CORPUS_PROFILES else None
    return info.get("seed") == seed and info.get("profile") == want


def source_revision() -> str:
    """The git commit of the code that ran (with "+dirty" for uncommitted changes), or
    "unknown" outside a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _describe(hp: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (v if isinstance(v, int | float | str | bool) or v is None else str(v))
        for k, v in hp.items()
        if k != "head"
    }
