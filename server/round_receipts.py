"""What ingest learns from each accepted update of the open round while the update is
decoded in memory, so that aggregating the round reads each update once, not three times
(docs/SCALE.md, "Server CPU per update").

Per update: its squared distance ||theta_m - g||^2 to the round's global model g (the
screening distance), and the float64 sum D of the differences theta_m - g over the
round's updates. Eqn 14's spread of the screened models y_m = g + s_m (theta_m - g) then
needs no second read of the updates kept as they are (s_m = 1): with K updates kept,

    sum_m (y_m - g)   = D - sum over the others of (1 - s_m)(theta_m - g)
    sum_m ||y_m - g||^2 = sum_m s_m^2 ||theta_m - g||^2
    spread            = (1/K) sum ||y_m - g||^2 - ||(1/K) sum (y_m - g)||^2

(the trace variance is the same about any point; g keeps the terms small). Only clipped
updates are read again, to take their clipped part out of D. A refused update can be
absurdly far, and subtracting it would cancel the honest sum's digits: when one is refused,
D is summed again over the kept updates (`restart_sum`), as every round did before. In
memory only: after a restart, the updates recorded before it are read from their files
and folded in at the round's close (`include`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from wakefl.protocol.update_codec import Packed, decode
from wakefl.sdk.selffl.float64_chunks import add_difference_, add_scaled_norm_


def spread_from_sums(centred_sum: Tensor, sq_norms: Sequence[float]) -> float:
    """The population trace variance of K vectors from the sum of their differences to a
    point and each difference's squared norm (0 for fewer than two vectors)."""
    k = len(sq_norms)
    if k < 2:
        return 0.0
    mean_sq = float(torch.dot(centred_sum, centred_sum)) / (k * k)
    return max(0.0, math.fsum(sq_norms) / k - mean_sq)


class RoundReceipts:
    """Distances and the difference sum of one round's accepted updates (see the module's
    docstring). `note` runs on ingest's threads until `seal`; after it, the round's
    aggregation alone folds in what ingest did not see (`include`) and takes out what
    screening refused or clipped (`take_out`)."""

    def __init__(self, round_id: int, global_params: Tensor) -> None:
        self.round_id = round_id
        # float64 once per round: every difference below is then float64 - float64
        # (a float32 operand takes torch's slower mixed-dtype path).
        self.global_params = global_params.detach().reshape(-1).to(torch.float64)
        self.centred_sum = torch.zeros(self.global_params.numel(), dtype=torch.float64)
        self.sq_distance: dict[str, float] = {}
        self._lock = threading.Lock()
        self._sealed = False
        self._offset: tuple[Tensor, Tensor] | None = None  # (base, base - g in float32)
        self._buffer = np.empty(0, dtype=np.float32)

    def note(self, device: str, params: Tensor) -> bool:
        """Fold in an accepted update on receipt; False (nothing done) once sealed, for a
        device already noted, or for a vector of another size."""
        with self._lock:
            if self._sealed or device in self.sq_distance:
                return False
            if params.numel() != self.global_params.numel():
                return False
            self._add(device, params)
            return True

    def note_packed(self, device: str, packed: Packed, base: Tensor) -> bool:
        """`note` for a packed update (its checksum verified) against the round's `base`:
        its difference to the global model is decoded in float32 as (base - g) + delta
        into one buffer reused for the round, then widened a chunk at a time."""
        with self._lock:
            if self._sealed or device in self.sq_distance:
                return False
            if packed.numel != self.global_params.numel():
                return False
            if self._offset is None or self._offset[0] is not base:
                # base - g is small (the downlink's rounding of g): exact enough in float32
                gap = base.detach().reshape(-1).to(torch.float64) - self.global_params
                self._offset = (base, gap.to(torch.float32))
                self._buffer = np.empty(packed.numel, dtype=np.float32)
            diff = decode(packed, self._offset[1], out=self._buffer)
            self.sq_distance[device] = add_scaled_norm_(self.centred_sum, diff, 1.0)
            return True

    def seal(self) -> None:
        """No more `note`s: the round is being aggregated."""
        with self._lock:
            self._sealed = True

    def include(self, device: str, params: Tensor) -> None:
        """Fold in an update read from its file (recorded before a restart, or after the
        seal)."""
        if device not in self.sq_distance:
            self._add(device, params)

    def take_out(self, params: Tensor, factor: float) -> None:
        """D -= factor (theta_m - g): a refused update (factor 1) or one clipped to scale
        s (factor 1 - s)."""
        add_difference_(self.centred_sum, params, self.global_params, -factor)

    def restart_sum(self, screened: Iterable[tuple[Tensor, float]]) -> None:
        """D = sum of s_m (theta_m - g) over the given (update, scale) pairs alone."""
        self.centred_sum.zero_()
        for params, scale in screened:
            add_difference_(self.centred_sum, params, self.global_params, scale)

    def spread(self, kept: Sequence[tuple[str, float]]) -> float:
        """Eqn 14 over the kept updates, (device, scale) pairs, once every refused and
        clipped update has been taken out."""
        return spread_from_sums(
            self.centred_sum, [s * s * self.sq_distance[dev] for dev, s in kept]
        )

    def _add(self, device: str, params: Tensor) -> None:
        self.sq_distance[device] = add_difference_(
            self.centred_sum, params, self.global_params, 1.0
        )
