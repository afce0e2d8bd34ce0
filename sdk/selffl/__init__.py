"""The pure Self-FL core: uncertainty rules, aggregation, strategies and simulation."""

from wakefl.sdk.selffl.aggregation import (
    PrecisionSum,
    Representative,
    aggregate,
    aggregate_clusters,
    aggregate_stream,
    smooth,
    update_representatives,
)
from wakefl.sdk.selffl.checks import HyperparameterError
from wakefl.sdk.selffl.gaussian_problem import GaussianLocalProblem
from wakefl.sdk.selffl.local_sgd import sgd_steps
from wakefl.sdk.selffl.registry import available_strategies, make_strategy
from wakefl.sdk.selffl.rules import (
    data_step_cap,
    eqn10_factor,
    initial_point,
    local_steps,
    precision,
    sampled_count,
    step_rate,
    trace_variance,
)
from wakefl.sdk.selffl.running_variance import RunningVariance
from wakefl.sdk.selffl.selffl_strategy import SelfFL
from wakefl.sdk.selffl.simulation import RoundRecord, SimulationResult, run_simulation
from wakefl.sdk.selffl.strategy import (
    ClientInstructions,
    ClientResult,
    ClientState,
    LocalProblem,
    ServerState,
    Strategy,
)

__all__ = [
    "ClientInstructions",
    "ClientResult",
    "ClientState",
    "GaussianLocalProblem",
    "HyperparameterError",
    "LocalProblem",
    "PrecisionSum",
    "Representative",
    "RoundRecord",
    "RunningVariance",
    "SelfFL",
    "ServerState",
    "SimulationResult",
    "Strategy",
    "aggregate",
    "aggregate_clusters",
    "aggregate_stream",
    "available_strategies",
    "data_step_cap",
    "eqn10_factor",
    "initial_point",
    "local_steps",
    "make_strategy",
    "precision",
    "run_simulation",
    "sampled_count",
    "sgd_steps",
    "smooth",
    "step_rate",
    "trace_variance",
    "update_representatives",
]
