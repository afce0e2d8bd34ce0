"""The two-level Gaussian model's local objective as a `LocalProblem` (docs/SELF_FL.md, "The
model behind the rules" and "The local objective").

Client m's loss is (theta - z_m)^2 / (2 sigma_m^2) summed over the parameter entries, with
z_m its local optimum and sigma_m^2 its intra-client variance. The exact gradient is
(theta - z_m) / sigma_m^2; the noisy one replaces z_m by the mean of a minibatch drawn
from the client's samples (with sigma_m^2 = s^2 / n_m for per-sample variance s^2, this is
the usual "sum loss" minibatch estimate).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from wakefl.errors import ConfigError, NonFiniteError


class GaussianLocalProblem:
    """Exact (samples=None) or minibatch (samples [n, d] and batch_size) gradient oracle."""

    def __init__(
        self,
        optimum: Tensor | float,
        sigma_sq: float,
        num_samples: int,
        samples: Tensor | None = None,
        batch_size: int = 1,
    ) -> None:
        z = torch.as_tensor(optimum, dtype=torch.float64).reshape(-1).clone()
        if not bool(torch.isfinite(z).all()) or not math.isfinite(sigma_sq):
            raise NonFiniteError("Gaussian problem needs a finite optimum and sigma_m^2")
        if sigma_sq <= 0.0 or num_samples < 1 or batch_size < 1:
            raise ConfigError(
                f"need sigma_m^2 > 0, num_samples >= 1, batch_size >= 1; got {sigma_sq}, "
                f"{num_samples}, {batch_size}"
            )
        if samples is not None:
            samples = torch.as_tensor(samples, dtype=torch.float64).reshape(len(samples), -1)
            if samples.shape[1] != z.numel():
                raise ConfigError("samples and optimum differ in dimension")
        self.optimum = z
        self.sigma_sq = float(sigma_sq)
        self._n = int(num_samples)
        self.samples = samples
        self.batch_size = int(batch_size)

    @property
    def num_samples(self) -> int:
        return self._n

    def loss(self, params: Tensor) -> float:
        """(theta - z_m)^2 / (2 sigma_m^2), summed over entries."""
        diff = params.to(torch.float64).reshape(-1) - self.optimum
        return float(diff.square().sum()) / (2.0 * self.sigma_sq)

    def gradient(self, params: Tensor, generator: torch.Generator) -> Tensor:
        target = self.optimum
        if self.samples is not None:
            idx = torch.randint(len(self.samples), (self.batch_size,), generator=generator)
            target = self.samples[idx].mean(dim=0)
        grad = (params.reshape(-1).to(torch.float64) - target) / self.sigma_sq
        return grad.to(params.dtype).reshape(params.shape)
