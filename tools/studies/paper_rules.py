"""The paper study's rules (`wakefl.tools.studies.paper_experiment`): its settings, methods and
profiles, each method's hyperparameters, how speakers split into clients and how a tuning
run is selected. Small pure functions and constants."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from wakefl.errors import ConfigError

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
    name: str,
    width: float | None = None,
    rounds: int | None = None,
    target_fr: float | None = None,
) -> StudyProfile:
    """The named profile, with the width, round count and operating point optionally
    overridden (the sampling settings keep their ratio of rounds to the full-participation
    rounds)."""
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
    if target_fr is not None:
        if not 0.0 < target_fr < 1.0:
            raise ConfigError(f"--target-fr must be in (0, 1), got {target_fr}")
        prof = replace(prof, target_fr=float(target_fr))
    return prof


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


def hyperparams_record(hp: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (v if isinstance(v, int | float | str | bool) or v is None else str(v))
        for k, v in hp.items()
        if k != "head"
    }
