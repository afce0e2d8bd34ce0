"""The Self-FL paper's wake-word study on the wakefl corpus (paper Section 5, Tables 2, 5, 6
and Figures 11-12): Self-FL against FedAvg-w/-e, DITTO-w/-e, Per-FedAvg, pFedMe, pFedVEM,
local fine-tuning and local-only training, all started from the same warm-start model and
judged by relative FA at matched FR against it on held-out test speakers.

Settings:
* "full-participation": 5 clients, one per device type, every client active every round.
* "sampling-0.25" / "sampling-0.1": 20 clients, 4 per device type (each device type's
  training speakers split into 4 disjoint groups), activity rate C; Self-FL client-level
  against cluster-level (clusters = device types), reported per device state, beside every
  other method run under the same sampling (`sampling_methods`).

Tuning: every method gets the same grid of learning rates (the one hyperparameter every
method has); each grid point is a full federated run in the full-participation setting,
scored on the validation speakers, and the best point's run is then evaluated on the test
speakers. Under client sampling each method runs at its own selected learning rate.

Evaluation: per device type, the warm start's threshold is fixed where its FR meets the
target on all of that device type's test clips and each candidate's is matched to that FR;
device-state rows count within the state at those thresholds. Intervals: paired percentile
bootstrap over test speakers (background-only clips each their own unit). Each Self-FL cell
is also compared with the best other method of that cell by a paired bootstrap of the FA
ratio ("comparisons"), in every setting.

The served-model gate ("gate"): for every client of every Self-FL run, the gate a device
runs (`wakefl.sdk.served_model_gate.decide_served_model`) decides, on its device type's
validation speakers, whether the client serves its personalized model, the global model or
keeps the warm start (one decision at the end of the run, from the warm start: the device
serves the warm start until the gate admits another model); the served model is then scored
on the test speakers like the other cells, beside the client's personalized model alone.

The result is a plain dict `{"config": ..., "rows": [...], "step_counts": [...],
"comparisons": [...], "gate": [...]}`; `wakefl.tools.studies.paper_report` turns it into the
Markdown tables and the plots. This module runs the study end to end; its rules are
`paper_rules`, its figures `paper_figures`, and one run of the methods `paper_study`.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from wakefl.errors import ConfigError, NonFiniteError
from wakefl.recorded_paths import recorded_path
from wakefl.tools.studies.paper_figures import stable_round
from wakefl.tools.studies.paper_rules import (
    ACTIVITY_RATES,
    ALL_STATES,
    METHOD_LABELS,
    METHODS,
    SELFFL_ABLATIONS,
    SETTING_FULL,
    STATES,
    StudyProfile,
    hyperparams_record,
    method_hyperparams,
    resolve_profile,
    selection_score,
)
from wakefl.tools.studies.paper_study import (
    SELFFL_METHODS,
    MethodRun,
    PaperStudy,
    StudyTables,
    compare_with_best_other,
    step_rows,
)


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
    target_fr: float | None = None,
    sampling_methods: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run the whole study; write `results.json`, `results.md` and the figures into
    `out_dir`; return the result dict. Builds the corpus of the profile into
    `out_dir/corpus` unless `manifest` names an existing one. Every method starts from
    `baseline` (warm_start.resolve_baseline: by default the shipped model of the width).
    `selffl_ablations` (names of SELFFL_ABLATIONS) add Self-FL rows with those rules, at
    the selected learning rate, in settings of their own ("ablation-..."). `target_fr`:
    the operating point (the baseline's FR on the test clips), if not the profile's.
    `sampling_methods`: the other methods also run under client sampling, each at its own
    selected learning rate (default: every non-Self-FL method of `methods`)."""
    import torch

    from wakefl.tools.studies.paper_report import write_report

    prof = resolve_profile(profile, width=width, rounds=rounds, target_fr=target_fr)
    rivals = _check_study_methods(methods, sampling_rates, sampling_methods, selffl_ablations)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    manifest_path = _study_manifest(out, manifest, prof, seed, progress, log)
    study = PaperStudy(
        manifest_path, prof, seed, Path(cache_dir) if cache_dir else None, progress, log, baseline
    )
    tables = StudyTables()
    _full_participation(study, prof, methods, tables, log)
    tables.comparisons = compare_with_best_other(study, tables.selected, tables.rows, prof.n_boot)
    tables.selected.clear()
    selffl_lr = (tables.tuning.get("selffl") or {}).get("selected_lr") or prof.lr_grid[0]
    _client_sampling(study, prof, sampling_rates, selffl_lr, rivals, tables, log)
    _selffl_ablations(study, prof, sampling_rates, selffl_lr, selffl_ablations, tables, log)
    config = _study_config(
        study, prof, seed, methods, sampling_rates, manifest_path, tables, selffl_lr, command, out
    )
    config["sampling_methods"] = list(rivals) if sampling_rates else []
    result = tables.result(config)
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


def _check_study_methods(
    methods: Sequence[str],
    sampling_rates: Sequence[float],
    sampling_methods: Sequence[str] | None,
    selffl_ablations: Sequence[str],
) -> list[str]:
    """Refuse unknown or inconsistent methods and ablations; the other methods that run
    under client sampling."""
    _check_ablations(methods, selffl_ablations)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(
            f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}"
        )
    if "selffl" not in methods and sampling_rates:
        raise ConfigError("the sampling settings run Self-FL: include 'selffl' in the methods")
    return _sampling_rivals(methods, sampling_methods)


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
        scores[f"{lr:g}"] = stable_round(score) if math.isfinite(score) else None
        if best is None or score < best[0]:
            best = (score, run)
    return (None if best is None else best[1]), scores, failures


def _full_participation(
    study: PaperStudy,
    prof: StudyProfile,
    methods: Sequence[str],
    tables: StudyTables,
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
            "hyperparams": hyperparams_record(hp),
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
            tables.step_counts += step_rows(SETTING_FULL, method, run, groups)
            tables.gate += study.gate_rows(SETTING_FULL, method, run)


def _sampling_rivals(methods: Sequence[str], sampling_methods: Sequence[str] | None) -> list[str]:
    """The other methods run under client sampling: `sampling_methods`, or by default every
    method of the study that is not Self-FL (whose sampling runs are its two levels)."""
    others = [m for m in methods if m not in SELFFL_METHODS]
    if sampling_methods is None:
        return others
    wrong = [m for m in sampling_methods if m not in others]
    if wrong:
        raise ConfigError(
            f"sampling method(s) {', '.join(wrong)} are not among the study's other methods "
            f"({', '.join(others) or 'none'})"
        )
    return list(sampling_methods)


def _client_sampling(
    study: PaperStudy,
    prof: StudyProfile,
    sampling_rates: Sequence[float],
    selffl_lr: float,
    rivals: Sequence[str],
    tables: StudyTables,
    log: Callable[[str], None],
) -> None:
    """Tables 5 and 6: client- vs cluster-level Self-FL at each activity rate, beside the
    `rivals` at their own selected learning rates (a method whose every grid point diverged
    is left out), and Self-FL's comparisons with the best of them per setting."""
    if not sampling_rates:
        return
    problems, groups = study.problems(prof.clients_per_type)
    for rate in sampling_rates:
        setting = f"sampling-{rate:g}"
        runs: dict[str, MethodRun] = {}
        for level, cluster in (("selffl-client", False), ("selffl-cluster", True)):
            log(
                f"[study] {setting}: {METHOD_LABELS[level]} lr={selffl_lr:g}, "
                f"{len(problems)} clients, {prof.sampling_rounds} rounds"
            )
            runs[level] = study.run_method(
                "selffl", selffl_lr, problems, groups, prof.sampling_rounds, rate, cluster=cluster
            )
            tables.step_counts += step_rows(setting, level, runs[level], groups)
            tables.gate += study.gate_rows(setting, level, runs[level])
        for method in rivals:
            lr = (tables.tuning.get(method) or {}).get("selected_lr")
            if lr is None:
                continue
            log(f"[study] {setting}: {METHOD_LABELS[method]} lr={lr:g}")
            runs[method] = study.run_method(
                method, lr, problems, groups, prof.sampling_rounds, rate
            )
        for name, run in runs.items():
            tables.timings[f"{setting}/{name}"] = round(run.seconds, 1)
            for rec in study.evaluate(run, "test", (ALL_STATES, *STATES), prof.n_boot):
                tables.rows.append({"setting": setting, "method": name, **rec})
        tables.comparisons += compare_with_best_other(
            study, runs, tables.rows, prof.n_boot, setting, ("selffl-client", "selffl-cluster")
        )


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
    tables: StudyTables,
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
            tables.step_counts += step_rows(setting, label, run, groups)


def _study_config(
    study: PaperStudy,
    prof: StudyProfile,
    seed: int,
    methods: Sequence[str],
    sampling_rates: Sequence[float],
    manifest_path: Path,
    tables: StudyTables,
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

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")
