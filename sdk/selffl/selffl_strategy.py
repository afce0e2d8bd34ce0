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
    clients[cid]          {"sigma_sq": last reported sigma_m^2, "has_variance": 0/1,
                          "share": the weight of the client's last upload in the current
                          global model (for Eqn 10), and in cluster mode "cluster" (a code,
                          see scalars["cluster_code:<group>"]) and "rep_share" (its weight
                          in its cluster's representative)} (scalars only: O(M) numbers)
    tensors["rep:<group>"], scalars["rep_sigma_sq:<group>"], scalars["cluster_sigma0_sq"]
                          cluster representatives when `cluster_by_group` is set.

Decisions the paper leaves open (see also `rules.local_steps` / `rules.initial_point`):
* No variance yet (intra_variance="running"): warm-up, start from the global model and
  run `warmup_steps` steps. With `early_variance` (the default) the first round folds the
  iterate halfway through its training into the running variance before the round's
  model, so the client reports a variance from its first round and uses Eqns 10 and 16
  from its second; without it the first two rounds are warm-up rounds, reported with
  has_variance=0, and the server weights them with the mean sigma_m^2 of the clients that
  do have one (0 if none).
* A round with fewer than 2 updates keeps the previous sigma0^2 (one model says nothing
  about the spread between clients).
* Non-finite numbers anywhere raise `NonFiniteError` before any state is replaced: the
  client's input `state` and the server's input state are never modified in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from wakefl.errors import ConfigError
from wakefl.protocol.records import MAX_RECORD_ABS, MAX_STEPS, RecordSchema, ScalarSpec
from wakefl.sdk.selffl.aggregation import aggregate_stream, smooth, weight_shares
from wakefl.sdk.selffl.checks import (
    HyperparameterError,
    require_activity_rate,
    require_choice,
    require_count,
    require_finite,
    require_finite_scalar,
    require_non_negative,
    require_positive,
)
from wakefl.sdk.selffl.cluster_state import ClusterState, aggregate_by_cluster
from wakefl.sdk.selffl.local_sgd import sgd_steps
from wakefl.sdk.selffl.rules import (
    LOSS_SCALINGS,
    data_step_cap,
    initial_point,
    local_steps,
    precision,
    step_count_words,
)
from wakefl.sdk.selffl.running_variance import RunningVariance
from wakefl.sdk.selffl.strategy import (
    ClientInstructions,
    ClientResult,
    ClientState,
    LocalProblem,
    ServerState,
    Strategy,
)


def _load_variance(state: ClientState) -> RunningVariance:
    """The client's RunningVariance as its state keeps it (empty before its first round)."""
    rv = RunningVariance()
    if "rv_mean" in state.tensors:
        rv.load_state_dict(
            {
                "count": int(state.scalars.get("rv_count", 0)),
                "value": state.scalars.get("rv_value", 0.0),
                "mean": state.tensors["rv_mean"],
            }
        )
    return rv


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

    Sparse participation and little data (docs/SELF_FL.md; each a deliberate deviation
    with a switch back to the paper's rule for ablations):
    * eqn10: "share" (Eqn 10's factor from the client's realised share of the global model,
      sent by the server as `own_share`; the paper's w_m / S_-m when the server sends none)
      or "paper" (always w_m / S_-m).
    * eqn10_max_factor: bound on Eqn 10's factor (1.0: the initial point is never further
      from the global model than the client's own model; None: unbounded, the paper).
    * step_rate_loss: "mean" (Eqn 16's rate eta / sigma_m^2, exact for the mean minibatch
      loss of wakefl's oracles) or "sum" (the paper's printed eta / (B sigma_m^2)).
    * early_variance: fold the mid-round iterate of a client's first round into its
      running variance, so sigma_m^2 exists from its second round (False: from its third).
    * max_local_epochs: with intra_variance="running", cap every local step count (warm-up
      and Eqn 16, not Algorithm 2's converge steps) at this many passes over the client's
      samples in minibatches of B (`rules.data_step_cap`); None: only l_max caps. A known
      sigma_m^2 ("problem") already carries the data size, so it is not capped.
    """

    # The records on the wire (protocol/records.py, docs/PROTOCOL.md): sigma0^2, S_-m and the
    # client's share of the global model down; sigma_m^2 (with whether the client has one
    # yet), the step count and the S_-m it used up.
    downlink_schema: ClassVar[RecordSchema] = {
        "sigma0_sq": ScalarSpec(0.0, MAX_RECORD_ABS),
        "others_precision": ScalarSpec(0.0, MAX_RECORD_ABS),
        "own_share": ScalarSpec(0.0, 1.0, required=False),
    }
    uplink_schema: ClassVar[RecordSchema] = {
        "sigma_sq": ScalarSpec(0.0, MAX_RECORD_ABS),
        "has_variance": ScalarSpec(0.0, 1.0, integer=True),
        "local_steps": ScalarSpec(0, MAX_STEPS, integer=True),
        "others_precision": ScalarSpec(0.0, MAX_RECORD_ABS, required=False),
    }
    screened_variance: ClassVar[str | None] = "sigma_sq"

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
        eqn10: str = "share",
        eqn10_max_factor: float | None = 1.0,
        step_rate_loss: str = "mean",
        early_variance: bool = True,
        max_local_epochs: float | None = 2.0,
    ) -> None:
        if algorithm not in (1, 2):
            raise HyperparameterError(f"Self-FL algorithm must be 1 or 2, got {algorithm}")
        self.algorithm = algorithm
        self.lr = require_positive(require_finite_scalar(lr, "learning rate"), "learning rate")
        self.batch_size = require_count(batch_size, "batch_size", minimum=1)
        self.l_max = require_count(l_max, "l_max", minimum=1)
        self.warmup_steps = require_count(warmup_steps, "warmup_steps")
        self.cluster_by_group = bool(cluster_by_group)
        self.intra_variance = require_choice(
            intra_variance, ("running", "problem"), "intra_variance"
        )
        if sigma0_sq is not None:
            require_non_negative(require_finite_scalar(sigma0_sq, "sigma0^2"), "sigma0^2")
        self.fixed_sigma0_sq = sigma0_sq
        self.converge_steps = require_count(converge_steps, "converge_steps")
        self.eqn10 = require_choice(eqn10, ("share", "paper"), "eqn10")
        self.eqn10_max_factor = (
            None
            if eqn10_max_factor is None
            else require_non_negative(
                require_finite_scalar(eqn10_max_factor, "eqn10_max_factor"), "eqn10_max_factor"
            )
        )
        self.step_rate_loss = require_choice(step_rate_loss, LOSS_SCALINGS, "step_rate_loss")
        self.early_variance = bool(early_variance)
        self.max_local_epochs = (
            None
            if max_local_epochs is None
            else require_positive(
                require_finite_scalar(max_local_epochs, "max_local_epochs"), "max_local_epochs"
            )
        )
        self.name = "selffl" if algorithm == 1 else "selffl-alg2"

    # ---- server side -------------------------------------------------------------------
    def init_server(self, initial_params: Tensor) -> ServerState:
        require_finite(initial_params, "initial parameters")
        s0 = 0.0 if self.fixed_sigma0_sq is None else float(self.fixed_sigma0_sq)
        return ServerState(
            round_id=0, global_params=initial_params.clone(), scalars={"sigma0_sq": s0}
        )

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

    def configure_client(
        self, server: ServerState, client_id: str, round_id: int
    ) -> ClientInstructions:
        scalars = {
            "sigma0_sq": float(server.scalars.get("sigma0_sq", 0.0)),
            "others_precision": self.others_precision(server, client_id),
        }
        share = server.clients.get(client_id, {}).get("share")
        if share is not None:
            scalars["own_share"] = float(share)
        return ClientInstructions(
            client_id=client_id,
            round_id=round_id,
            global_params=server.global_params,
            scalars=scalars,
        )

    def aggregate(
        self, server: ServerState, results: Iterable[ClientResult], activity_rate: float
    ) -> ServerState:
        # Pass 1: per-client scalars and the streaming inter-client variance (Eqn 14).
        rv = RunningVariance()
        reported: list[ReportedUncertainty] = []
        for r in results:
            sig = require_finite_scalar(
                r.scalars.get("sigma_sq", 0.0), f"sigma_m^2 of {r.client_id}"
            )
            rv.update(r.params)
            reported.append(
                ReportedUncertainty(
                    r.client_id, sig, r.scalars.get("has_variance", 1.0) > 0, r.group
                )
            )
        # Pass 2: Eqn 11 (and the cluster representatives).
        if self.cluster_by_group:
            return self._aggregate_clustered(server, results, reported, rv.value)
        return self.combine(
            server,
            reported,
            rv.value,
            lambda s0, sigmas: aggregate_stream(
                ((r.params, s) for r, s in zip(results, sigmas, strict=True)), s0
            ),
            activity_rate,
        )

    def round_sigma0_sq(
        self, server: ServerState, reported: list[ReportedUncertainty], spread: float
    ) -> float:
        """This round's sigma0^2: the fixed one, Eqn 14's `spread` (the trace variance of
        the round's models) when at least 2 clients reported, else the previous one."""
        if not reported:
            raise ConfigError("no client results to aggregate")
        if self.fixed_sigma0_sq is not None:
            return float(self.fixed_sigma0_sq)
        if len(reported) >= 2:
            return float(spread)
        return float(server.scalars.get("sigma0_sq", 0.0))

    @staticmethod
    def aggregation_sigmas(reported: list[ReportedUncertainty]) -> list[float]:
        """Each client's sigma_m^2 in Eqn 11: its own, or during its warm-up the mean of
        those reported by the clients that have one (0 if none)."""
        known = [u.sigma_sq for u in reported if u.has_variance]
        fill = sum(known) / len(known) if known else 0.0
        return [u.sigma_sq if u.has_variance else fill for u in reported]

    @staticmethod
    def _clients_after(
        server: ServerState, reported: list[ReportedUncertainty]
    ) -> dict[str, dict[str, float]]:
        clients = {cid: dict(v) for cid, v in server.clients.items()}
        for u in reported:
            info = clients.setdefault(u.client_id, {})
            if u.has_variance or not info.get("has_variance", 0.0):
                info.update(sigma_sq=u.sigma_sq, has_variance=1.0 if u.has_variance else 0.0)
        return clients

    def combine(
        self,
        server: ServerState,
        reported: list[ReportedUncertainty],
        spread: float,
        theta_hat: Callable[[float, list[float]], Tensor],
        activity_rate: float,
    ) -> ServerState:
        """The new state of a round aggregated without clusters, from its reported
        uncertainties (in the order the results came), the trace variance of its models
        (`spread`, Eqn 14) and `theta_hat(sigma0^2, sigmas)`, Eqn 11's precision-weighted
        mean. Both are sums over clients: the sharded server computes them from partial
        sums (server/partial_aggregate.py) and gets the same state as `aggregate`."""
        sigma0_sq = self.round_sigma0_sq(server, reported, spread)
        sigmas = self.aggregation_sigmas(reported)
        clients = self._clients_after(server, reported)
        new_global = smooth(server.global_params, theta_hat(sigma0_sq, sigmas), activity_rate)
        rate = require_activity_rate(activity_rate)
        for info in clients.values():
            if "share" in info:
                info["share"] *= 1.0 - rate
        for u, a in zip(reported, weight_shares(sigmas, sigma0_sq), strict=True):
            clients[u.client_id]["share"] = min(1.0, rate * a)
        return ServerState(
            round_id=server.round_id + 1,
            global_params=new_global,
            tensors=dict(server.tensors),
            scalars={**server.scalars, "sigma0_sq": sigma0_sq},
            clients=clients,
        )

    def _aggregate_clustered(
        self,
        server: ServerState,
        results: Iterable[ClientResult],
        reported: list[ReportedUncertainty],
        spread: float,
    ) -> ServerState:
        sigma0_sq = self.round_sigma0_sq(server, reported, spread)
        sigmas = self.aggregation_sigmas(reported)
        new_scalars = dict(server.scalars)
        new_tensors = dict(server.tensors)
        clients = self._clients_after(server, reported)
        new_global = aggregate_by_cluster(
            server,
            ((u.group, u.client_id, r.params) for u, r in zip(reported, results, strict=True)),
            sigmas,
            sigma0_sq,
            ClusterState(new_tensors, new_scalars, clients),
        )
        new_scalars["sigma0_sq"] = sigma0_sq
        return ServerState(
            round_id=server.round_id + 1,
            global_params=new_global,
            tensors=new_tensors,
            scalars=new_scalars,
            clients=clients,
        )

    def describe_result(self, record: dict[str, float]) -> str:
        return (
            f"{int(record.get('local_steps', 0))} local steps, "
            f"sigma_m^2={record.get('sigma_sq', 0.0):.4g}"
        )

    def describe_server(self, server: ServerState) -> str:
        return f"sigma0^2={server.scalars.get('sigma0_sq', 0.0):.4g}"

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
        rv = _load_variance(state)
        t_m = int(state.scalars.get("t_m", 0))
        sigma_m_sq = self._intra_variance(problem, rv)
        theta_init = self._initial_point(instructions, state, sigma_m_sq, s0, s_others)
        steps, steps_why = self._step_count(problem, sigma_m_sq, s_others)
        # With early_variance, a client's first round also keeps the iterate halfway through
        # the training that produces the model its variance is kept over.
        early = self.early_variance and self.intra_variance == "running" and rv.count == 0
        personal, sent, midway = self._local_training(theta_init, problem, generator, steps, early)
        tensors: dict[str, Tensor] = {"personal": personal}
        result_tensors: dict[str, Tensor] = {}
        if self.algorithm == 2:
            tensors["converged"] = sent
            result_tensors = {"personal": personal}
        if midway is not None:
            rv.update(midway)
        rv.update(sent)  # raises NonFiniteError before any state is replaced
        rv_state = rv.state_dict()
        tensors["rv_mean"] = rv_state["mean"]  # type: ignore[assignment]
        # A first round with early_variance reports the variance it just formed: the server
        # needs one for Eqn 11 and S_-m, and this is the best the client has.
        if sigma_m_sq is None and midway is not None:
            sigma_m_sq_report: float | None = rv.value
        else:
            sigma_m_sq_report = sigma_m_sq
        new_state = ClientState(
            tensors=tensors,
            scalars={"t_m": float(t_m + 1), "rv_count": float(rv.count), "rv_value": rv.value},
        )
        result = ClientResult(
            client_id=instructions.client_id,
            round_id=instructions.round_id,
            params=sent,
            num_samples=int(problem.num_samples),
            scalars={
                "sigma_sq": sigma_m_sq_report if sigma_m_sq_report is not None else 0.0,
                "has_variance": 0.0 if sigma_m_sq_report is None else 1.0,
                "local_steps": float(steps),
                "others_precision": s_others,
            },
            tensors=result_tensors,
            note=f"local steps: {steps_why}",
        )
        return result, new_state

    def _intra_variance(self, problem: LocalProblem, rv: RunningVariance) -> float | None:
        """sigma_m^2: the problem's known one, or the running variance once it has two
        models (None before: warm-up)."""
        if self.intra_variance == "problem":
            return require_finite_scalar(problem.sigma_sq, "problem sigma_m^2")  # type: ignore[attr-defined]
        return rv.value if rv.count >= 2 else None

    def _initial_point(
        self,
        instructions: ClientInstructions,
        state: ClientState,
        sigma_m_sq: float | None,
        s0: float,
        s_others: float,
    ) -> Tensor:
        """Eqn 10's starting point (the global model during warm-up)."""
        g = instructions.global_params
        anchor = state.tensors.get("converged" if self.algorithm == 2 else "personal")
        if sigma_m_sq is None or anchor is None:
            return g.clone()
        share = instructions.scalars.get("own_share") if self.eqn10 == "share" else None
        return initial_point(
            g,
            anchor,
            sigma_m_sq,
            s_others,
            sigma0_sq=s0,
            share=share,
            max_factor=self.eqn10_max_factor,
        )

    def _step_count(
        self, problem: LocalProblem, sigma_m_sq: float | None, s_others: float
    ) -> tuple[int, str]:
        """Eqn 16's local step count, capped at l_max and at the data's epochs, and why
        (rules.step_count_words)."""
        # A known sigma_m^2 (intra_variance="problem") already carries the data size
        # (sigma_m^2 = s^2 / n_m); the running variance of the client's models does not.
        epochs = self.max_local_epochs if self.intra_variance == "running" else None
        cap = data_step_cap(int(problem.num_samples), self.batch_size, epochs)
        l_cap = self.l_max if cap is None else min(self.l_max, cap)
        steps = local_steps(
            self.lr,
            self.batch_size,
            sigma_m_sq,
            s_others,
            l_cap,
            self.warmup_steps,
            loss=self.step_rate_loss,
        )
        why = step_count_words(steps, sigma_m_sq, s_others, self.l_max, cap, self.warmup_steps)
        return steps, why

    def _local_training(
        self,
        theta_init: Tensor,
        problem: LocalProblem,
        generator: torch.Generator,
        steps: int,
        early: bool,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The personal model, the model sent (Algorithm 2: trained on towards local
        convergence) and, with `early`, the iterate halfway through (else None)."""
        midway: Tensor | None = None
        if early and self.algorithm == 1:
            midway = sgd_steps(theta_init, problem, generator, self.lr, steps // 2)
            personal = sgd_steps(midway, problem, generator, self.lr, steps - steps // 2)
        else:
            personal = sgd_steps(theta_init, problem, generator, self.lr, steps)
        if self.algorithm != 2:
            return personal, personal, midway
        if early:
            half = self.converge_steps // 2
            midway = sgd_steps(personal, problem, generator, self.lr, half)
            sent = sgd_steps(midway, problem, generator, self.lr, self.converge_steps - half)
        else:
            sent = sgd_steps(personal, problem, generator, self.lr, self.converge_steps)
        return personal, sent, midway

    def personalized_params(
        self,
        server: ServerState,
        state: ClientState,
        problem: LocalProblem,
        generator: torch.Generator,
        client_id: str | None = None,
    ) -> Tensor:
        """The personal model a device holds after receiving the current broadcast: the
        Self-FL client rule (Eqns 10 and 16 and the local steps) applied to the latest global
        model and S_-m, without sending anything or changing `state`. A client that never
        took part starts from the global model (the warm-up rule).

        `client_id` lets S_-m leave this client's own precision out, as Eqns 10 and 16 ask;
        without it the client is not identifiable and the precision of every known client is
        used (one client more than S_-m at most)."""
        ins = self.configure_client(
            server, "\x00evaluation" if client_id is None else client_id, server.round_id + 1
        )
        result, _ = self.client_update(ins, state, problem, generator)
        return result.tensors.get("personal", result.params).clone()
