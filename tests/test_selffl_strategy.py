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
    initial_point,
    local_steps,
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
    st = SelfFL(
        algorithm=2,
        lr=lr,
        l_max=100_000,
        intra_variance="problem",
        sigma0_sq=s0,
        converge_steps=2500,
    )
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
    st = SelfFL(
        algorithm=1,
        lr=0.02 * float(sig.min()),
        l_max=100_000,
        intra_variance="problem",
        sigma0_sq=s0,
    )
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
    # The paper's rule (early_variance=False): the variance exists from the third round.
    st = SelfFL(algorithm=1, lr=0.001, l_max=40, warmup_steps=7, early_variance=False)
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
    ins = ClientInstructions(
        "a", 1, torch.tensor([0.0]), scalars={"sigma0_sq": 0.1, "others_precision": 1.0}
    )
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        st.client_update(ins, state, _BrokenProblem(), torch.Generator())
    assert state.tensors["personal"] is keep and state.scalars == {"t_m": 1.0}
    bad = ClientInstructions("a", 1, torch.tensor([0.0]), scalars={"sigma0_sq": float("nan")})
    with pytest.raises(NonFiniteError):
        st.client_update(bad, state, GaussianLocalProblem(0.0, 0.1, 3), torch.Generator())
    server = st.init_server(torch.tensor([0.0]))
    res, _ = st.client_update(
        ins, ClientState(), GaussianLocalProblem(1.0, 0.1, 3), torch.Generator()
    )
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
    ins = ClientInstructions(
        "a", 1, torch.tensor([0.0]), scalars={"sigma0_sq": 0.1, "others_precision": 1.0}
    )
    with pytest.raises(ProtocolError, match="gradient of shape"):
        SelfFL(lr=0.01).client_update(ins, ClientState(), _WrongShapeProblem(), torch.Generator())


def _noisy_fleet(seed: int):
    g = torch.Generator().manual_seed(seed)
    problems = {}
    for i in range(8):
        samples = 1.0 + 0.5 * i + torch.randn(30, 1, generator=g, dtype=torch.float64) * 0.3
        problems[f"c{i}"] = GaussianLocalProblem(
            samples.mean(0), 0.09 / 30, 30, samples=samples, batch_size=4
        )
    return problems


def test_determinism_under_seed_and_sampling_counters():
    problems = _noisy_fleet(0)
    init = torch.zeros(1, dtype=torch.float64)

    def go(seed):
        return run_simulation(
            SelfFL(lr=5e-4, l_max=30, warmup_steps=5), problems, init, 12, 0.25, seed
        )

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
    res = run_simulation(
        st, problems, torch.zeros(1, dtype=torch.float64), 10, 0.5, 3, groups=groups
    )
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
        want = sum(
            precision(s0, info["sigma_sq"]) for k, info in res.server.clients.items() if k != cid
        )
        ins = st.configure_client(res.server, cid, res.server.round_id + 1)
        assert ins.scalars["others_precision"] == pytest.approx(want, rel=1e-12)
        exact, _ = st.client_update(
            ins, res.clients[cid], problems[cid], torch.Generator().manual_seed(9)
        )
        with_id = st.personalized_params(
            res.server,
            res.clients[cid],
            problems[cid],
            torch.Generator().manual_seed(9),
            client_id=cid,
        )
        anonymous = st.personalized_params(
            res.server, res.clients[cid], problems[cid], torch.Generator().manual_seed(9)
        )
        assert torch.equal(with_id, exact.params)
        # Without the id the client's own precision is counted too: a different model.
        assert not torch.equal(anonymous, with_id)


# ---- sparse participation and little data (docs/SELF_FL.md) ------------------------------

PAPER_RULES = {
    "eqn10": "paper",
    "eqn10_max_factor": None,
    "step_rate_loss": "sum",
    "early_variance": False,
    "max_local_epochs": None,
}


def test_early_variance_exists_after_the_first_round():
    st = SelfFL(algorithm=1, lr=0.001, l_max=40, warmup_steps=8)
    prob = GaussianLocalProblem(torch.tensor([1.0], dtype=torch.float64), 0.05, 100)
    glob = torch.tensor([0.0], dtype=torch.float64)
    ins = ClientInstructions("a", 1, glob, scalars={"sigma0_sq": 0.1, "others_precision": 5.0})
    gen = torch.Generator().manual_seed(0)
    res1, state = st.client_update(ins, ClientState(), prob, gen)
    # warm-up steps, but the iterate after 4 of the 8 steps joins the running variance
    assert res1.scalars["local_steps"] == 8 and res1.scalars["has_variance"] == 1.0
    r = 0.001 / 0.05
    mid, end = 1.0 - (1 - r) ** 4, 1.0 - (1 - r) ** 8
    torch.testing.assert_close(res1.params, torch.tensor([end], dtype=torch.float64))
    assert res1.scalars["sigma_sq"] == pytest.approx((end - mid) ** 2 / 4)
    assert state.scalars["rv_count"] == 2.0 and state.scalars["t_m"] == 1.0
    # the second round already runs Eqns 10 and 16 with that variance
    res2, state = st.client_update(ins, state, prob, gen)
    sig = (end - mid) ** 2 / 4
    assert res2.scalars["sigma_sq"] == pytest.approx(sig)
    assert res2.scalars["local_steps"] == local_steps(0.001, 1, sig, 5.0, 40, 8)
    # the paper's rule: still warm-up in the second round
    paper = SelfFL(algorithm=1, lr=0.001, l_max=40, warmup_steps=8, early_variance=False)
    p1, pstate = paper.client_update(ins, ClientState(), prob, torch.Generator().manual_seed(0))
    assert p1.scalars["has_variance"] == 0.0
    torch.testing.assert_close(
        p1.params, res1.params
    )  # the same training, only the bookkeeping differs


def test_early_variance_algorithm2_uses_the_converge_phase():
    st = SelfFL(algorithm=2, lr=0.001, l_max=40, warmup_steps=4, converge_steps=6)
    prob = GaussianLocalProblem(torch.tensor([1.0], dtype=torch.float64), 0.05, 100)
    ins = ClientInstructions(
        "a",
        1,
        torch.tensor([0.0], dtype=torch.float64),
        scalars={"sigma0_sq": 0.1, "others_precision": 5.0},
    )
    res, state = st.client_update(ins, ClientState(), prob, torch.Generator().manual_seed(0))
    r = 0.001 / 0.05
    mid, end = 1.0 - (1 - r) ** 7, 1.0 - (1 - r) ** 10
    assert res.scalars["sigma_sq"] == pytest.approx((end - mid) ** 2 / 4)
    torch.testing.assert_close(state.tensors["converged"], torch.tensor([end], dtype=torch.float64))


def test_step_count_follows_the_local_data_size():
    # 40 clips, B = 32: two minibatches an epoch, 2 epochs -> at most 4 steps
    st = SelfFL(lr=0.001, batch_size=32, l_max=20, warmup_steps=10)
    prob = GaussianLocalProblem(torch.tensor([1.0], dtype=torch.float64), 0.05, 40)
    ins = ClientInstructions(
        "a",
        1,
        torch.tensor([0.0], dtype=torch.float64),
        scalars={"sigma0_sq": 0.1, "others_precision": 5.0},
    )
    gen = torch.Generator().manual_seed(0)
    res, state = st.client_update(ins, ClientState(), prob, gen)
    assert res.scalars["local_steps"] == 4
    assert res.note == (
        "local steps: warm-up until it has a variance of its own "
        "(warmup_steps=10, cap 4 by its data's epochs, l_max=20)"
    )
    res, state = st.client_update(ins, state, prob, gen)  # Eqn 16 is capped too
    assert res.scalars["local_steps"] <= 4
    # the note names the variance Eqn 16 used (the one kept before this round) and S_-m
    assert res.note.startswith("local steps: Eqn 16 from sigma_m^2=") and "S_-m=5," in res.note
    assert res.note.endswith("cap 4 by its data's epochs, l_max=20")
    big = GaussianLocalProblem(torch.tensor([1.0], dtype=torch.float64), 0.05, 960)
    res, _ = st.client_update(ins, ClientState(), big, gen)
    assert res.scalars["local_steps"] == 10
    uncapped = SelfFL(lr=0.001, batch_size=32, l_max=20, warmup_steps=10, max_local_epochs=None)
    res, _ = uncapped.client_update(ins, ClientState(), prob, gen)
    assert res.scalars["local_steps"] == 10


def test_paper_rules_switch_back_for_ablations():
    st = SelfFL(lr=0.0005, batch_size=4, l_max=10_000, **PAPER_RULES)
    prob = GaussianLocalProblem(torch.tensor([1.0], dtype=torch.float64), 0.05, 20)
    state = ClientState(
        tensors={
            "personal": torch.tensor([3.0], dtype=torch.float64),
            "rv_mean": torch.tensor([2.0], dtype=torch.float64),
        },
        scalars={"t_m": 2.0, "rv_count": 2.0, "rv_value": 0.01},
    )
    glob = torch.tensor([1.0], dtype=torch.float64)
    ins = ClientInstructions(
        "a", 3, glob, scalars={"sigma0_sq": 0.0, "others_precision": 20.0, "own_share": 0.1}
    )
    res, _ = st.client_update(ins, state, prob, torch.Generator().manual_seed(0))
    assert res.scalars["local_steps"] == local_steps(0.0005, 4, 0.01, 20.0, 10_000, 20, loss="sum")
    # unbounded paper factor w_m / S_-m = 100 / 20 = 5, the server's share ignored
    theta_init = 1.0 - 5.0 * (3.0 - 1.0)
    steps = int(res.scalars["local_steps"])
    want = 1.0 + (1 - 0.0005 / 0.05) ** steps * (theta_init - 1.0)
    assert float(res.params) == pytest.approx(want)
    new = SelfFL(lr=0.0005, batch_size=4, l_max=10_000)
    many = GaussianLocalProblem(torch.tensor([1.0], dtype=torch.float64), 0.05, 2000)  # no data cap
    res, _ = new.client_update(ins, state, many, torch.Generator().manual_seed(0))
    assert res.scalars["local_steps"] == local_steps(0.0005, 4, 0.01, 20.0, 10_000, 20)
    theta_init = 1.0 - (0.1 / 0.9) * (3.0 - 1.0)  # from the share, below the bound
    want = 1.0 + (1 - 0.0005 / 0.05) ** int(res.scalars["local_steps"]) * (theta_init - 1.0)
    assert float(res.params) == pytest.approx(want)


def _result(cid, x, sigma_sq, group=""):
    from wakefl.sdk.selffl import ClientResult

    return ClientResult(
        cid,
        1,
        torch.tensor([float(x)], dtype=torch.float64),
        10,
        scalars={"sigma_sq": sigma_sq, "has_variance": 1.0},
        group=group,
    )


def _remove(g, x, a):
    return (g - a * x) / (1 - a)


def test_eqn10_share_under_sampling_removes_the_clients_upload_from_the_smoothed_model():
    st = SelfFL(sigma0_sq=0.2, eqn10_max_factor=None)
    server = st.init_server(torch.tensor([0.0], dtype=torch.float64))
    # round 1: A and B of 4 clients (C = 0.5); the global is half the old, half Eqn 11
    server = st.aggregate(server, [_result("A", 1.0, 0.1), _result("B", 3.0, 0.3)], 0.5)
    w_a, w_b = 1 / 0.3, 1 / 0.5
    hat = (w_a * 1.0 + w_b * 3.0) / (w_a + w_b)
    g1 = 0.5 * hat
    assert float(server.global_params) == pytest.approx(g1)
    a1 = 0.5 * w_a / (w_a + w_b)
    assert st.configure_client(server, "A", 2).scalars["own_share"] == pytest.approx(a1)
    rest = 0.5 * 0.0 + 0.5 * (w_b * 3.0) / (w_a + w_b)  # everything but A's upload
    assert _remove(g1, 1.0, a1) == pytest.approx(rest / (1 - a1))
    ins = st.configure_client(server, "A", 2)
    got = initial_point(
        server.global_params,
        torch.tensor([1.0], dtype=torch.float64),
        0.1,
        ins.scalars["others_precision"],
        sigma0_sq=0.2,
        share=ins.scalars["own_share"],
    )
    assert float(got) == pytest.approx(rest / (1 - a1))
    # round 2: C and D only; A's upload fades with the smoothing, (1 - C) per round
    server = st.aggregate(server, [_result("C", -1.0, 0.2), _result("D", 0.0, 0.2)], 0.5)
    a2 = st.configure_client(server, "A", 3).scalars["own_share"]
    assert a2 == pytest.approx(0.5 * a1)
    g2 = float(server.global_params)
    others = g2 - a2 * 1.0  # the rest, unnormalized
    assert float(
        initial_point(
            server.global_params,
            torch.tensor([1.0], dtype=torch.float64),
            0.1,
            1.0,
            sigma0_sq=0.2,
            share=a2,
        )
    ) == pytest.approx(others / (1 - a2))
    assert "own_share" not in st.configure_client(server, "E", 3).scalars  # never uploaded


def test_eqn10_share_in_cluster_mode_is_over_the_representatives():
    st = SelfFL(sigma0_sq=0.2, cluster_by_group=True, eqn10_max_factor=None)
    server = st.init_server(torch.tensor([0.0], dtype=torch.float64))
    round1 = [
        _result("a1", 1.0, 0.1, "a"),
        _result("a2", 2.0, 0.3, "a"),
        _result("b1", 5.0, 0.2, "b"),
    ]
    server = st.aggregate(server, round1, 1.0)
    rep_a = server.tensors["rep:a"]
    w1, w2 = 1 / 0.3, 1 / 0.5
    assert float(rep_a) == pytest.approx((w1 * 1.0 + w2 * 2.0) / (w1 + w2))
    s0c = server.scalars["cluster_sigma0_sq"]
    wa, wb = (
        1 / (s0c + server.scalars["rep_sigma_sq:a"]),
        1 / (s0c + server.scalars["rep_sigma_sq:b"]),
    )
    share_a1 = w1 / (w1 + w2) * wa / (wa + wb)
    assert st.configure_client(server, "a1", 2).scalars["own_share"] == pytest.approx(share_a1)
    # the global without a1: a2's part of rep a and rep b, renormalized
    rest = (wa * (w2 * 2.0) / (w1 + w2) + wb * 5.0) / (wa + wb)
    got = initial_point(
        server.global_params,
        torch.tensor([1.0], dtype=torch.float64),
        0.1,
        1.0,
        sigma0_sq=0.2,
        share=share_a1,
    )
    assert float(got) == pytest.approx(rest / (1 - share_a1))
    # round 2: only a2 in cluster a: rep a is replaced, a1 no longer has a share in it;
    # b1 keeps its weight in rep b, times rep b's new weight in the global model
    server = st.aggregate(server, [_result("a2", 2.5, 0.3, "a")], 1 / 3)
    assert st.configure_client(server, "a1", 3).scalars["own_share"] == 0.0
    s0c = server.scalars["cluster_sigma0_sq"]
    wa, wb = (
        1 / (s0c + server.scalars["rep_sigma_sq:a"]),
        1 / (s0c + server.scalars["rep_sigma_sq:b"]),
    )
    assert st.configure_client(server, "b1", 3).scalars["own_share"] == pytest.approx(
        wb / (wa + wb)
    )
    assert st.configure_client(server, "a2", 3).scalars["own_share"] == pytest.approx(
        wa / (wa + wb)
    )


def test_simulation_samples_floor_of_c_m():
    problems = _noisy_fleet(0)
    res = run_simulation(
        SelfFL(lr=5e-4, l_max=30, warmup_steps=5),
        problems,
        torch.zeros(1, dtype=torch.float64),
        3,
        0.35,
        1,
    )
    assert all(len(r.sampled) == 2 for r in res.records)  # floor(2.8), not round(2.8) = 3
