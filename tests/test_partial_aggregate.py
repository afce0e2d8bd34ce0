"""Sharded aggregation's maths (server/partial_aggregate.py): partial sums over shards of
a round's updates, sent through the shard-result encoding and merged, give the state the
single-process server computes from the same updates (screening included)."""

from __future__ import annotations

import json

import pytest
import torch

from wakefl.errors import ConfigError
from wakefl.sdk.selffl.registry import make_strategy
from wakefl.sdk.selffl.strategy import ClientResult
from wakefl.sdk.selffl.update_screening import screen_updates
from wakefl.server.aggregation_server import ScreenedUpdates
from wakefl.server.partial_aggregate import (
    merge_spreads,
    merge_sums,
    reported_uncertainties,
    require_shardable,
    shard_norms,
    shard_spread,
    shard_sum,
)
from wakefl.server.shard_tasks import ShardResult

D = 3000


class _View:
    """The server's lazy update view, over updates held in memory."""

    def __init__(self, results: list[ClientResult], rows: list[dict]) -> None:
        self.rows, self._results = rows, results

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self._results)


def _round(n: int, seed: int, global_params: torch.Tensor):
    g = torch.Generator().manual_seed(seed)
    results, rows = [], []
    for i in range(n):
        params = global_params + 0.1 * torch.randn(D, generator=g) + 0.02 * i
        if i == 3:
            params = global_params + 2.0 * torch.randn(D, generator=g)  # clipped
        if i == 5:
            params = global_params + 1e4 * torch.randn(D, generator=g)  # refused
        has_var = 0.0 if i == 7 else 1.0
        record = {"sigma_sq": 0.0 if i == 7 else 0.05 + 0.01 * i, "has_variance": has_var}
        if i == 2:
            record["sigma_sq"] = 1e-6  # raised to the floor
        dev, typ = f"d{i}", "speaker" if i % 2 else "tv"
        results.append(ClientResult(dev, 1, params, 10, dict(record), {}, typ))
        rows.append({"device_id": dev, "device_type": typ, "record": json.dumps(record)})
    return results, rows


def _sharded(strategy, state, results, rows, screening, rate, shards):
    """The coordinator's merge, each shard's partials through the wire encoding."""
    g = state.global_params
    kept = [
        (res, row, v)
        for res, row, v in zip(results, rows, screening.verdicts, strict=True)
        if v.action != "refuse"
    ]

    def wire(result: ShardResult) -> ShardResult:
        return ShardResult.decode(result.encode())

    spreads = [
        wire(
            ShardResult(
                "t",
                "w",
                spread=shard_spread([r.params for r, _, _ in k], [v.scale for _, _, v in k], g),
            )
        ).spread
        for k in (kept[a:b] for a, b in shards)
    ]
    reported = reported_uncertainties([r for _, r, _ in kept], [v for _, _, v in kept], "sigma_sq")

    def theta_hat(s0, sigmas):
        parts = []
        for a, b in shards:
            k = kept[a:b]
            psum = shard_sum(
                [r.params for r, _, _ in k], [v.scale for _, _, v in k], sigmas[a:b], s0, g
            )
            parts.append(wire(ShardResult("t", "w", psum=psum)).psum)
        return merge_sums(parts).mean("aggregated parameters")

    return strategy.combine(state, reported, merge_spreads(spreads).value, theta_hat, rate)


@pytest.mark.parametrize("shards", [[(0, 9)], [(0, 4), (4, 9)], [(0, 2), (2, 5), (5, 7), (7, 9)]])
def test_sharded_merge_equals_single_process_aggregation(shards):
    strategy = make_strategy("selffl")
    state = strategy.init_server(torch.randn(D, generator=torch.Generator().manual_seed(1)))
    for rnd in (1, 2):
        results, rows = _round(10, rnd, state.global_params)
        norms = shard_norms([r.params for r in results[:6]], state.global_params)
        norms += shard_norms([r.params for r in results[6:]], state.global_params)
        sigmas = [json.loads(r["record"])["sigma_sq"] for r in rows]
        gnorm = float(torch.linalg.vector_norm(state.global_params.double()))
        screening = screen_updates(norms, sigmas, gnorm)
        assert [v.action for v in screening.verdicts].count("clip") == 1
        assert [v.action for v in screening.verdicts].count("refuse") == 1
        keep = ScreenedUpdates(_View(results, rows), screening, state.global_params, "sigma_sq")
        rate = len(keep.rows) / 12
        single = strategy.aggregate(state, keep, rate)
        sharded = _sharded(strategy, state, results, rows, screening, rate, shards)
        torch.testing.assert_close(sharded.global_params, single.global_params, rtol=0, atol=1e-6)
        assert sharded.scalars["sigma0_sq"] == pytest.approx(single.scalars["sigma0_sq"], rel=1e-6)
        assert sharded.clients.keys() == single.clients.keys()
        for cid, info in single.clients.items():
            assert sharded.clients[cid] == pytest.approx(info, rel=1e-9)
        state = single


def test_merged_spread_is_the_trace_variance_of_all_vectors():
    xs = [torch.randn(50, dtype=torch.float64) * (i + 1) for i in range(7)]
    parts = [
        shard_spread(xs[a:b], [1.0] * (b - a), torch.zeros(50)) for a, b in [(0, 1), (1, 5), (5, 7)]
    ]
    stacked = torch.stack(xs)
    want = float(((stacked - stacked.mean(0)) ** 2).sum(1).mean())
    assert merge_spreads(parts).value == pytest.approx(want, rel=1e-12)


def test_other_strategies_and_cluster_mode_are_refused():
    with pytest.raises(ConfigError, match="Self-FL strategies only"):
        require_shardable(make_strategy("fedavg-w"))
    with pytest.raises(ConfigError, match="cluster mode"):
        require_shardable(make_strategy("selffl", cluster_by_group=True))
    require_shardable(make_strategy("selffl-alg2"))
