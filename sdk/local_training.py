"""The bridge between the federation strategies and torch models.

`TorchLocalProblem` exposes a model + dataset as the `LocalProblem` gradient oracle on the
model's flat trainable parameter vector (order = `model.parameters()`), so every strategy
trains the wake-word CNN exactly as it trains the scalar Gaussian model.
`train_supervised` builds the warm-start model from pooled data; `predict_scores` scores
a dataset or a batch of waveforms."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, default_collate
from tqdm import tqdm

from wakefl.errors import ConfigError, NonFiniteError
from wakefl.progress_bars import bar_disabled

LossFn = Callable[[Tensor, Tensor], Tensor]


def dataset_size(dataset: Dataset) -> int:
    """len() of a map-style dataset (torch's `Dataset` type does not declare `__len__`)."""
    return len(dataset)  # type: ignore[arg-type]


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that make up the flat vector, in `model.parameters()` order."""
    return [p for p in model.parameters() if p.requires_grad]


def flat_trainable(model: nn.Module) -> Tensor:
    """A detached copy of the model's trainable parameters as one 1-D vector."""
    return torch.cat([p.detach().reshape(-1) for p in trainable_parameters(model)]).clone()


def load_flat_trainable(model: nn.Module, vec: Tensor) -> None:
    """Copy a flat vector into the model's trainable parameters (in place, no autograd)."""
    params = trainable_parameters(model)
    total = sum(p.numel() for p in params)
    if vec.dim() != 1 or vec.numel() != total:
        raise ConfigError(
            f"parameter vector has shape {tuple(vec.shape)}, the model has {total} "
            "trainable parameters"
        )
    with torch.no_grad():
        offset = 0
        for p in params:
            n = p.numel()
            p.copy_(vec[offset : offset + n].view_as(p))
            offset += n


def _stack_items(dataset: Dataset, indices: Sequence[int]) -> tuple[Tensor, Tensor]:
    batch = default_collate([dataset[i] for i in indices])
    if not isinstance(batch, list | tuple) or len(batch) < 2:
        raise ConfigError("dataset items must be (input, target) pairs")
    return batch[0], batch[1]


def _seed_from(generator: torch.Generator) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=generator))


class TorchLocalProblem:
    """`LocalProblem` over a torch model and a local dataset.

    `gradient(params, generator)` loads `params` into the model, draws one minibatch of
    `batch_size` distinct samples with `generator` (all samples if fewer), and returns the
    gradient of the mean minibatch loss as a flat vector. The model is run in train mode;
    randomness inside it (e.g. dropout) is seeded from `generator` too, so a fixed
    generator seed gives the same gradients. Gradients are taken with `torch.autograd.grad`:
    nothing is left in `.grad` and no graph outlives the call.
    """

    def __init__(
        self,
        model: nn.Module,
        dataset: Dataset,
        batch_size: int = 32,
        loss: LossFn = F.cross_entropy,
        device: str | torch.device = "cpu",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if dataset_size(dataset) == 0:
            raise ConfigError("the local dataset is empty: nothing to train on")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.loss = loss
        self._params = trainable_parameters(self.model)
        self.dim = sum(p.numel() for p in self._params)

    @property
    def num_samples(self) -> int:
        return dataset_size(self.dataset)

    def initial_params(self) -> Tensor:
        """The model's current trainable parameters as a flat vector."""
        return flat_trainable(self.model)

    def load(self, params: Tensor) -> nn.Module:
        """Load a flat vector into the model (e.g. to evaluate a personalized model)."""
        load_flat_trainable(self.model, params.to(self.device))
        return self.model

    def gradient(self, params: Tensor, generator: torch.Generator) -> Tensor:
        self.load(params)
        n = self.num_samples
        if n <= self.batch_size:
            indices = list(range(n))
        else:
            indices = torch.randperm(n, generator=generator)[: self.batch_size].tolist()
        inputs, targets = _stack_items(self.dataset, indices)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        seed = _seed_from(generator)
        was_training = self.model.training
        self.model.train()
        try:
            with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
                torch.manual_seed(seed)
                with torch.enable_grad():
                    loss = self.loss(self.model(inputs), targets)
                    grads = torch.autograd.grad(loss, self._params, allow_unused=True)
        finally:
            self.model.train(was_training)
        flat = torch.cat(
            [
                (torch.zeros_like(p) if g is None else g).reshape(-1)
                for p, g in zip(self._params, grads, strict=True)
            ]
        )
        return flat.detach().to(params.device, params.dtype)


def train_supervised(
    model: nn.Module,
    dataset: Dataset,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    progress: bool = True,
    optimizer: str = "adam",
    loss: LossFn = F.cross_entropy,
    device: str | torch.device = "cpu",
) -> dict:
    """Plain supervised training (the warm-start model from pooled data), in place.

    `optimizer` is "adam" or "sgd". Shuffling and any randomness inside the model are
    seeded from `seed`, so the same call gives the same model. Returns a summary:
    `epochs`, `steps`, `samples`, `epoch_loss` (mean training loss per epoch),
    `final_loss`, `seconds`. Raises NonFiniteError if the loss becomes NaN/Inf."""
    if epochs < 0 or batch_size < 1 or not lr > 0:
        raise ValueError("need epochs >= 0, batch_size >= 1 and lr > 0")
    if dataset_size(dataset) == 0:
        raise ConfigError("the training set is empty")
    device = torch.device(device)
    model.to(device)
    opt = _optimizer(optimizer, trainable_parameters(model), lr)
    shuffle = torch.Generator().manual_seed(seed)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=shuffle)
    epoch_loss: list[float] = []
    steps = 0
    start = time.perf_counter()
    was_training = model.training
    model.train()
    try:
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
            torch.manual_seed(seed)
            for epoch in range(epochs):
                bar = tqdm(
                    loader,
                    desc=f"epoch {epoch + 1}/{epochs}",
                    disable=bar_disabled(progress),
                    leave=False,
                    unit="batch",
                )
                mean_loss, steps = _train_epoch(model, bar, opt, loss, device, epoch, steps)
                epoch_loss.append(mean_loss)
    finally:
        model.train(was_training)
        opt.zero_grad(set_to_none=True)
    return {
        "epochs": epochs,
        "steps": steps,
        "samples": dataset_size(dataset),
        "epoch_loss": epoch_loss,
        "final_loss": epoch_loss[-1] if epoch_loss else float("nan"),
        "seconds": time.perf_counter() - start,
    }


def _optimizer(name: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ValueError(f"optimizer must be 'adam' or 'sgd', got {name!r}")


def _train_epoch(
    model: nn.Module,
    bar: Any,
    opt: torch.optim.Optimizer,
    loss: LossFn,
    device: torch.device,
    epoch: int,
    steps: int,
) -> tuple[float, int]:
    """One pass over the loader (`bar`); returns the epoch's mean loss and the step count
    so far. Raises NonFiniteError on a NaN/Inf loss."""
    total, count = 0.0, 0
    for inputs, targets in bar:
        inputs, targets = inputs.to(device), targets.to(device)
        opt.zero_grad(set_to_none=True)
        value = loss(model(inputs), targets)
        if not torch.isfinite(value):
            raise NonFiniteError(
                f"training loss became {value.item()} at epoch {epoch + 1}, "
                f"step {steps + 1}: lower the learning rate or check the data"
            )
        value.backward()
        opt.step()
        steps += 1
        total += value.item() * len(targets)
        count += len(targets)
        bar.set_postfix(loss=f"{total / count:.4f}")
    return total / count, steps


def _scores(model: nn.Module, inputs: Tensor) -> Tensor:
    predict = getattr(model, "predict_proba", None)
    if callable(predict):
        return predict(inputs).reshape(-1)
    logits = model(inputs)
    return torch.softmax(logits, dim=-1)[:, 1] if logits.dim() == 2 else torch.sigmoid(logits)


def predict_scores(
    model: nn.Module,
    dataset_or_waves: Dataset | Tensor | np.ndarray,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
) -> np.ndarray:
    """Wake-word probability per item, float64 [N]. Accepts waveforms [N, T] (tensor or
    array) or a dataset of (wave, label) items. Uses `model.predict_proba` when the model
    has one, else the softmax of class 1 (or the sigmoid of a single logit)."""
    device = torch.device(device)
    if isinstance(dataset_or_waves, np.ndarray | Tensor):
        waves = torch.as_tensor(dataset_or_waves, dtype=torch.float32)
        if waves.dim() == 1:
            waves = waves.unsqueeze(0)
        batches = (waves[i : i + batch_size] for i in range(0, len(waves), batch_size))
    else:
        loader = DataLoader(dataset_or_waves, batch_size=batch_size, shuffle=False)
        batches = (batch[0] if isinstance(batch, list | tuple) else batch for batch in loader)
    was_training = model.training
    model.eval()
    out: list[np.ndarray] = []
    try:
        with torch.no_grad():
            for inputs in batches:
                out.append(_scores(model, inputs.to(device)).double().cpu().numpy())
    finally:
        model.train(was_training)
    scores = np.concatenate(out) if out else np.zeros(0)
    if not np.isfinite(scores).all():
        raise NonFiniteError("the model produced non-finite scores")
    return scores
