"""Baseline personalization methods on the `Strategy` interface (docs/SELF_FL.md, "Baselines").

`BASELINES` maps a method name to a constructor taking that method's keyword
hyperparameters (documented on each class and in README.md)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from ..strategy import Strategy
from .ditto import Ditto
from .fedavg import FedAvg
from .finetune import FineTune
from .local_only import LocalOnly
from .perfedavg import PerFedAvg
from .pfedme import PFedMe
from .pfedvem import PFedVEM

BASELINES: dict[str, Callable[..., Strategy]] = {
    "fedavg-w": partial(FedAvg, weighting="samples"),
    "fedavg-e": partial(FedAvg, weighting="equal"),
    "ditto-w": partial(Ditto, weighting="samples"),
    "ditto-e": partial(Ditto, weighting="equal"),
    "perfedavg": PerFedAvg,
    "pfedme": PFedMe,
    "pfedvem": PFedVEM,
    "local": LocalOnly,
    "finetune": FineTune,
}

__all__ = [
    "BASELINES",
    "Ditto",
    "FedAvg",
    "FineTune",
    "LocalOnly",
    "PFedMe",
    "PFedVEM",
    "PerFedAvg",
]
