"""Aggregation of a closed round in one process: screening (docs/PROTOCOL.md, Server
rule 6) and the strategy's `aggregate` over the recorded updates, read lazily from the
store. `screen_norms` is shared with the sharded coordinator, which gets the distances
from its workers instead of reading every update itself."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from wakefl.sdk.selffl.strategy import ClientResult, ServerState, Strategy
from wakefl.sdk.selffl.update_screening import Screening, apply_scale, delta_norm, screen_updates
from wakefl.server.admission import Decision, refused_at_screening
from wakefl.server.recorded_updates import UpdateView
from wakefl.server.server_session import ServerSession

log = logging.getLogger("wakefl.server")

# The new state, the rows of the updates kept, and device -> "clip/refuse: why".
Aggregated = tuple[ServerState, list[dict], dict[str, str]]


def screen_norms(
    session: ServerSession,
    strategy: Strategy,
    round_id: int,
    rows: list[dict],
    norms: list[float],
    global_params: Tensor,
    refuse: Callable[[Decision], None],
) -> Screening:
    """Screening from the updates' distances to the global model and the variances of
    their recorded rows; refused updates go to `refuse` (counted, never acked again)."""
    store, rules = session.store, session.cfg.screening
    key = strategy.screened_variance
    sigmas = [
        float(json.loads(row["record"]).get(key, 0.0)) if key is not None else 0.0 for row in rows
    ]
    prev = store.get_meta("screening_reference") or {}
    screening = screen_updates(
        norms,
        sigmas,
        float(torch.linalg.vector_norm(global_params.double())),
        rules,
        previous_norm=prev.get("norm"),
        previous_sigma_sq=prev.get("sigma_sq"),
    )
    if len(norms) >= rules.min_reference_updates:
        store.set_meta(
            screening_reference={
                "norm": screening.reference_norm,
                "sigma_sq": screening.reference_sigma_sq,
            }
        )
    for row, v in zip(rows, screening.verdicts, strict=True):
        if v.action == "refuse":
            refuse(refused_at_screening(v.reason, row["device_id"], round_id))
        elif v.action == "clip":
            log.warning("round %d: update from %s %s", round_id, row["device_id"], v.reason)
    return screening


def screened_devices(rows: list[dict], screening: Screening) -> dict[str, str]:
    return {
        r["device_id"]: f"{v.action}: {v.reason}"
        for r, v in zip(rows, screening.verdicts, strict=True)
        if v.action != "keep"
    }


class LocalAggregation:
    """Screen a round's recorded updates and aggregate those kept, in this process."""

    def __init__(
        self, session: ServerSession, strategy: Strategy, refuse: Callable[[Decision], None]
    ) -> None:
        self.s = session
        self.strategy = strategy
        self._refuse = refuse

    def __call__(self, state: ServerState, round_id: int, view: UpdateView) -> Aggregated:
        if not len(view):
            return self.strategy.skip_round(state), [], {}
        norms = self._distances(round_id, view, state.global_params)
        screening = screen_norms(
            self.s, self.strategy, round_id, view.rows, norms, state.global_params, self._refuse
        )
        keep = ScreenedUpdates(
            view, screening, state.global_params, self.strategy.screened_variance
        )
        screened = screened_devices(view.rows, screening)
        if not keep.rows:
            return self.strategy.skip_round(state), [], screened
        rate = self.strategy.activity_share(len(keep.rows), len(self.s.registry()))
        return self.strategy.aggregate(state, keep, rate), keep.rows, screened

    def _distances(self, round_id: int, view: UpdateView, global_params: Tensor) -> list[float]:
        """Each update's distance to the global model: taken at ingest when this process
        accepted it (`ServerSession.norms`), read from its file otherwise (a restart)."""
        noted = self.s.norms
        with self.s.lock:
            found = {d: noted.pop((r, d)) for r, d in list(noted) if r == round_id}
            for key in [k for k in noted if k[0] < round_id]:
                del noted[key]  # rounds aggregated without them
        rows = view.rows
        missing = [i for i, row in enumerate(rows) if row["device_id"] not in found]
        for i, res in zip(missing, view.only(missing), strict=True):
            found[rows[i]["device_id"]] = delta_norm(res.params, global_params)
        return [found[row["device_id"]] for row in rows]


class ScreenedUpdates:
    """A round's recorded updates after screening, as the strategy's lazy update view:
    refused updates left out, clipped ones scaled back towards the global model, every
    reported variance (the strategy's `screened_variance`) raised to the round's floor.
    Re-iterable, one update in memory at a time."""

    def __init__(
        self,
        view: UpdateView,
        screening: Screening,
        global_params: Tensor,
        variance: str | None = None,
    ) -> None:
        self._view = view
        self._global = global_params
        self._variance = variance  # the record entry raised to the round's floor
        pairs = list(zip(view.rows, screening.verdicts, strict=True))
        self._verdicts = {r["device_id"]: v for r, v in pairs}
        self.rows = [r for r, v in pairs if v.action != "refuse"]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[ClientResult]:
        for res in self._view:
            v = self._verdicts[res.client_id]
            if v.action == "refuse":
                continue
            scalars = dict(res.scalars)
            if self._variance is not None:
                scalars[self._variance] = v.sigma_sq
            yield ClientResult(
                client_id=res.client_id,
                round_id=res.round_id,
                params=apply_scale(res.params, self._global, v.scale),
                num_samples=res.num_samples,
                scalars=scalars,
                tensors=res.tensors,
                group=res.group,
            )
