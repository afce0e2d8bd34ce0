"""pFedVEM (Zhu, Ma and Blaschko, CVPR 2023), confidence-aware personalized FL.

Each client keeps a diagonal Gaussian q(h_k) = N(mu_k, diag(sigma_k^2)) over the
personalized part of the parameter vector (the classification head), sigma = softplus(pi),
trained on the expected local loss (Monte-Carlo, reparameterisation h = mu + sigma * eps)
plus kl_weight * KL(q || N(w, rho_k^2 I)), where w is the global head. The shared base
(feature extractor) is trained alongside and averaged FedAvg-style. After local training
the client's confidence is tau_k = d_h / (sum_i sigma_i^2 + ||mu_k - w||^2) (and its
prior variance for the next round rho_k^2 = 1 / tau_k); the server's head is
w = sum_k tau_k mu_k / sum_k tau_k (the paper's Eqns 8-9)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from wakefl.errors import ProtocolError
from wakefl.protocol.records import MAX_RECORD_ABS, RecordSchema, ScalarSpec

from ..checks import (
    HyperparameterError,
    require_activity_rate,
    require_count,
    require_finite,
    require_finite_scalar,
    require_non_negative,
    require_positive,
)
from ..local_sgd import oracle_gradient
from ..strategy import ClientInstructions, ClientResult, ClientState, LocalProblem, ServerState
from .averaging import WeightedMean, fedavg_weight
from .fedavg import FedAvg, _origin, copy_state, stored_personal

# Keeps tau finite when a client's posterior collapses onto the prior mean.
_MIN_SPREAD = 1e-30


def inverse_softplus(y: float) -> float:
    """pi with softplus(pi) = y (y > 0)."""
    return y + math.log(-math.expm1(-y))


def inverse_softplus_tensor(y: Tensor) -> Tensor:
    """Entry-wise pi with softplus(pi) = y (y > 0)."""
    return y + torch.log(-torch.expm1(-y))


def _kl_prox_sigma(s0: Tensor, step: Tensor, rho_sq: float) -> Tensor:
    """The sigma > 0 that solves sigma = s0 - step * (sigma / rho^2 - 1 / sigma): the
    implicit step on the KL term's sigma part, i.e. the positive root of
    (1 + step/rho^2) sigma^2 - s0 sigma - step = 0. Positive for every s0."""
    a = 1.0 + step / rho_sq
    return (s0 + torch.sqrt(s0 * s0 + 4.0 * a * step)) / (2.0 * a)


def head_range(head: slice | None, dim: int) -> slice:
    """The head as a contiguous, non-empty `slice(start, stop)` inside a vector of `dim`."""
    if head is None:
        return slice(0, dim)
    start, stop, step = head.indices(dim)
    if step != 1 or stop <= start:
        raise HyperparameterError(
            f"head must be a non-empty contiguous slice of [0, {dim}), got {head}"
        )
    return slice(start, stop)


def confidence(mu: Tensor, sigma: Tensor, prior_mean: Tensor) -> float:
    """tau = d / (sum sigma^2 + ||mu - prior_mean||^2)."""
    spread = float(
        sigma.double().square().sum() + (mu.double() - prior_mean.double()).square().sum()
    )
    return mu.numel() / max(spread, _MIN_SPREAD)


class PFedVEM(FedAvg):
    """pFedVEM with a Gaussian posterior over the head.

    Hyperparameters:
        head: slice of the flat parameter vector that is personalized (default None = the
            whole vector, as in the scalar study; for the CNN use
            `wakefl.models.kws_cnn.head_slice(model)`).
        lr: SGD learning rate of the base and of mu (default 0.05).
        std_lr: learning rate of pi, sigma = softplus(pi) (default: `lr`).
        local_steps: local steps per round (default 20).
        mc_samples: Monte-Carlo samples of the head per step (default 2); each costs one
            gradient call.
        init_std: sigma of a new client's posterior (default 0.01).
        init_prior_var: rho^2 of a new client's prior (default 1.0).
        kl_weight: weight of the KL term next to the loss (default None = 1 / n_k, right
            when the LocalProblem's loss is a mean over samples; use 1 when it is the whole
            data's negative log-likelihood).
        weighting: FedAvg weights of the base, "samples" (default) or "equal".

    The personalized model is the global base with the client's posterior mean mu_k as
    head (the global model before the client's first round).
    """

    method = "pfedvem"

    uplink_schema: ClassVar[RecordSchema] = {
        **FedAvg.uplink_schema,
        "tau": ScalarSpec(0.0, MAX_RECORD_ABS),  # the client's confidence in its model
    }

    def __init__(
        self,
        head: slice | None = None,
        lr: float = 0.05,
        std_lr: float | None = None,
        local_steps: int = 20,
        mc_samples: int = 2,
        init_std: float = 0.01,
        init_prior_var: float = 1.0,
        kl_weight: float | None = None,
        weighting: str = "samples",
    ):
        super().__init__(weighting=weighting, lr=lr, local_steps=local_steps)
        if head is not None and not isinstance(head, slice):
            raise HyperparameterError(f"head must be a slice or None, got {head!r}")
        self.head = head
        self.std_lr = require_positive(lr if std_lr is None else std_lr, "std_lr")
        self.mc_samples = require_count(mc_samples, "mc_samples", minimum=1)
        self.init_std = require_positive(init_std, "init_std")
        self.init_prior_var = require_positive(init_prior_var, "init_prior_var")
        self.kl_weight = None if kl_weight is None else require_non_negative(kl_weight, "kl_weight")
        self.name = "pfedvem"

    # --- client side -------------------------------------------------------------------
    def client_update(
        self,
        instructions: ClientInstructions,
        state: ClientState,
        problem: LocalProblem,
        generator: torch.Generator,
    ) -> tuple[ClientResult, ClientState]:
        global_params = self.received_global(instructions)
        head = head_range(self.head, global_params.numel())
        prior_mean = global_params[head]
        mu, pi, rho_sq = self._stored_posterior(state, prior_mean)
        n = int(problem.num_samples)
        kl_w = (1.0 / max(n, 1)) if self.kl_weight is None else self.kl_weight

        params = global_params.detach().clone()
        for _ in range(self.local_steps):
            grad, grad_sigma = self._mc_gradients(
                params, mu, F.softplus(pi), head, problem, generator
            )
            # KL(N(mu, sigma^2) || N(w, rho^2)) = sum log(rho/sigma) + (sigma^2 + (mu-w)^2)
            # / (2 rho^2) - 1/2. Its step is taken implicitly (proximal): an explicit step
            # is stable only while lr * kl_w / rho^2 < 2, and rho^2 = 1/tau becomes small
            # after a confident round, which drove sigma to 0 and then to NaN. The data
            # term keeps its explicit step (on pi, through the softplus).
            params = params - self.lr * grad  # the head entries are replaced below
            a_mu = self.lr * kl_w / rho_sq
            mu = (mu - self.lr * grad[head] + a_mu * prior_mean) / (1.0 + a_mu)
            # A step of lr on pi moves sigma by lr * sigmoid(pi)^2 per unit of gradient in
            # sigma: the KL's implicit step uses that same metric, so the fixed point is the
            # stationary point of the whole objective.
            slope = torch.sigmoid(pi)
            s0 = F.softplus(pi - self.std_lr * grad_sigma * slope)
            step = self.std_lr * kl_w * slope * slope
            pi = inverse_softplus_tensor(_kl_prox_sigma(s0, step, rho_sq))

        require_finite(mu, "posterior mean of the head")
        require_finite(pi, "posterior scale of the head")
        params[head] = mu
        require_finite(params, "locally trained parameters")
        tau = confidence(mu, F.softplus(pi), prior_mean)
        require_finite_scalar(tau, "confidence tau")

        result = ClientResult(
            client_id=instructions.client_id,
            round_id=instructions.round_id,
            params=params,
            num_samples=n,
            scalars={"tau": tau, "local_steps": float(self.local_steps)},
        )
        new_state = copy_state(state)
        new_state.tensors["mu"] = mu
        new_state.tensors["pi"] = pi
        new_state.scalars = dict(new_state.scalars, rho_sq=1.0 / tau)
        return result, new_state

    def _stored_posterior(
        self, state: ClientState, prior_mean: Tensor
    ) -> tuple[Tensor, Tensor, float]:
        """The client's posterior mean mu and scale parameter pi of the head (the prior
        mean and init_std before its first round) and its prior variance rho^2."""
        mu = stored_personal(state, prior_mean, key="mu")
        pi = stored_personal(state, prior_mean, key="pi")
        mu = prior_mean.clone() if mu is None else mu.clone()
        if pi is None:
            pi = torch.full_like(prior_mean, inverse_softplus(self.init_std))
        rho_sq = require_finite_scalar(
            state.scalars.get("rho_sq", self.init_prior_var), "stored prior variance"
        )
        return mu, pi, rho_sq

    def _mc_gradients(
        self,
        params: Tensor,
        mu: Tensor,
        sigma: Tensor,
        head: slice,
        problem: LocalProblem,
        generator: torch.Generator,
    ) -> tuple[Tensor, Tensor]:
        """Monte Carlo estimates (`mc_samples` draws of the head from N(mu, sigma^2)) of the
        loss gradient in the parameters and in the head's sigma (reparameterised)."""
        grad = torch.zeros_like(params)
        grad_sigma = torch.zeros_like(mu)
        for _ in range(self.mc_samples):
            eps = torch.randn(
                mu.shape, generator=generator, dtype=torch.float32, device=generator.device
            ).to(mu.device, mu.dtype)
            sample = params.clone()
            sample[head] = mu + sigma * eps
            g = oracle_gradient(problem, sample, generator)
            grad += g
            grad_sigma += g[head] * eps
        return grad / self.mc_samples, grad_sigma / self.mc_samples

    # --- server side -------------------------------------------------------------------
    def aggregate(
        self, server: ServerState, results: Iterable[ClientResult], activity_rate: float
    ) -> ServerState:
        require_activity_rate(activity_rate)
        head = head_range(self.head, server.global_params.numel())
        base = WeightedMean(server.global_params)
        heads = WeightedMean(server.global_params[head])
        for result in results:
            origin = _origin(result)
            if "tau" not in result.scalars:
                raise ProtocolError(f"{origin}: the confidence 'tau' is missing")
            tau = require_finite_scalar(result.scalars["tau"], f"{origin}: confidence tau")
            base.add(result.params, fedavg_weight(result, self.weighting), origin)
            heads.add(result.params[head], tau, origin)
        new_global = server.global_params
        if base.count:
            new_global = base.value()
            new_global[head] = heads.value()
        return ServerState(
            round_id=server.round_id + 1,
            global_params=new_global,
            tensors=dict(server.tensors),
            scalars=dict(server.scalars),
            clients=dict(server.clients),
        )

    def personalized_params(
        self,
        server: ServerState,
        state: ClientState,
        problem: LocalProblem,
        generator: torch.Generator,
        client_id: str | None = None,
    ) -> Tensor:
        head = head_range(self.head, server.global_params.numel())
        mu = stored_personal(state, server.global_params[head], key="mu")
        if mu is None:
            return server.global_params
        params = server.global_params.clone()
        params[head] = mu
        return params
