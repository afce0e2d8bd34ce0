"""Self-FL strategy and the in-process simulation on the scalar Gaussian model."""

from __future__ import annotations

import math

import pytest
import torch

from wakefl.errors import ConfigError, NonFiniteError, ProtocolError
from wakefl.sdk.selffl import (
    ClientInstructions,
    ClientState,
    GaussianLocalProblem,
    SelfFL,
    available_strategies,
    make_strategy,
    run_simulation,
)


def _gaussian_fleet(m: int, sigma0_sq: float, n_lo: int, n_hi: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(n_lo, n_hi + 1, (m,), generator=g)
    sig = 0.1 / n.double()
    theta = 1.6 + torch.randn(m, generator=g, dtype=torch.float64) * math.sqrt(sigma0_sq)
    z = theta + torch.randn(m, generator=g, dtype=torch.float64) * sig.sqrt()
    w = 1 / (sigma0_sq + sig)
    glob = float((w * z).sum() / w.sum())
    s_others = w.sum() - w
    personal = (z / sig + (w.sum() * glob - w * z)) / (1 / sig + s_others)
    problems = {f"c{i:02d}": GaussianLocalProblem(z[i], float(sig[i]), int(n[i])) for i in range(m)}
    return problems, glob, personal, sig


def _personal(res, m):
    return torch.stack([res.clients[f"c{i:02d}"].tensors["personal"] for i in range(m)]).reshape(-1)


@pytest.mark.slow  # thousands of local steps per round
def test_algorithm2_converges_to_closed_forms_eqn2_eqn3():
    m, s0 = 5, 1.0
    problems, glob, personal, sig = _gaussian_fleet(m, s0, 50, 100, seed=4)
    lr = 0.02 * float(sig.min())
    st = SelfFL(algorithm=2, lr=lr, l_max=100_000, intra_variance="problem", sigma0_sq=s0,
                converge_steps=2500)
    res = run_simulation(st, problems, torch.zeros(1, dtype=torch.float64), 6, 1.0, seed=0)
    # integer rounding of l moves the interpolation weight by at most ~lr/sigma^2 per step
    assert abs(float(res.server.global_params) - glob) < 1e-6
    err = (_personal(res, m) - personal).abs().max()
    assert err < 2e-3 * float((personal - glob).abs().max())
    steps = res.records[-1].local_steps
    assert all(s > 100 for s in steps.values())


@pytest.mark.slow  # thousands of local steps per round
def test_algorithm1_lands_near_closed_forms():
    # Algorithm 1 aggregates the early-stopped personal models, so its fixed point is close
    # to, not exactly at, Eqns 2-3; the gap is a small fraction of the spread.
    m, s0 = 5, 1.0
    problems, glob, personal, sig = _gaussian_fleet(m, s0, 50, 100, seed=4)
    st = SelfFL(algorithm=1, lr=0.02 * float(sig.min()), l_max=100_000,
                intra_variance="problem", sigma0_sq=s0)
    res = run_simulation(st, problems, torch.zeros(1, dtype=torch.float64), 20, 1.0, seed=0)
    spread = float((personal - glob).abs().max())
    assert abs(float(res.server.global_params) - glob) < 0.05 * spread
    assert float((_personal(res, m) - personal).abs().max()) < 0.05 * spread


def test_client_update_with_exact_steps_is_eqn6():
    st = SelfFL(algorithm=1, lr=1e-4, l_max=100_000, intra_variance="problem")
    prob = GaussianLocalProblem(torch.tensor([2.0, -1.0], dtype=torch.float64), 0.01, 10)
    s0, s_others = 0.5, 3.0
    glob = torch.tensor([0.5, 0.5], dtype=torch.float64)
    old = torch.tensor([1.0, 0.0], dtype=torch.float64)
    state = ClientState(tensors={"personal": old})
    ins = ClientInstructions("a", 3, glob, scalars={"sigma0_sq": s0, "others_precision": s_others})
    res, new = st.client_update(ins, state, prob, torch.Generator().manual_seed(0))
    w_m = 1 / (s0 + 0.01)
    theta_init = glob - w_m / s_others * (old - glob)
    steps = int(res.scalars["local_steps"])
    factor = (1 - 1e-4 / 0.01) ** steps
    torch.testing.assert_close(res.params, prob.optimum + factor * (theta_init - prob.optimum))
    eqn6 = (prob.optimum / 0.01 + s_others * theta_init) / (1 / 0.01 + s_others)
    torch.testing.assert_close(res.params, eqn6, atol=2e-3, rtol=0)
    assert new.scalars["t_m"] == 1.0
    assert state.tensors["personal"] is old  # the input state is not modified


def test_warm_up_until_two_rounds_then_running_variance():
    st = SelfFL(algorithm=1, lr=0.001, l_max=40, warmup_steps=7)
    prob = GaussianLocalProblem(torch.tensor([1.0]), 0.05, 20)
    glob = torch.tensor([0.0])
    state = ClientState()
    ins = ClientInstructions("a", 1, glob, scalars={"sigma0_sq": 0.1, "others_precision": 5.0})
    gen = torch.Generator().manual_seed(0)
    res1, state = st.client_update(ins, state, prob, gen)
    assert res1.scalars["local_steps"] == 7 and res1.scalars["has_variance"] == 0.0
    torch.testing.assert_close(res1.params, 1.0 - (1 - 0.001 / 0.05) ** 7 * torch.ones(1))
    res2, state = st.client_update(ins, state, prob, gen)
    assert res2.scalars["local_steps"] == 7  # t_m = 1 < 2: still warm-up
    res3, state = st.client_update(ins, state, prob, gen)
    assert res3.scalars["has_variance"] == 1.0 and state.scalars["t_m"] == 3.0
    assert res3.scalars["sigma_sq"] == pytest.approx(((res1.params - res2.params) ** 2).item() / 4)


class _BrokenProblem:
    num_samples = 3
    sigma_sq = 0.1

    def gradient(self, params, generator):
        return torch.full_like(params, float("nan"))


def test_non_finite_refused_and_state_kept():
    st = SelfFL(lr=0.01)
    keep = torch.tensor([0.3])
    state = ClientState(tensors={"personal": keep}, scalars={"t_m": 1.0})
    ins = ClientInstructions("a", 1, torch.tensor([0.0]), scalars={"sigma0_sq": 0.1, "others_precision": 1.0})
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        st.client_update(ins, state, _BrokenProblem(), torch.Generator())
    assert state.tensors["personal"] is keep and state.scalars == {"t_m": 1.0}
    bad = ClientInstructions("a", 1, torch.tensor([0.0]), scalars={"sigma0_sq": float("nan")})
    with pytest.raises(NonFiniteError):
        st.client_update(bad, state, GaussianLocalProblem(0.0, 0.1, 3), torch.Generator())
    server = st.init_server(torch.tensor([0.0]))
    res, _ = st.client_update(ins, ClientState(), GaussianLocalProblem(1.0, 0.1, 3), torch.Generator())
    import dataclasses

    with pytest.raises(NonFiniteError):
        st.aggregate(server, [dataclasses.replace(res, params=torch.tensor([float("inf")]))], 1.0)


class _WrongShapeProblem:
    num_samples = 3
    sigma_sq = 0.1

    def gradient(self, params, generator):
        return torch.zeros(params.numel() + 1, dtype=params.dtype)


def test_a_gradient_of_the_wrong_shape_is_refused():
    # Self-FL shares the baselines' SGD loop, which checks every gradient's shape: a
    # broadcastable but wrong gradient would otherwise silently reshape the model.
    ins = ClientInstructions("a", 1, torch.tensor([0.0]), scalars={"sigma0_sq": 0.1, "others_precision": 1.0})
    with pytest.raises(ProtocolError, match="gradient of shape"):
        SelfFL(lr=0.01).client_update(ins, ClientState(), _WrongShapeProblem(), torch.Generator())


def _noisy_fleet(seed: int):
    g = torch.Generator().manual_seed(seed)
    problems = {}
    for i in range(8):
        samples = 1.0 + 0.5 * i + torch.randn(30, 1, generator=g, dtype=torch.float64) * 0.3
        problems[f"c{i}"] = GaussianLocalProblem(samples.mean(0), 0.09 / 30, 30, samples=samples, batch_size=4)
    return problems


def test_determinism_under_seed_and_sampling_counters():
    problems = _noisy_fleet(0)
    init = torch.zeros(1, dtype=torch.float64)

    def go(seed):
        return run_simulation(SelfFL(lr=5e-4, l_max=30, warmup_steps=5), problems, init, 12, 0.25, seed)

    a, b, c = go(1), go(1), go(2)
    assert torch.equal(a.server.global_params, b.server.global_params)
    assert [r.sampled for r in a.records] == [r.sampled for r in b.records]
    assert not torch.equal(a.server.global_params, c.server.global_params)
    assert all(len(r.sampled) == 2 for r in a.records)
    counts = {cid: sum(cid in r.sampled for r in a.records) for cid in problems}
    assert counts == a.participation
    for cid, n in counts.items():
        assert a.clients[cid].scalars.get("t_m", 0.0) == n
    assert any(n == 0 or n < 12 for n in counts.values())
    assert all(r.sigma0_sq >= 0 for r in a.records)


def test_cluster_variant_through_simulation():
    problems = _noisy_fleet(1)
    groups = {cid: ("low" if int(cid[1:]) < 4 else "high") for cid in problems}
    st = SelfFL(lr=5e-4, l_max=30, warmup_steps=5, cluster_by_group=True)
    res = run_simulation(st, problems, torch.zeros(1, dtype=torch.float64), 10, 0.5, 3, groups=groups)
    reps = {k: v for k, v in res.server.tensors.items() if k.startswith("rep:")}
    assert set(reps) == {"rep:low", "rep:high"}
    assert float(reps["rep:low"]) < float(reps["rep:high"])
    lo, hi = sorted(float(v) for v in reps.values())
    assert lo <= float(res.server.global_params) <= hi


def test_registry_names():
    names = available_strategies()
    assert names[:2] == ["selffl", "selffl-alg2"]
    assert make_strategy("selffl-alg2", lr=0.1).algorithm == 2
    with pytest.raises(ConfigError, match="unknown strategy"):
        make_strategy("no-such-method")
    with pytest.raises(ConfigError):
        SelfFL(algorithm=3)


def test_personalized_params_leave_the_clients_own_precision_out_of_s_minus_m():
    from wakefl.sdk.selffl.rules import precision

    problems = _noisy_fleet(3)
    st = SelfFL(lr=5e-4, l_max=30, warmup_steps=5)
    res = run_simulation(st, problems, torch.zeros(1, dtype=torch.float64), 6, 1.0, seed=0)
    s0 = res.server.scalars["sigma0_sq"]
    for cid in ("c0", "c5"):
        # Eqns 10 and 16 use S_-m: the precisions of every other client, not this one's.
        want = sum(precision(s0, info["sigma_sq"]) for k, info in res.server.clients.items()
                   if k != cid)
        ins = st.configure_client(res.server, cid, res.server.round_id + 1)
        assert ins.scalars["others_precision"] == pytest.approx(want, rel=1e-12)
        exact, _ = st.client_update(ins, res.clients[cid], problems[cid],
                                    torch.Generator().manual_seed(9))
        with_id = st.personalized_params(res.server, res.clients[cid], problems[cid],
                                         torch.Generator().manual_seed(9), client_id=cid)
        anonymous = st.personalized_params(res.server, res.clients[cid], problems[cid],
                                           torch.Generator().manual_seed(9))
        assert torch.equal(with_id, exact.params)
        # Without the id the client's own precision is counted too: a different model.
        assert not torch.equal(anonymous, with_id)
