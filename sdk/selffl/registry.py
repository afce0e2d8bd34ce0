"""Strategies by name: Self-FL (Algorithms 1 and 2) and the baselines of
`wakefl.sdk.selffl.baselines.BASELINES` (name -> factory), when that module is present."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from typing import Any

from wakefl.errors import ConfigError
from wakefl.sdk.selffl.selffl_strategy import SelfFL
from wakefl.sdk.selffl.strategy import Strategy


def _baselines() -> dict[str, Callable[..., Strategy]]:
    try:
        mod = importlib.import_module("wakefl.sdk.selffl.baselines")
    except ModuleNotFoundError as exc:
        # Only a missing baselines package is tolerated; a broken import inside it is a bug.
        if exc.name and exc.name.startswith("wakefl.sdk.selffl.baselines"):
            return {}
        raise
    return dict(getattr(mod, "BASELINES", {}))


def strategy_factories() -> dict[str, Callable[..., Strategy]]:
    """All known strategy names -> factories (Self-FL first, then the baselines)."""
    # partial keeps SelfFL's signature visible to callers that inspect hyperparameters.
    out: dict[str, Callable[..., Strategy]] = {
        "selffl": partial(SelfFL, algorithm=1),
        "selffl-alg2": partial(SelfFL, algorithm=2),
    }
    for name, factory in _baselines().items():
        out.setdefault(name, factory)
    return out


def available_strategies() -> list[str]:
    return list(strategy_factories())


def make_strategy(name: str, **hyperparams: Any) -> Strategy:
    """Build the strategy `name` with its hyperparameters (ConfigError for unknown names)."""
    factories = strategy_factories()
    if name not in factories:
        raise ConfigError(f"unknown strategy '{name}'; available: {', '.join(factories)}")
    return factories[name](**hyperparams)
