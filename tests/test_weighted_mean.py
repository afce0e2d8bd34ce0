"""server/aggregation.weighted_mean: Eqn 11 over recorded updates, packed and plain, kept and
clipped, in one thread or in parts summed apart and merged, equals the float64 formula."""

from __future__ import annotations

import pytest
import torch

from wakefl.protocol import messages as M
from wakefl.sdk.selffl.update_screening import Screening, Verdict
from wakefl.server.aggregation import weighted_mean
from wakefl.server.state_store import StateStore

D = 4099  # not a multiple of the int8 block


def _recorded(tmp_path, n: int) -> tuple[StateStore, torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(D, generator=g)
    store = StateStore(tmp_path / "state")
    store.open_round(1, [f"d{i:02d}" for i in range(n)], 1e12)
    decoded = []
    for i in range(n):
        params = base + 0.01 * (i + 1) * torch.randn(D, generator=g)
        up = M.Uplink("f", store.run_id(), f"d{i:02d}", "t", 1, params, 10, {})
        packed = i % 3 != 0  # some plain updates among the packed ones
        frame = M.encode(up, uplink_codec="int8-delta", base=base) if packed else M.encode(up)
        store.record_update(up, frame)
        msg = M.decode(frame)
        decoded.append(M.unpack_uplink(msg, base).params if packed else msg.params)
    return store, base, decoded


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_weighted_mean_in_parts_equals_the_formula(tmp_path, threads: int) -> None:
    n = 13
    store, base, decoded = _recorded(tmp_path, n)
    verdicts = [
        Verdict("refuse", 0.0, 1.0, 0.0) if i == 4
        else Verdict("clip", 0.5, 1.0, 0.0) if i == 7
        else Verdict("keep", 1.0, 1.0, 0.0)
        for i in range(n)
    ]  # fmt: skip
    screening = Screening(verdicts, None, None, 0.0, float("inf"), float("inf"))
    kept = [i for i in range(n) if i != 4]
    sigmas = [0.1 + 0.05 * i for i in kept]
    view = store.updates(1, D, base=lambda: base)
    got = weighted_mean(view, screening, base, 0.2, sigmas, threads=threads)
    num = torch.zeros(D, dtype=torch.float64)
    den = 0.0
    for i, s in zip(kept, sigmas, strict=True):
        x = decoded[i].double()
        if i == 7:
            x = base.double() + 0.5 * (x - base.double())
        w = 1.0 / (0.2 + s)
        num += w * x
        den += w
    torch.testing.assert_close(got.double(), num / den, rtol=0, atol=1e-6)
    store.close()
