"""Baseline strategies on a quadratic (Gaussian) local problem: closed forms, streaming
aggregation, non-finite refusal, determinism."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from wakefl.errors import NonFiniteError, ProtocolError
from wakefl.sdk.selffl.baselines import (
    BASELINES,
    Ditto,
    FedAvg,
    FineTune,
    LocalOnly,
    PerFedAvg,
    PFedMe,
    PFedVEM,
)
from wakefl.sdk.selffl.baselines.pfedme import prox_solve
from wakefl.sdk.selffl.strategy import ClientResult, ClientState, LocalProblem, Strategy

D = torch.float64


class Quadratic:
    """F(theta) = ||theta - z||^2 / (2 s2); gradient plus optional Gaussian noise."""

    def __init__(self, z, s2: float, n: int, noise: float = 0.0):
        self.z = torch.as_tensor(z, dtype=D).reshape(-1)
        self.s2 = float(s2)
        self.n = n
        self.noise = noise
        self.calls = 0

    @property
    def num_samples(self) -> int:
        return self.n

    def gradient(self, params: Tensor, generator: torch.Generator) -> Tensor:
        self.calls += 1
        g = (params - self.z) / self.s2
        if self.noise:
            g = g + self.noise * torch.randn(params.shape, generator=generator, dtype=D)
        return g


class NaNProblem(Quadratic):
    def gradient(self, params, generator):
        return torch.full_like(params, float("nan"))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run_rounds(
    strategy: Strategy,
    problems: list[LocalProblem],
    rounds: int,
    seed: int = 0,
    init: Tensor | None = None,
):
    """A minimal in-process federation: all clients every round."""
    dim = problems[0].z.numel()
    server = strategy.init_server(torch.zeros(dim, dtype=D) if init is None else init)
    states = [ClientState() for _ in problems]
    g = gen(seed)
    for r in range(1, rounds + 1):
        results = []
        for k, problem in enumerate(problems):
            instr = strategy.configure_client(server, f"c{k}", r)
            result, states[k] = strategy.client_update(instr, states[k], problem, g)
            results.append(result)
        server = strategy.aggregate(server, iter(results), 1.0)
    personal = [
        strategy.personalized_params(server, s, p, g) for s, p in zip(states, problems, strict=True)
    ]
    return server, states, personal


Z = [[1.0, -2.0], [3.0, 0.5], [-1.0, 4.0]]
S2 = [0.5, 1.0, 2.0]
N = [10, 40, 150]


def problems(noise: float = 0.0) -> list[Quadratic]:
    return [Quadratic(z, s2, n, noise) for z, s2, n in zip(Z, S2, N, strict=True)]


def zs() -> Tensor:
    return torch.tensor(Z, dtype=D)


# ---------------------------------------------------------------- closed forms / fixed points
@pytest.mark.parametrize("name,weights", [("fedavg-w", N), ("fedavg-e", [1, 1, 1])])
def test_fedavg_exact_local_minimisation_gives_weighted_mean(name, weights):
    # Contraction factors |1 - lr/s2| <= 0.75 over 200 steps: the local iterate is z_m.
    strategy = BASELINES[name](lr=0.5, local_steps=200)
    server, _, personal = run_rounds(strategy, problems(), rounds=1)
    w = torch.tensor(weights, dtype=D)
    expected = (w[:, None] * zs()).sum(0) / w.sum()
    torch.testing.assert_close(server.global_params, expected, rtol=0, atol=1e-10)
    assert server.round_id == 1
    assert all(torch.equal(p, server.global_params) for p in personal)


def test_ditto_personal_model_is_prox_closed_form():
    lam = 0.7
    strategy = Ditto(weighting="samples", lr=0.2, local_steps=5, lam=lam, personal_steps=300)
    probs = problems()
    server = strategy.init_server(torch.tensor([0.3, -0.1], dtype=D))
    instr = strategy.configure_client(server, "c1", 1)
    for p in probs:
        _, state = strategy.client_update(instr, ClientState(), p, gen())
        w = instr.global_params
        expected = (p.z / p.s2 + lam * w) / (1 / p.s2 + lam)
        torch.testing.assert_close(state.tensors["personal"], expected, rtol=0, atol=1e-10)
        assert torch.equal(
            strategy.personalized_params(server, state, p, gen()), state.tensors["personal"]
        )


def test_ditto_e_and_w_differ_only_in_weights():
    s_e, _, _ = run_rounds(BASELINES["ditto-e"](lr=0.5, local_steps=200), problems(), 1)
    s_w, _, _ = run_rounds(BASELINES["ditto-w"](lr=0.5, local_steps=200), problems(), 1)
    torch.testing.assert_close(s_e.global_params, zs().mean(0), rtol=0, atol=1e-10)
    n = torch.tensor(N, dtype=D)
    torch.testing.assert_close(
        s_w.global_params, (n[:, None] * zs()).sum(0) / n.sum(), rtol=0, atol=1e-10
    )


def test_pfedme_inner_solution_is_prox_closed_form():
    p = Quadratic([2.0, -1.0, 0.5], s2=0.5, n=20)
    theta = torch.tensor([0.0, 1.0, -3.0], dtype=D)
    lam = 3.0
    v = prox_solve(theta, p, gen(), lam=lam, lr=0.15, steps=400)
    expected = (p.z / p.s2 + lam * theta) / (1 / p.s2 + lam)
    torch.testing.assert_close(v, expected, rtol=0, atol=1e-10)


def test_pfedme_fixed_point_with_one_local_round():
    # R = 1, exact inner solve: w' = w - beta eta lam mean_k (w - z_k)/(1 + lam s2_k), so
    # the fixed point is the mean of z_k weighted by 1/(1 + lam s2_k).
    lam = 1.0
    strategy = PFedMe(lam=lam, personal_lr=0.3, inner_steps=150, lr=0.5, local_steps=1, beta=1.5)
    server, states, _ = run_rounds(strategy, problems(), rounds=150)
    a = 1 / (1 + lam * torch.tensor(S2, dtype=D))
    expected = (a[:, None] * zs()).sum(0) / a.sum()
    torch.testing.assert_close(server.global_params, expected, rtol=0, atol=1e-8)
    # Each personal model is then the prox of the client's loss at the global model.
    for st, s2, z in zip(states, S2, zs(), strict=True):
        prox = (z / s2 + lam * expected) / (1 / s2 + lam)
        torch.testing.assert_close(st.tensors["personal"], prox, rtol=0, atol=1e-6)


def test_perfedavg_first_order_fixed_point_and_adaptation():
    # One meta step per round: the FO gradient is c_k (w - z_k), c_k = (1 - alpha/s2)/s2.
    alpha = 0.1
    strategy = PerFedAvg(alpha=alpha, beta=0.3, local_steps=1, adapt_steps=1)
    server, _, personal = run_rounds(strategy, problems(), rounds=300)
    s2 = torch.tensor(S2, dtype=D)
    c = (1 - alpha / s2) / s2
    expected = (c[:, None] * zs()).sum(0) / c.sum()
    torch.testing.assert_close(server.global_params, expected, rtol=0, atol=1e-9)
    for p, v in zip(problems(), personal, strict=True):
        torch.testing.assert_close(v, expected - alpha * (expected - p.z) / p.s2, rtol=0, atol=1e-9)


def test_local_only_reaches_each_local_optimum_and_keeps_global():
    init = torch.tensor([0.5, 0.5], dtype=D)
    server, _, personal = run_rounds(
        LocalOnly(lr=0.2, local_steps=100), problems(), rounds=3, init=init
    )
    assert torch.equal(server.global_params, init)
    for p, v in zip(problems(), personal, strict=True):
        torch.testing.assert_close(v, p.z, rtol=0, atol=1e-10)


def test_finetune_personal_model_is_sgd_from_global():
    strategy = FineTune(lr=0.2, local_steps=200, finetune_steps=3, finetune_lr=0.25)
    server, _, personal = run_rounds(strategy, problems(), rounds=1)
    w = server.global_params
    for p, v in zip(problems(), personal, strict=True):
        expected = p.z + (w - p.z) * (1 - 0.25 / p.s2) ** 3
        torch.testing.assert_close(v, expected, rtol=0, atol=1e-12)


def test_pfedvem_posterior_matches_gaussian_closed_form():
    # Expected quadratic loss ((mu - z)^2 + sigma^2)/(2 s2) + kw KL(q || N(w, rho2)):
    # mu* = (z/s2 + kw w/rho2)/(1/s2 + kw/rho2), sigma*^2 = kw/(1/s2 + kw/rho2).
    dim, kw, rho2, s2 = 64, 0.5, 2.0, 1.0
    p = Quadratic(torch.full((dim,), 1.0), s2=s2, n=30)
    strategy = PFedVEM(
        lr=0.02, local_steps=1500, mc_samples=2, init_std=0.3, init_prior_var=rho2, kl_weight=kw
    )
    server = strategy.init_server(torch.zeros(dim, dtype=D))
    result, state = strategy.client_update(
        strategy.configure_client(server, "a", 1), ClientState(), p, gen(3)
    )
    mu, sigma = state.tensors["mu"], torch.nn.functional.softplus(state.tensors["pi"])
    prec = 1 / s2 + kw / rho2
    assert abs(float(mu.mean()) - (1.0 / s2) / prec) < 0.02
    assert abs(float(sigma.square().mean()) - kw / prec) < 0.03
    tau = dim / float(sigma.square().sum() + mu.square().sum())
    assert result.scalars["tau"] == pytest.approx(tau, rel=1e-9)
    assert state.scalars["rho_sq"] == pytest.approx(1 / tau, rel=1e-9)
    assert torch.equal(result.params, mu)


def test_pfedvem_server_head_is_confidence_weighted_and_base_sample_weighted():
    dim, head = 6, slice(4, 6)
    strategy = PFedVEM(head=head, weighting="samples")
    server = strategy.init_server(torch.zeros(dim, dtype=D))
    g = gen(1)
    params = [torch.randn(dim, generator=g, dtype=D) for _ in range(4)]
    taus, ns = [0.5, 2.0, 7.0, 1.5], [3, 10, 1, 20]
    results = [
        ClientResult(f"c{k}", 1, params[k], ns[k], scalars={"tau": taus[k]}) for k in range(4)
    ]
    new = strategy.aggregate(server, (r for r in results), 0.5)
    P = torch.stack(params)
    n, t = torch.tensor(ns, dtype=D), torch.tensor(taus, dtype=D)
    torch.testing.assert_close(new.global_params[:4], (n[:, None] * P[:, :4]).sum(0) / n.sum())
    torch.testing.assert_close(new.global_params[4:], (t[:, None] * P[:, 4:]).sum(0) / t.sum())


def test_pfedvem_head_slice_trains_base_like_sgd():
    # The quadratic is separable, so the base entries follow plain SGD whatever the head
    # samples are; the personalized model has the client's mu as head.
    p = Quadratic([1.0, 2.0, 3.0, 4.0], s2=1.0, n=10)
    strategy = PFedVEM(head=slice(2, None), lr=0.1, local_steps=7, kl_weight=0.1)
    server = strategy.init_server(torch.zeros(4, dtype=D))
    result, state = strategy.client_update(
        strategy.configure_client(server, "a", 1), ClientState(), p, gen()
    )
    torch.testing.assert_close(result.params[:2], p.z[:2] * (1 - 0.9**7))
    assert state.tensors["mu"].shape == (2,)
    pers = strategy.personalized_params(server, state, p, gen())
    assert torch.equal(pers[2:], state.tensors["mu"]) and torch.equal(
        pers[:2], server.global_params[:2]
    )


# ---------------------------------------------------------------- streaming aggregation
@pytest.mark.parametrize("name", sorted(set(BASELINES) - {"local"}))
def test_streaming_aggregate_equals_batch_and_reads_results_once(name):
    strategy = BASELINES[name]()
    dim = 50
    g = gen(7)
    server = strategy.init_server(torch.randn(dim, generator=g, dtype=torch.float32))
    results = [
        ClientResult(
            f"c{k}", 1, torch.randn(dim, generator=g), 5 + 13 * k, scalars={"tau": 0.5 + k}
        )
        for k in range(9)
    ]
    new = strategy.aggregate(server, (r for r in results), 1.0)  # a one-shot iterator
    P = torch.stack([r.params for r in results]).double()
    w = torch.tensor(
        [r.num_samples if strategy.weighting == "samples" else 1 for r in results], dtype=D
    )
    if name == "pfedvem":
        w = torch.tensor([r.scalars["tau"] for r in results], dtype=D)  # head = everything
    mean = (w[:, None] * P).sum(0) / w.sum()
    if name == "pfedme":
        mean = (1 - strategy.beta) * server.global_params.double() + strategy.beta * mean
    torch.testing.assert_close(new.global_params, mean.float(), rtol=1e-6, atol=1e-6)
    assert new.global_params.dtype == torch.float32


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_round_without_results_keeps_global(name):
    strategy = BASELINES[name]()
    server = strategy.init_server(torch.ones(3))
    new = strategy.aggregate(server, iter(()), 0.2)
    assert torch.equal(new.global_params, server.global_params)
    assert new.round_id == server.round_id + 1


# ---------------------------------------------------------------- refusal of bad input
def _result(params, n=5, **scalars):
    return ClientResult("bad", 1, params, n, scalars={"tau": 1.0, **scalars})


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_non_finite_inputs_are_refused(name):
    strategy = BASELINES[name]()
    server = strategy.init_server(torch.zeros(2, dtype=D))
    good = _result(torch.ones(2, dtype=D))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(NonFiniteError):
            strategy.aggregate(server, [good, _result(torch.tensor([0.0, bad], dtype=D))], 1.0)
    with pytest.raises(NonFiniteError):
        strategy.init_server(torch.tensor([0.0, float("nan")]))
    # A local problem whose gradient turns NaN: refused, the given state left untouched.
    state = ClientState(tensors={"keep": torch.ones(1)}, scalars={"t": 1.0})
    instr = strategy.configure_client(server, "a", 1)
    with pytest.raises(NonFiniteError):
        strategy.client_update(instr, state, NaNProblem([0.0, 0.0], 1.0, 5), gen())
    assert set(state.tensors) == {"keep"} and state.scalars == {"t": 1.0}
    # A corrupted global model coming down is refused too.
    bad_server = type(server)(round_id=1, global_params=torch.tensor([1.0, float("inf")], dtype=D))
    with pytest.raises(NonFiniteError):
        strategy.client_update(
            strategy.configure_client(bad_server, "a", 2),
            ClientState(),
            Quadratic([0.0, 0.0], 1.0, 5),
            gen(),
        )


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_malformed_results_are_refused(name):
    strategy = BASELINES[name]()
    server = strategy.init_server(torch.zeros(2, dtype=D))
    with pytest.raises(ProtocolError, match="shape"):
        strategy.aggregate(server, [_result(torch.ones(3, dtype=D))], 1.0)
    with pytest.raises(ValueError, match="activity rate"):
        strategy.aggregate(server, [], 0.0)


def test_sample_weighting_refuses_non_positive_counts_and_pfedvem_needs_tau():
    server = FedAvg().init_server(torch.zeros(2, dtype=D))
    with pytest.raises(ProtocolError, match="num_samples"):
        FedAvg().aggregate(server, [_result(torch.ones(2, dtype=D), n=0)], 1.0)
    with pytest.raises(ProtocolError, match="tau"):
        PFedVEM().aggregate(server, [ClientResult("a", 1, torch.ones(2, dtype=D), 3)], 1.0)
    with pytest.raises(NonFiniteError, match="tau"):
        PFedVEM().aggregate(server, [_result(torch.ones(2, dtype=D), tau=math.nan)], 1.0)


def test_bad_hyperparameters_are_refused():
    with pytest.raises(ValueError):
        FedAvg(weighting="median")
    with pytest.raises(ValueError):
        FedAvg(lr=-1)
    with pytest.raises(ValueError):
        Ditto(lam=float("nan"))
    with pytest.raises(ValueError):
        PFedVEM(head=slice(0, 4, 2)).client_update(
            PFedVEM().configure_client(PFedVEM().init_server(torch.zeros(4)), "a", 1),
            ClientState(),
            Quadratic([0.0] * 4, 1.0, 3),
            gen(),
        )


# ---------------------------------------------------------------- determinism
@pytest.mark.parametrize("name", sorted(BASELINES))
def test_deterministic_under_seed(name):
    def run(seed):
        strategy = BASELINES[name](local_steps=4)
        server, _, personal = run_rounds(strategy, problems(noise=0.5), rounds=2, seed=seed)
        return torch.cat([server.global_params, *personal])

    a, b, c = run(11), run(11), run(12)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.isfinite(a).all()


def test_registry_constructs_named_strategies():
    for name, make in BASELINES.items():
        strategy = make()
        assert isinstance(strategy, Strategy)
        assert strategy.name == name
        assert strategy.__class__.__doc__ and "Hyperparameters" in strategy.__class__.__doc__


def test_baselines_run_in_the_core_simulation_with_gaussian_problems():
    sim = pytest.importorskip("wakefl.sdk.selffl.simulation")
    gp = pytest.importorskip("wakefl.sdk.selffl.gaussian_problem")
    probs = {
        f"c{k}": gp.GaussianLocalProblem(z, s2, n)
        for k, (z, s2, n) in enumerate(zip(Z, S2, N, strict=True))
    }
    out = sim.run_simulation(
        BASELINES["fedavg-w"](lr=0.5, local_steps=200),
        probs,
        torch.zeros(2, dtype=D),
        rounds=1,
        activity_rate=1.0,
        seed=0,
    )
    n = torch.tensor(N, dtype=D)
    torch.testing.assert_close(
        out.server.global_params, (n[:, None] * zs()).sum(0) / n.sum(), rtol=0, atol=1e-10
    )
    for name, make in BASELINES.items():
        kwargs = {"kl_weight": 1.0} if name == "pfedvem" else {}
        a = sim.run_simulation(
            make(local_steps=3, **kwargs),
            probs,
            torch.zeros(2, dtype=D),
            rounds=3,
            activity_rate=0.5,
            seed=4,
        )
        assert torch.isfinite(a.server.global_params).all(), name


def test_pfedvem_stays_finite_after_a_confident_round():
    # rho^2 = 1/tau is tiny after a confident round; an explicit step on the KL term is
    # unstable once lr * kl_w / rho^2 > 2 (here 500), which used to end in NaN.
    dim = 16
    p = Quadratic(torch.full((dim,), 1.0), s2=1.0, n=30)
    strategy = PFedVEM(lr=0.05, local_steps=50, init_std=0.01, kl_weight=1.0)
    server = strategy.init_server(torch.zeros(dim, dtype=D))
    state = ClientState(scalars={"rho_sq": 1e-4})
    result, new_state = strategy.client_update(
        strategy.configure_client(server, "a", 1), state, p, gen(5)
    )
    mu = new_state.tensors["mu"]
    sigma = torch.nn.functional.softplus(new_state.tensors["pi"])
    assert torch.isfinite(result.params).all() and bool((sigma > 0).all())
    # The strong prior keeps the head near the global model: mu* = (z/s2)/(1/s2 + 1/rho2).
    assert float(mu.abs().max()) < 0.01
