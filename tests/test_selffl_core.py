"""Closed-form and edge-case checks of the pure Self-FL rules."""

from __future__ import annotations

import math

import pytest
import torch

from wakefl.errors import ConfigError, NonFiniteError
from wakefl.sdk.selffl import (
    Representative,
    RunningVariance,
    aggregate,
    aggregate_clusters,
    aggregate_stream,
    initial_point,
    local_steps,
    smooth,
    trace_variance,
    update_representatives,
)


def _two_pass(xs: list[torch.Tensor]) -> float:
    stack = torch.stack(xs)
    return float(((stack - stack.mean(0)) ** 2).sum(1).mean())


def test_running_variance_matches_two_pass_on_random_data():
    g = torch.Generator().manual_seed(1)
    xs = [
        torch.randn(500, generator=g, dtype=torch.float64) * (1 + i % 3) + i * 0.1
        for i in range(60)
    ]
    rv = RunningVariance()
    for t, x in enumerate(xs, start=1):
        got = rv.update(x)
        if t >= 2:
            want = _two_pass(xs[:t])
            assert abs(got - want) / want < 1e-6
    assert rv.count == 60
    torch.testing.assert_close(rv.mean, torch.stack(xs).mean(0))


def test_running_variance_state_roundtrip_and_single_update():
    rv = RunningVariance()
    assert rv.update(torch.ones(3)) == 0.0 and rv.count == 1
    rv.update(torch.zeros(3))
    other = RunningVariance()
    other.load_state_dict(rv.state_dict())
    assert other.update(torch.full((3,), 2.0)) == pytest.approx(rv.update(torch.full((3,), 2.0)))
    assert other.value == pytest.approx(3 * (2 / 3))  # per-entry population var of {1,0,2}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_running_variance_refuses_non_finite_and_keeps_state(bad):
    rv = RunningVariance()
    rv.update(torch.zeros(4))
    rv.update(torch.ones(4))
    before = (rv.count, rv.value, rv.mean.clone())
    x = torch.ones(4)
    x[2] = bad
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        rv.update(x)
    assert (rv.count, rv.value) == before[:2]
    torch.testing.assert_close(rv.mean, before[2])
    with pytest.raises(ConfigError):
        rv.update(torch.ones(5))


def test_trace_variance_streams_a_generator():
    xs = [torch.tensor([float(i), 2.0 * i]) for i in range(5)]
    assert trace_variance(x for x in xs) == pytest.approx(_two_pass(xs))
    assert trace_variance([]) == 0.0


def test_initial_point_is_precision_weighted_mean_of_the_others():
    s0 = 0.3
    sig = [0.1, 0.5, 0.02, 1.0]
    params = [torch.tensor([1.0, -2.0], dtype=torch.float64) * (k + 1) for k in range(4)]
    w = [1 / (s0 + s) for s in sig]
    glob = sum(wk * p for wk, p in zip(w, params, strict=True)) / sum(w)
    for m in range(4):
        s_others = sum(w) - w[m]
        want = sum(w[k] * params[k] for k in range(4) if k != m) / s_others
        got = initial_point(glob, params[m], sig[m], s_others, sigma0_sq=s0)
        torch.testing.assert_close(got, want)


def test_initial_point_edge_cases():
    glob, pers = torch.tensor([1.0]), torch.tensor([3.0])
    torch.testing.assert_close(initial_point(glob, pers, 0.1, 0.0, sigma0_sq=0.1), glob)
    torch.testing.assert_close(initial_point(glob, pers, 0.1, math.inf, sigma0_sq=0.1), glob)
    torch.testing.assert_close(initial_point(glob, pers, 0.0, 2.0, sigma0_sq=0.0), glob)
    with pytest.raises(NonFiniteError):
        initial_point(torch.tensor([float("nan")]), pers, 0.1, 1.0, sigma0_sq=0.1)
    with pytest.raises(NonFiniteError):
        initial_point(glob, pers, float("nan"), 1.0, sigma0_sq=0.1)


def test_local_steps_solves_eqn16_and_exact_steps_give_eqn6():
    lr, b, sig, s_others = 0.001, 1, 0.05, 3.0
    steps = local_steps(lr, b, sig, s_others, 10_000, 5)
    exact = math.log(s_others / (1 / sig + s_others)) / math.log(1 - lr / (b * sig))
    assert steps == round(exact)
    # exact gradient descent from theta_init on (theta - z)^2/(2 sig) for `steps` steps is the
    # posterior mean under the prior N(theta_init, 1/S_-m) (Eqn 6), up to the integer rounding
    z, theta_init = 2.0, -1.0
    theta = theta_init
    for _ in range(steps):
        theta -= lr * (theta - z) / sig
    eqn6 = (z / sig + s_others * theta_init) / (1 / sig + s_others)
    assert abs(theta - eqn6) < 3 * abs(z - theta_init) * lr / sig


def test_local_steps_edge_cases():
    assert local_steps(0.01, 4, None, 2.0, 40, 7) == 7  # warm-up, t_m < 2
    assert local_steps(0.01, 4, None, 2.0, 5, 7) == 5  # warm-up capped at l_max
    assert local_steps(0.5, 1, 0.1, 2.0, 40, 7) == 40  # eta/(B sigma^2) >= 1
    assert local_steps(0.01, 1, 0.0, 2.0, 40, 7) == 40  # sigma^2 = 0
    assert local_steps(0.001, 1, 0.1, 0.0, 40, 7) == 40  # S_-m = 0
    assert local_steps(0.001, 1, 0.1, math.inf, 40, 7) == 1
    assert local_steps(0.001, 1, 0.1, 1e9, 40, 7) == 1  # clipped below at 1
    with pytest.raises(NonFiniteError):
        local_steps(0.01, 1, float("nan"), 1.0, 40, 7)
    with pytest.raises(NonFiniteError):
        local_steps(0.01, 1, 0.1, float("nan"), 40, 7)
    with pytest.raises(ConfigError):
        local_steps(-0.01, 1, 0.1, 1.0, 40, 7)


def test_aggregate_eqn11_stream_equals_batch():
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(7, generator=g, dtype=torch.float64) for _ in range(5)]
    sig = [0.1, 0.2, 0.05, 1.0, 0.3]
    s0 = 0.4
    w = torch.tensor([1 / (s0 + s) for s in sig], dtype=torch.float64)
    want = (w[:, None] * torch.stack(params)).sum(0) / w.sum()
    torch.testing.assert_close(aggregate(params, sig, s0), want)
    torch.testing.assert_close(aggregate(torch.stack(params), sig, s0), want)
    torch.testing.assert_close(aggregate_stream(iter(zip(params, sig, strict=True)), s0), want)
    # infinite precision (sigma0^2 = sigma_m^2 = 0) -> the plain mean of those clients
    torch.testing.assert_close(
        aggregate(params[:3], [0.0, 0.1, 0.0], 0.0), (params[0] + params[2]) / 2
    )
    with pytest.raises(NonFiniteError):
        aggregate([params[0], torch.full((7,), float("inf"), dtype=torch.float64)], [0.1, 0.1], s0)
    with pytest.raises(NonFiniteError):
        aggregate(params[:2], [0.1, float("nan")], s0)
    with pytest.raises(ConfigError):
        aggregate([], [], s0)


def test_smooth_with_activity_rate():
    prev, new = torch.tensor([0.0, 10.0]), torch.tensor([1.0, 0.0])
    torch.testing.assert_close(smooth(prev, new, 0.2), torch.tensor([0.2, 8.0]))
    torch.testing.assert_close(smooth(prev, new, 1.0), new)
    with pytest.raises(ConfigError):
        smooth(prev, new, 0.0)


def test_cluster_level_aggregation_keeps_inactive_representatives():
    reps = {"speaker": Representative(torch.tensor([5.0]), 0.5)}
    updates = [
        ("tv", torch.tensor([1.0]), 0.1),
        ("tv", torch.tensor([3.0]), 0.3),
        ("car", torch.tensor([0.0]), 0.2),
    ]
    out = update_representatives(reps, updates, sigma0_sq=0.1)
    assert set(out) == {"speaker", "tv", "car"}
    w1, w2 = 1 / 0.2, 1 / 0.4
    torch.testing.assert_close(out["tv"].params, torch.tensor([(w1 * 1 + w2 * 3) / (w1 + w2)]))
    assert out["tv"].sigma_sq == pytest.approx(1 / (1 / 0.1 + 1 / 0.3))
    torch.testing.assert_close(out["speaker"].params, torch.tensor([5.0]))
    glob, s0 = aggregate_clusters(out)
    vals = [out[k].params for k in sorted(out)]
    assert s0 == pytest.approx(trace_variance(vals))
    want = aggregate(vals, [out[k].sigma_sq for k in sorted(out)], s0)
    torch.testing.assert_close(glob, want)


def test_running_variance_overflow_of_finite_inputs_is_refused_and_state_kept():
    # Each input is finite, but their difference overflows float32.
    rv = RunningVariance()
    rv.update(torch.full((4,), -3e38))
    mean_before = rv.mean.clone()
    with pytest.raises(NonFiniteError, match="overflowed"):
        rv.update(torch.full((4,), 3e38))
    assert rv.count == 1 and rv.value == 0.0
    assert torch.equal(rv.mean, mean_before)


@pytest.mark.parametrize(
    ("sigma_m_sq", "s_others", "data_cap", "steps", "says"),
    [
        (
            None,
            1.0,
            None,
            20,
            "warm-up until it has a variance of its own (warmup_steps=20, cap l_max=20)",
        ),
        (
            None,
            1.0,
            4,
            4,
            "warm-up until it has a variance of its own (warmup_steps=20, "
            "cap 4 by its data's epochs, l_max=20)",
        ),
        (0.05, 10.0, None, 5, "Eqn 16 from sigma_m^2=0.05 and S_-m=10, cap l_max=20"),
        (0.5, 2.0, None, 20, "Eqn 16 from sigma_m^2=0.5 and S_-m=2, held at the cap l_max=20"),
        (
            0.5,
            2.0,
            4,
            4,
            "Eqn 16 from sigma_m^2=0.5 and S_-m=2, held at the cap 4 by its "
            "data's epochs, l_max=20",
        ),
        (
            0.05,
            0.0,
            None,
            20,
            "the cap l_max=20: no precision S_-m of other devices yet for Eqn 16",
        ),
        (
            0.05,
            math.inf,
            None,
            1,
            "Eqn 16's minimum: S_-m is infinite (the others pin the model), cap l_max=20",
        ),
    ],
)
def test_step_count_words_name_the_rule_and_inputs_that_set_the_count(
    sigma_m_sq, s_others, data_cap, steps, says
):
    from wakefl.sdk.selffl.rules import step_count_words

    l_cap = 20 if data_cap is None else min(20, data_cap)
    # the count the words explain is the rule's own (lr 0.01, B 1, l_max 20, warm-up 20)
    assert local_steps(0.01, 1, sigma_m_sq, s_others, l_cap, 20) == steps
    assert step_count_words(steps, sigma_m_sq, s_others, 20, data_cap, 20) == says


def test_local_steps_refuses_an_overflowing_step_count_with_its_documented_error():
    # eta/(B sigma_m^2) is subnormal: ln(ratio) / ln(1 - rate) overflows to +inf.
    with pytest.raises(NonFiniteError, match="step count"):
        local_steps(1e-320, 1, 1e-10, 1.0, 40, 7)
    with pytest.raises(NonFiniteError, match="step count"):
        local_steps(5e-324, 1, 1.0, 1.0, 40, 7)


def test_hyperparameter_errors_are_one_type_for_self_fl_and_the_baselines():
    from wakefl.sdk.selffl import HyperparameterError, SelfFL
    from wakefl.sdk.selffl.baselines import FedAvg

    for build in (
        lambda: SelfFL(lr=-1.0),
        lambda: FedAvg(lr=-1.0),
        lambda: local_steps(0.01, 0, 0.1, 1.0, 40, 7),
        lambda: smooth(torch.zeros(1), torch.zeros(1), 1.5),
    ):
        with pytest.raises(HyperparameterError) as caught:
            build()
        # Both the project's configuration error and Python's usual bad-argument error.
        assert isinstance(caught.value, ConfigError) and isinstance(caught.value, ValueError)


def test_precision_sum_refuses_a_cluster_update_of_another_size():
    updates = [("tv", torch.tensor([1.0, 2.0]), 0.1), ("tv", torch.tensor([3.0]), 0.3)]
    with pytest.raises(ConfigError, match="entries"):
        update_representatives({}, updates, sigma0_sq=0.1)


# ---- sparse participation and little data (docs/SELF_FL.md) ------------------------------


def test_eqn10_factor_is_bounded_and_never_extrapolates_past_the_bound():
    from wakefl.sdk.selffl.rules import eqn10_factor

    glob, pers = torch.tensor([1.0, -1.0]), torch.tensor([3.0, 0.0])
    # w_m / S_-m = (1 / 0.1) / (10 / 3) = 3: the paper extrapolates three times the distance
    assert eqn10_factor(0.05, 10 / 3, sigma0_sq=0.05) == pytest.approx(3.0)
    torch.testing.assert_close(
        initial_point(glob, pers, 0.05, 10 / 3, sigma0_sq=0.05), glob - 3.0 * (pers - glob)
    )
    # bounded at 1: theta_init = 2 theta - theta_m, as far from the global as theta_m is
    bounded = initial_point(glob, pers, 0.05, 10 / 3, sigma0_sq=0.05, max_factor=1.0)
    torch.testing.assert_close(bounded, 2 * glob - pers)
    assert float((bounded - glob).norm()) == pytest.approx(float((pers - glob).norm()))
    # below the bound the paper's factor is kept
    torch.testing.assert_close(
        initial_point(glob, pers, 0.05, 40.0, sigma0_sq=0.05, max_factor=1.0),
        glob - 0.25 * (pers - glob),
    )
    assert eqn10_factor(0.05, 1e-6, sigma0_sq=0.05, max_factor=0.5) == 0.5
    assert eqn10_factor(0.0, 2.0, sigma0_sq=0.0, max_factor=1.0) == 0.0  # w_m = inf: the global
    with pytest.raises(ConfigError):
        eqn10_factor(0.1, 1.0, sigma0_sq=0.1, max_factor=-1.0)


def test_eqn10_factor_from_the_realised_share_removes_exactly_that_share():
    from wakefl.sdk.selffl.rules import eqn10_factor

    # a = w_m / (w_m + S_-m) gives the paper's w_m / S_-m back (full participation)
    w_m, s_others = 1 / (0.3 + 0.1), 7.0
    a = w_m / (w_m + s_others)
    assert eqn10_factor(0.1, s_others, sigma0_sq=0.3, share=a) == pytest.approx(w_m / s_others)
    # any share: g = a x_m + (1 - a) rest  =>  theta_init = rest
    x_m, rest = (
        torch.tensor([2.0, 5.0], dtype=torch.float64),
        torch.tensor([-1.0, 0.5], dtype=torch.float64),
    )
    for a in (0.0, 0.05, 0.3, 0.5):
        g = a * x_m + (1 - a) * rest
        torch.testing.assert_close(initial_point(g, x_m, 0.1, 1.0, sigma0_sq=0.1, share=a), rest)
    # a share above one half is clipped by the bound; a share of 1 leaves nothing to recover
    assert eqn10_factor(0.1, 1.0, sigma0_sq=0.1, share=0.75, max_factor=1.0) == 1.0
    assert eqn10_factor(0.1, 1.0, sigma0_sq=0.1, share=1.0) == 0.0
    assert eqn10_factor(0.1, 1.0, sigma0_sq=0.1, share=1.0, max_factor=1.0) == 1.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError):
            eqn10_factor(0.1, 1.0, sigma0_sq=0.1, share=bad)
    with pytest.raises(NonFiniteError):
        eqn10_factor(0.1, 1.0, sigma0_sq=0.1, share=float("nan"))


def test_step_rate_for_the_mean_minibatch_loss_lands_at_eqn6_for_any_batch_size():
    from wakefl.sdk.selffl import GaussianLocalProblem
    from wakefl.sdk.selffl.rules import step_rate

    lr, b, sig, s_others = 0.002, 8, 0.05, 3.0
    assert step_rate(lr, b, sig, "mean") == pytest.approx(lr / sig)
    assert step_rate(lr, b, sig, "sum") == pytest.approx(lr / (b * sig))
    assert step_rate(lr, b, 0.0) == math.inf
    mean_steps = local_steps(lr, b, sig, s_others, 10_000, 5)
    sum_steps = local_steps(lr, b, sig, s_others, 10_000, 5, loss="sum")
    assert mean_steps == local_steps(lr, 1, sig, s_others, 10_000, 5, loss="sum")
    assert sum_steps == pytest.approx(b * mean_steps, rel=0.02)  # the paper's rule: ~B times
    # The minibatch gradient (theta - batch mean) / sig has expectation (theta - z) / sig, so
    # the mean of many runs follows the exact recursion: the mean-loss count hits Eqn 6.
    g = torch.Generator().manual_seed(0)
    samples = torch.randn(64, 1, generator=g, dtype=torch.float64)
    z, theta_init = float(samples.mean()), -2.0
    prob = GaussianLocalProblem(samples.mean(0), sig, 64, samples=samples, batch_size=b)
    eqn6 = (z / sig + s_others * theta_init) / (1 / sig + s_others)
    runs = []
    for seed in range(300):
        gen = torch.Generator().manual_seed(seed)
        x = torch.tensor([theta_init], dtype=torch.float64)
        for _ in range(mean_steps):
            x = x - lr * prob.gradient(x, gen)
        runs.append(float(x))
    exact_end = z + (1 - lr / sig) ** mean_steps * (theta_init - z)
    assert abs(exact_end - eqn6) < 0.01  # up to the integer rounding of l
    assert abs(sum(runs) / len(runs) - eqn6) < 0.03  # ~9 standard errors of the mean
    # the paper's B-scaled count trains ~B times too long: it ends near z, not at Eqn 6
    end_sum = z + (1 - lr / sig) ** sum_steps * (theta_init - z)
    assert abs(end_sum - z) < 0.1 * abs(eqn6 - z)


def test_data_step_cap_follows_the_local_data_size():
    from wakefl.sdk.selffl.rules import data_step_cap

    assert data_step_cap(40, 32, 2.0) == 4  # 2 minibatches an epoch, 2 epochs
    assert data_step_cap(10, 32, 2.0) == 2  # all 10 clips in one batch: one step an epoch
    assert data_step_cap(960, 32, 2.0) == 60
    assert data_step_cap(3, 1, 0.1) == 1  # at least one step
    assert data_step_cap(40, 32, None) is None
    with pytest.raises(ConfigError):
        data_step_cap(40, 32, 0.0)


def test_sampled_count_is_floor_of_c_m_at_least_one():
    from wakefl.sdk.selffl import sampled_count

    assert sampled_count(0.25, 20) == 5
    assert sampled_count(0.1, 20) == 2
    assert sampled_count(0.35, 8) == 2  # floor, where round() would give 3
    assert sampled_count(0.29, 100) == 29  # 0.29 * 100 = 28.999999999999996
    assert sampled_count(0.01, 5) == 1  # at least one
    assert sampled_count(1.0, 7) == 7
    for bad in ((0.0, 5), (1.5, 5), (0.5, 0), (0.5, 2.5)):
        with pytest.raises(ConfigError):
            sampled_count(*bad)


def test_weight_shares_sum_to_one_with_the_infinite_precision_limit():
    from wakefl.sdk.selffl.aggregation import weight_shares

    shares = weight_shares([0.1, 0.3, 0.6], 0.2)
    w = [1 / 0.3, 1 / 0.5, 1 / 0.8]
    assert shares == pytest.approx([x / sum(w) for x in w])
    assert weight_shares([0.0, 0.1, 0.0], 0.0) == [0.5, 0.0, 0.5]
    assert weight_shares([], 0.1) == []


def test_precision_sum_add_folded_equals_add_including_certain_clients():
    from wakefl.sdk.selffl.aggregation import PrecisionSum
    from wakefl.sdk.selffl.float64_chunks import add_scaled_

    g = torch.Generator().manual_seed(9)
    vecs = [torch.randn(1000, generator=g) for _ in range(3)]
    for sigmas, s0 in (([0.1, 0.4, 0.2], 0.3), ([0.0, 0.5, 0.0], 0.0)):
        a, b = PrecisionSum(1000, torch.float32), PrecisionSum(1000, torch.float32)
        for v, s in zip(vecs, sigmas, strict=True):
            a.add(v, s, s0, "v")
            b.add_folded(lambda acc, alpha, v=v: add_scaled_(acc, v, alpha), s, s0)
        assert torch.equal(a.mean("a"), b.mean("b"))
        assert a.pooled_variance() == b.pooled_variance()
