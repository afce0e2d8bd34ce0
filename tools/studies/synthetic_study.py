"""The Self-FL paper's synthetic two-level Gaussian study (Appendix G.1).

M clients with theta_m ~ N(theta_0, sigma_0^2); client m holds N_m samples
x ~ N(theta_m, 0.1), so its local optimum z_m (the sample mean) has intra-client variance
sigma_m^2 = 0.1 / N_m. Errors are measured against the Bayes-optimal closed forms
theta^(G) (Eqn 2) and theta_m^(FL) (Eqn 3) computed with the true sigma_0^2 and sigma_m^2.

Tuning (the same budget for every method): only step sizes are tuned, over the grid
STEP_FACTORS x min_m sigma_m^2 (every client's gradient step then contracts, since the
local curvature is 1/sigma_m^2). The step-size hyperparameters of each method are listed in
STEP_PARAMS (default: "lr"); all others stay at the method's defaults. The grid point with
the lowest local error on a separate tuning fleet at C = 1 is used for every C.
Self-FL runs with its intra-client variance known (intra_variance="problem", the variance
of the client's sample mean) and sigma_0^2 estimated each round (Eqn 14), l_max = 40.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from wakefl.errors import NonFiniteError
from wakefl.progress_bars import bar_disabled
from wakefl.sdk.selffl.gaussian_problem import GaussianLocalProblem
from wakefl.sdk.selffl.registry import strategy_factories
from wakefl.sdk.selffl.simulation import client_generator, run_simulation
from wakefl.sdk.selffl.strategy import Strategy

THETA0 = 1.6
NUM_CLIENTS = 20
SAMPLE_VAR = 0.1
CASES: dict[str, tuple[float, int, int]] = {  # sigma_0^2, N_min, N_max
    "homogeneous": (0.001, 10, 20),
    "heterogeneous": (1.0, 10, 200),
}
RATES = (0.1, 0.2, 0.5, 0.8, 1.0)
STEP_FACTORS = (0.1, 0.3, 0.9)
STEP_PARAMS: dict[str, tuple[str, ...]] = {
    "perfedavg": ("alpha", "beta"),
    "pfedme": ("lr", "personal_lr"),
}
FIXED_PARAMS: dict[str, dict[str, object]] = {
    "selffl": {"intra_variance": "problem", "l_max": 40},
    "selffl-alg2": {"intra_variance": "problem", "l_max": 40, "converge_steps": 50},
}


@dataclass
class Fleet:
    problems: dict[str, GaussianLocalProblem]
    global_target: float
    local_target: dict[str, float]
    min_sigma_sq: float


def make_fleet(case: str, generator: torch.Generator, num_clients: int = NUM_CLIENTS) -> Fleet:
    """Draw one fleet of the given case with its closed-form targets (Eqns 2 and 3)."""
    s0, n_lo, n_hi = CASES[case]
    n = torch.randint(n_lo, n_hi + 1, (num_clients,), generator=generator)
    theta = THETA0 + torch.randn(num_clients, generator=generator, dtype=torch.float64) * math.sqrt(
        s0
    )
    z = torch.stack(
        [
            (
                theta[i]
                + torch.randn(int(n[i]), generator=generator, dtype=torch.float64)
                * math.sqrt(SAMPLE_VAR)
            ).mean()
            for i in range(num_clients)
        ]
    )
    sig = SAMPLE_VAR / n.double()
    w = 1.0 / (s0 + sig)
    glob = float((w * z).sum() / w.sum())
    s_others = w.sum() - w
    local = (z / sig + (w * z).sum() - w * z) / (1.0 / sig + s_others)
    ids = [f"client{i:02d}" for i in range(num_clients)]
    return Fleet(
        problems={
            cid: GaussianLocalProblem(z[i], float(sig[i]), int(n[i])) for i, cid in enumerate(ids)
        },
        global_target=glob,
        local_target={cid: float(local[i]) for i, cid in enumerate(ids)},
        min_sigma_sq=float(sig.min()),
    )


def build(
    name: str,
    factory: Callable[..., Strategy],
    step: float,
    selffl_overrides: dict[str, object] | None = None,
) -> Strategy:
    """The method with every step-size hyperparameter set to `step`; `selffl_overrides`
    (an ablation row, e.g. {"eqn10": "paper"}) replace Self-FL's hyperparameters."""
    params = inspect.signature(factory).parameters
    hp: dict[str, object] = {k: step for k in STEP_PARAMS.get(name, ("lr",)) if k in params}
    hp.update(FIXED_PARAMS.get(name, {}))
    if selffl_overrides and name.startswith("selffl"):
        hp.update(selffl_overrides)
    return factory(**hp)


def errors(
    strategy: Strategy, fleet: Fleet, rate: float, rounds: int, seed: int
) -> tuple[float, float]:
    """(|global - theta^(G)|, mean_m |personalized_m - theta_m^(FL)|) after `rounds` rounds;
    (inf, inf) when the method diverges (refuses non-finite numbers) at this step size."""
    init = torch.zeros(1, dtype=torch.float64)
    try:
        res = run_simulation(strategy, fleet.problems, init, rounds, rate, seed)
    except NonFiniteError:
        return math.inf, math.inf
    g_err = abs(float(strategy.global_params(res.server).reshape(-1)[0]) - fleet.global_target)
    local = []
    for i, cid in enumerate(sorted(fleet.problems)):
        p = strategy.personalized_params(
            res.server,
            res.clients[cid],
            fleet.problems[cid],
            client_generator(seed, rounds + 1, i),
            client_id=cid,
        )
        local.append(abs(float(p.reshape(-1)[0]) - fleet.local_target[cid]))
    return g_err, sum(local) / len(local)


def _build_at(
    name: str,
    factory: Callable[..., Strategy],
    selffl_overrides: dict[str, object] | None,
    step: float,
) -> Strategy:
    return build(name, factory, step, selffl_overrides)


def _tune_step(
    make: Callable[[float], Strategy], fleet: Fleet, rounds: int, seed: int, bar: Any
) -> float:
    """The step factor (of the fleet's smallest sigma_m^2) with the lowest local error at
    C = 1 on the tuning fleet."""
    best: tuple[float, float] | None = None
    for f in STEP_FACTORS:
        _, loc = errors(make(f * fleet.min_sigma_sq), fleet, 1.0, rounds, seed)
        if best is None or loc < best[0]:
            best = (loc, f)
        bar.update()
    assert best is not None
    return best[1]


def _result_row(
    case: str, rate: float, name: str, g_errs: list[float], l_errs: list[float]
) -> dict[str, object]:
    return {
        "case": case,
        "activity_rate": rate,
        "method": name,
        "global_mae": _finite_or_none(_mean(g_errs)),
        "global_sd": _finite_or_none(_sd(g_errs)),
        "local_mae": _finite_or_none(_mean(l_errs)),
        "local_sd": _finite_or_none(_sd(l_errs)),
        "diverged_runs": sum(not math.isfinite(x) for x in g_errs + l_errs),
    }


def _study_config(
    num_clients: int,
    rates: tuple[float, ...],
    reps: int,
    rounds: int,
    seed: int,
    selffl_overrides: dict[str, object] | None,
    names: list[str],
) -> dict[str, object]:
    """The study's settings and step-size grid, as the document records them."""
    return {
        "num_clients": num_clients,
        "theta0": THETA0,
        "sample_var": SAMPLE_VAR,
        "cases": {k: {"sigma0_sq": v[0], "n_min": v[1], "n_max": v[2]} for k, v in CASES.items()},
        "activity_rates": list(rates),
        "repetitions": reps,
        "rounds": rounds,
        "seed": seed,
        "selffl_overrides": dict(selffl_overrides or {}),
        "step_grid": {
            "factors_of_min_sigma_m_sq": list(STEP_FACTORS),
            "step_params": {n: list(STEP_PARAMS.get(n, ("lr",))) for n in names},
            "fixed": {k: v for k, v in FIXED_PARAMS.items() if k in names},
            "criterion": "lowest local MAE on a separate tuning fleet at C=1",
        },
    }


def run_study(
    reps: int = 3,
    seed: int = 0,
    rounds: int = 30,
    rates: tuple[float, ...] = RATES,
    methods: list[str] | None = None,
    num_clients: int = NUM_CLIENTS,
    progress: bool = True,
    selffl_overrides: dict[str, object] | None = None,
) -> dict[str, Any]:
    """Run the study; returns a JSON-serialisable document. `selffl_overrides` replace
    Self-FL's hyperparameters (an ablation of its deviations from the paper)."""
    from tqdm import tqdm

    factories = strategy_factories()
    names = list(factories) if methods is None else methods
    rows: list[dict[str, object]] = []
    tuned: dict[str, dict[str, float]] = {}
    seconds: dict[str, float] = {}
    total = len(CASES) * len(names) * (len(STEP_FACTORS) + reps * len(rates))
    bar = tqdm(total=total, desc="synthetic study", disable=bar_disabled(progress), leave=False)
    for case_idx, case in enumerate(CASES):
        tune_fleet = make_fleet(
            case, torch.Generator().manual_seed(seed * 7919 + 1000 + case_idx), num_clients
        )
        fleets = [
            make_fleet(
                case, torch.Generator().manual_seed(seed * 7919 + 10 * r + case_idx), num_clients
            )
            for r in range(reps)
        ]
        tuned[case] = {}
        for name in names:
            started = time.perf_counter()
            make = partial(_build_at, name, factories[name], selffl_overrides)
            factor = _tune_step(make, tune_fleet, rounds, seed, bar)
            tuned[case][name] = factor
            for rate in rates:
                g_errs, l_errs = [], []
                for r, fleet in enumerate(fleets):
                    g, loc = errors(
                        make(factor * fleet.min_sigma_sq), fleet, rate, rounds, seed + r
                    )
                    g_errs.append(g)
                    l_errs.append(loc)
                    bar.update()
                rows.append(_result_row(case, rate, name, g_errs, l_errs))
            seconds.setdefault(name, 0.0)
            seconds[name] += time.perf_counter() - started
    bar.close()
    return {
        "config": _study_config(num_clients, rates, reps, rounds, seed, selffl_overrides, names),
        "methods": names,
        "tuned_step_factor": tuned,
        "results": rows,
        "seconds_per_method": {k: round(v, 2) for k, v in seconds.items()},
    }


def best_by(doc: dict[str, Any], metric: str) -> dict[str, dict[float, str]]:
    """Per case and activity rate, the method with the lowest `metric`."""
    out: dict[str, dict[float, tuple[float, str]]] = {}
    for row in doc["results"]:
        cur = out.setdefault(row["case"], {}).get(row["activity_rate"])
        if row[metric] is None:
            continue
        if cur is None or row[metric] < cur[0]:
            out[row["case"]][row["activity_rate"]] = (row[metric], row["method"])
    return {c: {r: m for r, (_, m) in v.items()} for c, v in out.items()}


def write_plots(doc: dict[str, Any], out_dir: Path) -> list[str]:
    """Paper-style plots: per case, global and local error against C, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    rows = doc["results"]
    for case in CASES:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, metric, title in zip(
            axes,
            ("global_mae", "local_mae"),
            ("global parameter vs theta^(G)", "local parameters vs theta_m^(FL)"),
            strict=True,
        ):
            for name in doc["methods"]:
                pts = [
                    (r["activity_rate"], r[metric])
                    for r in rows
                    if r["case"] == case and r["method"] == name
                ]
                pts = [(x, y) for x, y in pts if y is not None]
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    style = "-o" if name.startswith("selffl") else "--."
                    ax.plot(xs, [max(y, 1e-12) for y in ys], style, label=name)
            ax.set_yscale("log")
            ax.set_xlabel("activity rate C")
            ax.set_ylabel("mean absolute error")
            ax.set_title(f"{case}: {title}")
        axes[1].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out_dir / f"synthetic_{case}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


def _finite_or_none(x: float) -> float | None:
    # JSON has no Infinity: a method that diverged in any repetition reports null.
    return x if math.isfinite(x) else None


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _sd(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
