"""The one local SGD loop of every strategy, through the `LocalProblem` gradient oracle,
optionally with a proximal term (lambda/2)||x - center||^2 (DITTO's personal objective,
pFedMe's inner problem)."""

from __future__ import annotations

import torch
from torch import Tensor

from wakefl.errors import ProtocolError
from wakefl.sdk.selffl.checks import require_finite
from wakefl.sdk.selffl.strategy import LocalProblem


def oracle_gradient(problem: LocalProblem, params: Tensor, generator: torch.Generator) -> Tensor:
    """One stochastic gradient, checked for shape (a wrong oracle is a bug worth naming)."""
    grad = problem.gradient(params, generator)
    if grad.shape != params.shape:
        raise ProtocolError(
            f"local problem returned a gradient of shape {tuple(grad.shape)} for parameters "
            f"of shape {tuple(params.shape)}"
        )
    return grad.to(params.device, params.dtype)


def sgd_steps(
    start: Tensor,
    problem: LocalProblem,
    generator: torch.Generator,
    lr: float,
    steps: int,
    prox_center: Tensor | None = None,
    lam: float = 0.0,
) -> Tensor:
    """`steps` SGD steps x <- x - lr * g(x) from `start` (not modified) on
    F(x) [+ lam/2 ||x - prox_center||^2].

    Returns a new tensor; raises NonFiniteError if the iterate leaves the finite range."""
    x = start.detach().clone()
    for _ in range(steps):
        grad = oracle_gradient(problem, x, generator)
        if prox_center is not None and lam:
            grad = grad + lam * (x - prox_center)
        x = x - lr * grad
    return require_finite(x, "locally trained parameters")


def fixed_batch_generator(generator: torch.Generator) -> tuple[torch.Generator, int]:
    """A fresh generator and a seed drawn from `generator`: re-seeding it with that seed
    replays the same minibatch, so an inner loop can solve a problem on one fixed batch."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    sub = torch.Generator(device=generator.device)
    sub.manual_seed(seed)
    return sub, seed
