"""Self-FL's cluster-level aggregation (Appendix G.4, `cluster_by_group`) as the server state
keeps it: each cluster's representative (`tensors["rep:<group>"]` with
`scalars["rep_sigma_sq:<group>"]`), a numeric code per cluster (`scalars["cluster_code:<group>"]`,
since a client's record holds numbers only) and each client's share of the global model.
The maths of the representatives is in aggregation.py; this module reads and writes them
in the state."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor

from wakefl.sdk.selffl.aggregation import (
    Representative,
    aggregate_clusters,
    update_representatives,
    weight_shares,
)
from wakefl.sdk.selffl.strategy import ServerState

REP = "rep:"
REP_SIGMA_SQ = "rep_sigma_sq:"
CLUSTER_CODE = "cluster_code:"


@dataclass
class ClusterState:
    """The parts of the next server state that cluster-level aggregation writes (in place)."""

    tensors: dict[str, Tensor]
    scalars: dict[str, float]
    clients: dict[str, dict[str, float]]


def stored_representatives(server: ServerState) -> dict[str, Representative]:
    """Each cluster's representative as the server state keeps it."""
    return {
        k[len(REP) :]: Representative(v, server.scalars[REP_SIGMA_SQ + k[len(REP) :]])
        for k, v in server.tensors.items()
        if k.startswith(REP)
    }


def aggregate_by_cluster(
    server: ServerState,
    updates: Iterable[tuple[str, str, Tensor]],
    sigmas: list[float],
    sigma0_sq: float,
    out: ClusterState,
) -> Tensor:
    """Cluster-level Eqn 11: the round's updates ((group, client id, params), one per entry
    of `sigmas`, read once) update their group's representative, the representatives are
    aggregated; the new representatives and the clients' shares go into `out`. Returns the
    new global model."""
    members: list[tuple[str, str]] = []

    def tagged() -> Iterable[tuple[str, Tensor, float]]:
        for (group, client_id, params), sigma in zip(updates, sigmas, strict=True):
            members.append((group, client_id))
            yield group, params, sigma

    reps = update_representatives(stored_representatives(server), tagged(), sigma0_sq)
    new_global, cluster_s0 = aggregate_clusters(reps)
    for g, rep in reps.items():
        out.tensors[REP + g] = rep.params
        out.scalars[REP_SIGMA_SQ + g] = rep.sigma_sq
    out.scalars["cluster_sigma0_sq"] = cluster_s0
    cluster_shares(out, members, sigmas, sigma0_sq, reps, cluster_s0)
    return new_global


def _cluster_codes(scalars: dict[str, float], groups: Iterable[str]) -> dict[str, float]:
    """The code of every cluster, a new one (written to `scalars`) for a group not seen yet."""
    codes = {k[len(CLUSTER_CODE) :]: v for k, v in scalars.items() if k.startswith(CLUSTER_CODE)}
    for group in groups:
        if group not in codes:
            codes[group] = float(len(codes) + 1)
            scalars[CLUSTER_CODE + group] = codes[group]
    return codes


def cluster_shares(
    out: ClusterState,
    members: list[tuple[str, str]],
    sigmas: list[float],
    sigma0_sq: float,
    reps: dict[str, Representative],
    cluster_s0: float,
) -> None:
    """Each known client's weight in the cluster-level global model (in place): its
    weight in its cluster's representative (Eqn 11 within the cluster; 0 once the
    representative was replaced in a round it did not take part in) times the
    representative's weight in the global model (Eqn 11 over representatives).
    `members` are this round's (group, client id), in the order of `sigmas`."""
    by_group: dict[str, list[int]] = {}
    for i, (group, _) in enumerate(members):
        by_group.setdefault(group, []).append(i)
    codes = _cluster_codes(out.scalars, by_group)
    clients = out.clients
    active = {codes[g] for g in by_group}
    for info in clients.values():
        if info.get("cluster") in active:
            info["rep_share"] = 0.0
    for group, idx in by_group.items():
        for i, a in zip(idx, weight_shares([sigmas[i] for i in idx], sigma0_sq), strict=True):
            clients[members[i][1]].update(cluster=codes[group], rep_share=a)
    order = sorted(reps)
    by_code = {
        codes[g]: a
        for g, a in zip(
            order, weight_shares([reps[g].sigma_sq for g in order], cluster_s0), strict=True
        )
        if g in codes
    }
    for info in clients.values():
        if "cluster" in info:
            info["share"] = min(1.0, info.get("rep_share", 0.0) * by_code.get(info["cluster"], 0.0))
