"""Aggregation of a closed round in one process: screening (docs/PROTOCOL.md, Server
rule 6) and the strategy's `aggregate` over the recorded updates, read lazily from the
store. `screen_norms` is shared with the sharded coordinator, which gets the distances
from its workers instead of reading every update itself."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from wakefl.protocol.update_codec import Packed, decode
from wakefl.sdk.selffl.aggregation import PrecisionSum
from wakefl.sdk.selffl.float64_chunks import add_scaled_
from wakefl.sdk.selffl.selffl_strategy import SelfFL
from wakefl.sdk.selffl.strategy import ClientResult, ServerState, Strategy
from wakefl.sdk.selffl.update_screening import Screening, apply_scale, screen_updates
from wakefl.server.admission import Decision, refused_at_screening
from wakefl.server.partial_aggregate import merge_sums, reported_uncertainties
from wakefl.server.recorded_updates import UpdateView
from wakefl.server.round_receipts import RoundReceipts
from wakefl.server.server_session import ServerSession

log = logging.getLogger("wakefl.server")

# Eqn 11's pass at a round's close runs in this many threads (the machines this server
# runs on have 2 cores), each over at least this many updates.
CLOSE_THREADS = 2
MIN_UPDATES_PER_THREAD = 4

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
    """Screen a round's recorded updates and aggregate those kept, in this process.

    Self-FL without clusters reads each kept update once: its screening distances and
    Eqn 14's spread come from the round's receipts (server/round_receipts.py), and only
    Eqn 11's weighted mean reads the updates. Other strategies get the screened updates
    through their own `aggregate`."""

    def __init__(
        self,
        session: ServerSession,
        strategy: Strategy,
        refuse: Callable[[Decision], None],
        settle: Callable[[], object] | None = None,
    ) -> None:
        self.s = session
        self.strategy = strategy
        self._refuse = refuse
        # Waits (bounded) until the updates recorded so far are in the receipts: the last
        # ones are noted on the recorder's thread just after the round saw them recorded.
        self._settle = settle
        self._selffl = (
            strategy if isinstance(strategy, SelfFL) and not strategy.cluster_by_group else None
        )

    def __call__(self, state: ServerState, round_id: int, view: UpdateView) -> Aggregated:
        if not len(view):
            return self.strategy.skip_round(state), [], {}
        receipts = self._receipts(round_id, view, state.global_params)
        norms = [math.sqrt(receipts.sq_distance[row["device_id"]]) for row in view.rows]
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
        if self._selffl is None:
            return self.strategy.aggregate(state, keep, rate), keep.rows, screened
        spread = self._spread(receipts, view, screening)
        kept = [v for v in screening.verdicts if v.action != "refuse"]
        reported = reported_uncertainties(keep.rows, kept, self.strategy.screened_variance)

        def theta_hat(sigma0_sq: float, sigmas: list[float]) -> Tensor:
            return weighted_mean(view, screening, state.global_params, sigma0_sq, sigmas)

        new_state = self._selffl.combine(state, reported, spread, theta_hat, rate)
        return new_state, keep.rows, screened

    def _receipts(self, round_id: int, view: UpdateView, global_params: Tensor) -> RoundReceipts:
        """The round's receipts, sealed, with every recorded update in them: those ingest
        did not see in this process (a restart) are read from their files."""
        if self._settle is not None:
            self._settle()
        with self.s.lock:
            held = self.s.receipts
            if held is not None and held.round_id == round_id:
                self.s.receipts = None
        if held is None or held.round_id != round_id:
            held = RoundReceipts(round_id, global_params)
        held.seal()
        rows = view.rows
        missing = [i for i, row in enumerate(rows) if row["device_id"] not in held.sq_distance]
        for i, res in zip(missing, view.only(missing), strict=True):
            held.include(rows[i]["device_id"], res.params)
        return held

    @staticmethod
    def _spread(receipts: RoundReceipts, view: UpdateView, screening: Screening) -> float:
        """Eqn 14 over the screened models. Clipped updates (within the refusal bound) are
        read again to take their clipped part out of the receipts' sum. A refused update
        may be absurdly far (1e38 entries): subtracting it would cancel every digit of the
        honest sum, so when one is refused the sum is taken again over the kept updates."""
        verdicts = screening.verdicts
        kept = [
            (i, row["device_id"], v.scale)
            for i, (row, v) in enumerate(zip(view.rows, verdicts, strict=True))
            if v.action != "refuse"
        ]
        if len(kept) < len(verdicts):
            again = [i for i, _, _ in kept]
            scales = [s for _, _, s in kept]
            receipts.restart_sum(
                (res.params, s) for res, s in zip(view.only(again), scales, strict=True)
            )
        else:
            clipped = [i for i, v in enumerate(verdicts) if v.action == "clip"]
            for i, res in zip(clipped, view.only(clipped), strict=True):
                receipts.take_out(res.params, 1.0 - verdicts[i].scale)
        return receipts.spread([(dev, s) for _, dev, s in kept])


def weighted_mean(
    view: UpdateView,
    screening: Screening,
    global_params: Tensor,
    sigma0_sq: float,
    sigmas: list[float],
    threads: int = CLOSE_THREADS,
) -> Tensor:
    """Eqn 11 over the kept updates (`sigmas`: their sigma_m^2, in order), each read once,
    in up to `threads` contiguous parts summed apart and then merged: the reads, decodes
    and float64 sums release the GIL, so on two cores the parts overlap."""
    kept = [i for i, v in enumerate(screening.verdicts) if v.action != "refuse"]
    pairs = list(zip(kept, sigmas, strict=True))
    n = max(1, min(threads, len(pairs) // MIN_UPDATES_PER_THREAD))
    parts = [pairs[len(pairs) * k // n : len(pairs) * (k + 1) // n] for k in range(n)]

    def part_sum(part: list[tuple[int, float]]) -> PrecisionSum:
        return _weighted_part(view, screening, global_params, sigma0_sq, part)

    if n == 1:
        sums = [part_sum(pairs)]
    else:
        with ThreadPoolExecutor(n, thread_name_prefix="wakefl-close") as pool:
            sums = list(pool.map(part_sum, parts))
    return merge_sums(sums).mean("aggregated parameters")


def _weighted_part(
    view: UpdateView,
    screening: Screening,
    global_params: Tensor,
    sigma0_sq: float,
    part: list[tuple[int, float]],
) -> PrecisionSum:
    """Eqn 11's sums over some kept updates, (row, sigma_m^2) pairs, each read once: a
    packed update kept as it is is decoded into one reused float32 buffer and widened into
    the float64 sums a chunk at a time; the others are decoded, clipped and added."""
    total = PrecisionSum(global_params.numel(), global_params.dtype)
    buffer = np.empty(global_params.numel(), dtype=np.float32)  # one decode at a time
    for i, sig in part:
        scale = screening.verdicts[i].scale
        msg = view.read(i, keep_packed=scale == 1.0)
        packed = msg.packed
        if packed is not None:
            total.add_folded(_packed_fold(packed, view.round_base(), buffer), sig, sigma0_sq)
        else:
            flat = apply_scale(msg.params, global_params, scale)
            total.add(flat, sig, sigma0_sq, f"update of {msg.device_id}")
    return total


def _packed_fold(
    packed: Packed, base: Tensor, buffer: np.ndarray
) -> Callable[[Tensor, float], object]:
    """Adds alpha times a packed update, decoded into the pass's reused float32 buffer."""

    def fold(acc: Tensor, alpha: float) -> object:
        return add_scaled_(acc, decode(packed, base, out=buffer), alpha)

    return fold


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
