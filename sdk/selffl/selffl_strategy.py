"""Self-FL as a `Strategy`: Algorithm 1 (early-stopped personal models) and Algorithm 2
(also the locally converged models), as docs/SELF_FL.md describes them.

Client state (persisted on the device between the rounds it takes part in):
    tensors["personal"]   theta_m, the personal model (Algorithm 1 and 2)
    tensors["converged"]  theta_{m,t}, the locally converged model (Algorithm 2 only)
    tensors["rv_mean"]    the RunningVariance's mean (over personal models in Algorithm 1,
                          over converged models in Algorithm 2)
    scalars["t_m"]        rounds this client took part in (Remark E.1)
    scalars["rv_count"], scalars["rv_value"]  the RunningVariance's scalars
Server state:
    scalars["sigma0_sq"]  inter-client variance sent to clients (Eqn 14)
    clients[cid]          {"sigma_sq": last reported sigma_m^2, "has_variance": 0/1}
                          (scalars only: needed for S_-m)
    tensors["rep:<group>"], scalars["rep_sigma_sq:<group>"], scalars["cluster_sigma0_sq"]
                          cluster representatives when `cluster_by_group` is set.

Decisions the paper leaves open (see also `rules.local_steps` / `rules.initial_point`):
* t_m < 2 (no variance yet, intra_variance="running"): warm-up, start from the global
  model and run `warmup_steps` steps; the client reports has_variance=0 and the server
  weights it with the mean sigma_m^2 of the clients that do have one (0 if none).
* A round with fewer than 2 updates keeps the previous sigma0^2 (one model says nothing
  about the spread between clients).
* Non-finite numbers anywhere raise `NonFiniteError` before any state is replaced: the
  client's input `state` and the server's input state are never modified in place.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from wakefl.errors import ConfigError
from wakefl.sdk.selffl.aggregation import (
    Representative,
    aggregate_clusters,
    aggregate_stream,
    smooth,
    update_representatives,
)
from wakefl.sdk.selffl.checks import (
    HyperparameterError,
    require_choice,
    require_count,
    require_finite,
    require_finite_scalar,
    require_non_negative,
    require_positive,
)
from wakefl.sdk.selffl.local_sgd import sgd_steps
from wakefl.sdk.selffl.rules import initial_point, local_steps, precision
from wakefl.sdk.selffl.running_variance import RunningVariance
from wakefl.sdk.selffl.strategy import (
    ClientInstructions,
    ClientResult,
    ClientState,
    LocalProblem,
    ServerState,
    Strategy,
)

_REP = "rep:"
_REP_SIG = "rep_sigma_sq:"


@dataclass(frozen=True)
class ReportedUncertainty:
    """What one client's update says about its own uncertainty, read in the first pass
    over a round's results."""

    client_id: str
    sigma_sq: float  # sigma_m^2 as reported (0 while the client has none yet)
    has_variance: bool  # False during warm-up (t_m < 2)
    group: str  # cluster key for cluster-level aggregation


class SelfFL(Strategy):
    """Self-FL (Chen et al. 2022).

    Hyperparameters:
    * algorithm: 1 (server aggregates the early-stopped personal models) or 2 (the client
      also trains on for `converge_steps` more steps to theta_{m,t}, keeps its variance
      over those, uses theta_{m,t} in Eqn 10 and sends it for aggregation; the personal
      model travels in `tensors["personal"]`).
    * lr (eta), batch_size (B): enter Eqn 16 and the local SGD.
    * l_max: cap on local steps (paper: 40). warmup_steps: steps while t_m < 2.
    * cluster_by_group: cluster-level aggregation over representatives per
      `ClientResult.group` (Appendix G.4).
    * intra_variance: "running" (sigma_m^2 from the RunningVariance, the paper's rule) or
      "problem" (sigma_m^2 = `problem.sigma_sq`, known intra-client variance, e.g. the
      scalar Gaussian model where it is the variance of the sample mean).
    * sigma0_sq: None to estimate sigma0^2 each round (Eqn 14) or a fixed known value.
    """

    def __init__(
        self,
        algorithm: int = 1,
        lr: float = 0.01,
        batch_size: int = 1,
        l_max: int = 40,
        warmup_steps: int = 20,
        cluster_by_group: bool = False,
        intra_variance: str = "running",
        sigma0_sq: float | None = None,
        converge_steps: int = 200,
    ) -> None:
        if algorithm not in (1, 2):
            raise HyperparameterError(f"Self-FL algorithm must be 1 or 2, got {algorithm}")
        self.algorithm = algorithm
        self.lr = require_positive(require_finite_scalar(lr, "learning rate"), "learning rate")
        self.batch_size = require_count(batch_size, "batch_size", minimum=1)
        self.l_max = require_count(l_max, "l_max", minimum=1)
        self.warmup_steps = require_count(warmup_steps, "warmup_steps")
        self.cluster_by_group = bool(cluster_by_group)
        self.intra_variance = require_choice(intra_variance, ("running", "problem"), "intra_variance")
        if sigma0_sq is not None:
            require_non_negative(require_finite_scalar(sigma0_sq, "sigma0^2"), "sigma0^2")
        self.fixed_sigma0_sq = sigma0_sq
        self.converge_steps = require_count(converge_steps, "converge_steps")
        self.name = "selffl" if algorithm == 1 else "selffl-alg2"

    # ---- server side -------------------------------------------------------------------
    def init_server(self, initial_params: Tensor) -> ServerState:
        require_finite(initial_params, "initial parameters")
        s0 = 0.0 if self.fixed_sigma0_sq is None else float(self.fixed_sigma0_sq)
        return ServerState(round_id=0, global_params=initial_params.clone(), scalars={"sigma0_sq": s0})

    @staticmethod
    def _fill_sigma(clients: dict[str, dict[str, float]]) -> float:
        known = [c["sigma_sq"] for c in clients.values() if c.get("has_variance", 0.0) > 0]
        return sum(known) / len(known) if known else 0.0

    def others_precision(self, server: ServerState, client_id: str) -> float:
        """S_-m = sum over the other known clients of 1/(sigma0^2 + sigma_k^2)."""
        s0 = server.scalars.get("sigma0_sq", 0.0)
        fill = self._fill_sigma(server.clients)
        total = 0.0
        for cid, info in server.clients.items():
            if cid == client_id:
                continue
            sig = info["sigma_sq"] if info.get("has_variance", 0.0) > 0 else fill
            total += precision(s0, sig)
        return total

    def configure_client(self, server: ServerState, client_id: str, round_id: int) -> ClientInstructions:
        return ClientInstructions(
            client_id=client_id,
            round_id=round_id,
            global_params=server.global_params,
            scalars={
                "sigma0_sq": float(server.scalars.get("sigma0_sq", 0.0)),
                "others_precision": self.others_precision(server, client_id),
            },
        )

    def aggregate(
        self, server: ServerState, results: Iterable[ClientResult], activity_rate: float
    ) -> ServerState:
        # Pass 1: per-client scalars and the streaming inter-client variance (Eqn 14).
        rv = RunningVariance()
        reported: list[ReportedUncertainty] = []
        for r in results:
            sig = require_finite_scalar(r.scalars.get("sigma_sq", 0.0), f"sigma_m^2 of {r.client_id}")
            rv.update(r.params)
            reported.append(
                ReportedUncertainty(r.client_id, sig, r.scalars.get("has_variance", 1.0) > 0, r.group)
            )
        if not reported:
            raise ConfigError("no client results to aggregate")
        if self.fixed_sigma0_sq is not None:
            sigma0_sq = float(self.fixed_sigma0_sq)
        elif len(reported) >= 2:
            sigma0_sq = rv.value
        else:
            sigma0_sq = float(server.scalars.get("sigma0_sq", 0.0))
        known = [u.sigma_sq for u in reported if u.has_variance]
        fill = sum(known) / len(known) if known else 0.0
        sigmas = [u.sigma_sq if u.has_variance else fill for u in reported]

        new_scalars = dict(server.scalars)
        new_tensors = dict(server.tensors)
        # Pass 2: Eqn 11 (and the cluster representatives).
        if self.cluster_by_group:
            reps = {
                k[len(_REP):]: Representative(v, server.scalars[_REP_SIG + k[len(_REP):]])
                for k, v in server.tensors.items()
                if k.startswith(_REP)
            }
            reps = update_representatives(
                reps,
                ((u.group, r.params, s) for u, r, s in zip(reported, results, sigmas, strict=True)),
                sigma0_sq,
            )
            new_global, cluster_s0 = aggregate_clusters(reps)
            for g, rep in reps.items():
                new_tensors[_REP + g] = rep.params
                new_scalars[_REP_SIG + g] = rep.sigma_sq
            new_scalars["cluster_sigma0_sq"] = cluster_s0
        else:
            theta_hat = aggregate_stream(
                ((r.params, s) for r, s in zip(results, sigmas, strict=True)), sigma0_sq
            )
            new_global = smooth(server.global_params, theta_hat, activity_rate)
        new_scalars["sigma0_sq"] = sigma0_sq
        clients = {cid: dict(v) for cid, v in server.clients.items()}
        for u in reported:
            prev = clients.get(u.client_id, {})
            if u.has_variance or not prev.get("has_variance", 0.0):
                clients[u.client_id] = {"sigma_sq": u.sigma_sq, "has_variance": 1.0 if u.has_variance else 0.0}
        return ServerState(
            round_id=server.round_id + 1,
            global_params=new_global,
            tensors=new_tensors,
            scalars=new_scalars,
            clients=clients,
        )

    # ---- client side -------------------------------------------------------------------
    def client_update(
        self,
        instructions: ClientInstructions,
        state: ClientState,
        problem: LocalProblem,
        generator: torch.Generator,
    ) -> tuple[ClientResult, ClientState]:
        g = instructions.global_params
        require_finite(g, "global parameters from the server")
        s0 = require_finite_scalar(instructions.scalars.get("sigma0_sq", 0.0), "sigma0^2")
        s_others = require_finite_scalar(
            instructions.scalars.get("others_precision", 0.0), "S_-m", allow_inf=True
        )
        rv = RunningVariance()
        if "rv_mean" in state.tensors:
            rv.load_state_dict(
                {
                    "count": int(state.scalars.get("rv_count", 0)),
                    "value": state.scalars.get("rv_value", 0.0),
                    "mean": state.tensors["rv_mean"],
                }
            )
        t_m = int(state.scalars.get("t_m", 0))
        sigma_m_sq: float | None
        if self.intra_variance == "problem":
            sigma_m_sq = require_finite_scalar(problem.sigma_sq, "problem sigma_m^2")  # type: ignore[attr-defined]
        else:
            sigma_m_sq = rv.value if rv.count >= 2 else None
        anchor = state.tensors.get("converged" if self.algorithm == 2 else "personal")
        if sigma_m_sq is None or anchor is None:
            theta_init = g.clone()
        else:
            theta_init = initial_point(g, anchor, sigma_m_sq, s_others, sigma0_sq=s0)
        steps = local_steps(self.lr, self.batch_size, sigma_m_sq, s_others, self.l_max, self.warmup_steps)
        personal = sgd_steps(theta_init, problem, generator, self.lr, steps)
        tensors: dict[str, Tensor] = {"personal": personal}
        sent = personal
        if self.algorithm == 2:
            sent = sgd_steps(personal, problem, generator, self.lr, self.converge_steps)
            tensors["converged"] = sent
            result_tensors = {"personal": personal}
        else:
            result_tensors = {}
        rv.update(sent)  # raises NonFiniteError before any state is replaced
        rv_state = rv.state_dict()
        tensors["rv_mean"] = rv_state["mean"]  # type: ignore[assignment]
        reported = sigma_m_sq if sigma_m_sq is not None else 0.0
        new_state = ClientState(
            tensors=tensors,
            scalars={
                "t_m": float(t_m + 1),
                "rv_count": float(rv.count),
                "rv_value": rv.value,
            },
        )
        result = ClientResult(
            client_id=instructions.client_id,
            round_id=instructions.round_id,
            params=sent,
            num_samples=int(problem.num_samples),
            scalars={
                "sigma_sq": reported,
                "has_variance": 0.0 if sigma_m_sq is None else 1.0,
                "local_steps": float(steps),
                "others_precision": s_others,
            },
            tensors=result_tensors,
        )
        return result, new_state

    def personalized_params(
        self, server: ServerState, state: ClientState, problem: LocalProblem,
        generator: torch.Generator, client_id: str | None = None,
    ) -> Tensor:
        """The personal model a device holds after receiving the current broadcast: the
        Self-FL client rule (Eqns 10 and 16 and the local steps) applied to the latest global
        model and S_-m, without sending anything or changing `state`. A client that never
        took part starts from the global model (the warm-up rule).

        `client_id` lets S_-m leave this client's own precision out, as Eqns 10 and 16 ask;
        without it the client is not identifiable and the precision of every known client is
        used (one client more than S_-m at most)."""
        ins = self.configure_client(server, "\x00evaluation" if client_id is None else client_id,
                                    server.round_id + 1)
        result, _ = self.client_update(ins, state, problem, generator)
        return result.tensors.get("personal", result.params).clone()
