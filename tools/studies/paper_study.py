"""One paper-study run (`wakefl.tools.studies.paper_experiment`): the corpus, the warm-start
model and the clients, the federated run of one method in one setting, and its evaluation
on the held-out speakers."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.errors import ConfigError
from wakefl.progress_bars import bar_disabled
from wakefl.tools.studies.paper_figures import (
    MATCHED_FA,
    EvalSet,
    Scorer,
    gate_record,
    paired_fa_ratio,
    paired_fr_ratio,
    relative_records,
    stable_round,
)
from wakefl.tools.studies.paper_rules import (
    ALL_STATES,
    METHOD_LABELS,
    NO_GLOBAL,
    SETTING_FULL,
    StudyProfile,
    client_id,
    method_hyperparams,
    split_speakers,
)

SELFFL_METHODS = ("selffl", "selffl-alg2")


def compare_with_best_other(
    study: PaperStudy,
    runs: dict[str, MethodRun],
    rows: Sequence[dict[str, Any]],
    n_boot: int,
    setting: str = SETTING_FULL,
    selffl: Sequence[str] = SELFFL_METHODS,
) -> list[dict[str, Any]]:
    """For each Self-FL variant (`selffl`: its names among `runs`, the others being the
    rival methods), model and device type of `setting` (all states): the other method with
    the lowest relative FA on the test set and the paired ratio of Self-FL's FA to that
    method's FA; then the other method with the lowest relative FR at matched FA per clip
    and the paired ratio of Self-FL's FR to its FR there. Picking the best competitor on the
    test set itself favours the competitor, so a Self-FL win here is conservative."""
    idx = {
        (r["method"], r["model"], r["device_type"]): r
        for r in rows
        if r["setting"] == setting and r["state"] == ALL_STATES
    }
    out: list[dict[str, Any]] = []
    for sf in selffl:
        if sf not in runs:
            continue
        for model in ("global", "personalized"):
            for dt in study.device_types:
                if (sf, model, dt) not in idx:
                    continue
                rec = {"setting": setting, "method": sf, "model": model}
                rec.update(device_type=dt, state=ALL_STATES)
                for figure in ("fa", "fr"):
                    rec.update(
                        _against_best_other(
                            study, runs, idx, (sf, model, dt), figure, n_boot, selffl
                        )
                    )
                if "best_other" in rec:
                    out.append(rec)
    return out


def _against_best_other(
    study: PaperStudy,
    runs: dict[str, MethodRun],
    idx: dict[tuple[str, str, str], dict[str, Any]],
    cell: tuple[str, str, str],
    figure: str,
    n_boot: int,
    selffl: Sequence[str],
) -> dict[str, Any]:
    """One comparison of `compare_with_best_other` for `cell` (Self-FL variant, model,
    device type): by relative FA ("fa", the keys best_other, best_other_relative_fa,
    ratio_to_best_other[_ci]) or by relative FR at matched FA per clip ("fr", the same keys
    with an `fr_` in front); {} without rivals."""
    sf, model, dt = cell

    def value(m: str) -> float | None:
        row = idx.get((m, model, dt))
        if row is None:
            return None
        if figure == "fa":
            return row["relative_fa"]
        return (row.get(MATCHED_FA) or {}).get("relative_fr")

    others = {m: v for m in runs if m not in selffl and (v := value(m)) is not None}
    if not others:
        return {}
    best = min(sorted(others), key=lambda m: others[m])
    a, _ = study.candidate_scores(runs[sf], model, dt, "test")
    b, _ = study.candidate_scores(runs[best], model, dt, "test")
    paired = paired_fa_ratio if figure == "fa" else paired_fr_ratio
    cmp_ = paired(study.evalsets["test"][dt], a, b, study.prof.target_fr, n_boot, study.seed)
    pre = "" if figure == "fa" else "fr_"
    return {
        f"{pre}best_other": best,
        f"{pre}best_other_relative_{figure}": others[best],
        f"{pre}ratio_to_best_other": cmp_["ratio"],
        f"{pre}ratio_to_best_other_ci": cmp_["ci"],
    }


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
        from wakefl.tools.evaluation.cells import bootstrap_units

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
                name: gate_record(
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


def step_rows(
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
                    "sigma_sq": stable_round(rec.sigma_sq.get(cid, 0.0)),
                    "sigma0_sq": stable_round(rec.sigma0_sq),
                }
            )
    return rows


@dataclass
class StudyTables:
    """What the study's phases collect for the report."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    step_counts: list[dict[str, Any]] = field(default_factory=list)
    tuning: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    det: dict[str, dict[str, Any]] = field(default_factory=dict)
    selected: dict[str, MethodRun] = field(default_factory=dict)
    gate: list[dict[str, Any]] = field(default_factory=list)
    comparisons: list[dict[str, Any]] = field(default_factory=list)

    def result(self, config: dict[str, Any]) -> dict[str, Any]:
        """The study's result dict (`wakefl.tools.studies.paper_experiment`)."""
        return {
            "config": config,
            "rows": self.rows,
            "step_counts": self.step_counts,
            "comparisons": self.comparisons,
            "gate": self.gate,
        }
