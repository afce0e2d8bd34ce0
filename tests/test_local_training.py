"""The torch bridge: TorchLocalProblem as a LocalProblem, warm-start training, scoring."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from wakefl.errors import ConfigError, NonFiniteError
from wakefl.sdk.local_training import (
    TorchLocalProblem,
    flat_trainable,
    predict_scores,
    train_supervised,
)
from wakefl.sdk.selffl.baselines import BASELINES
from wakefl.sdk.selffl.strategy import ClientState, LocalProblem

FEATURES = 6


def tiny_model(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Dropout(dropout), nn.Linear(8, 2))


def synthetic(n: int = 64, seed: int = 0, shift: float = 0.0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    y = ((x[:, 0] + x[:, 1] + shift) > 0).long()
    return TensorDataset(x, y)


class Recording(Dataset):
    """Records which items a minibatch used, so the test can rebuild that exact batch."""

    def __init__(self, base: TensorDataset):
        self.base, self.seen = base, []

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        self.seen.append(int(i))
        return self.base[i]


def autograd_mean_loss(model: nn.Module, x, y) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    out = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def test_gradient_equals_autograd_of_mean_minibatch_loss():
    data = synthetic(50)
    recorded = Recording(data)
    model = tiny_model()
    problem = TorchLocalProblem(model, recorded, batch_size=8)
    assert isinstance(problem, LocalProblem)
    assert problem.num_samples == 50
    params = flat_trainable(model) + 0.05 * torch.randn(problem.dim)
    before = params.clone()
    grad = problem.gradient(params, torch.Generator().manual_seed(4))
    batch = recorded.seen
    assert len(batch) == 8 and len(set(batch)) == 8
    x, y = data.tensors[0][batch], data.tensors[1][batch]
    reference = tiny_model(seed=99)
    problem_ref = TorchLocalProblem(reference, data)
    problem_ref.load(params)
    torch.testing.assert_close(grad, autograd_mean_loss(reference, x, y), rtol=1e-5, atol=1e-6)
    # Nothing leaks: the input vector, .grad and the autograd graph are untouched.
    assert torch.equal(params, before)
    assert all(p.grad is None for p in model.parameters())
    assert not grad.requires_grad and grad.grad_fn is None
    # The model now holds the requested parameters.
    assert torch.equal(flat_trainable(model), params)


def test_full_batch_when_dataset_is_small_and_gradient_is_deterministic():
    data = synthetic(10)
    model = tiny_model(dropout=0.5)
    problem = TorchLocalProblem(model, data, batch_size=32)
    params = flat_trainable(model)
    g1 = problem.gradient(params, torch.Generator().manual_seed(1))
    g2 = problem.gradient(params, torch.Generator().manual_seed(1))
    g3 = problem.gradient(params, torch.Generator().manual_seed(2))
    assert torch.equal(g1, g2)  # dropout masks are drawn from the given generator too
    assert not torch.equal(g1, g3)
    model.eval()
    problem.gradient(params, torch.Generator().manual_seed(1))
    assert not model.training  # the caller's mode is restored


def test_bad_vectors_and_datasets_are_refused():
    model = tiny_model()
    problem = TorchLocalProblem(model, synthetic(8))
    with pytest.raises(ConfigError, match="trainable parameters"):
        problem.gradient(torch.zeros(problem.dim + 1), torch.Generator())
    with pytest.raises(ConfigError, match="empty"):
        TorchLocalProblem(model, TensorDataset(torch.zeros(0, FEATURES), torch.zeros(0)))


def test_frozen_parameters_are_left_out_of_the_vector():
    model = tiny_model()
    model[0].weight.requires_grad_(False)
    problem = TorchLocalProblem(model, synthetic(8))
    assert problem.dim == sum(p.numel() for p in model.parameters()) - model[0].weight.numel()
    assert problem.gradient(problem.initial_params(), torch.Generator()).shape == (problem.dim,)


def test_train_supervised_learns_and_is_deterministic():
    data = synthetic(128)
    a, b = tiny_model(seed=3), tiny_model(seed=3)
    ra = train_supervised(a, data, epochs=8, lr=0.02, batch_size=16, seed=5, progress=False)
    rb = train_supervised(b, data, epochs=8, lr=0.02, batch_size=16, seed=5, progress=False)
    assert torch.equal(flat_trainable(a), flat_trainable(b))
    assert ra["epoch_loss"] == rb["epoch_loss"] and ra["steps"] == 8 * 8
    assert ra["epoch_loss"][-1] < 0.7 * ra["epoch_loss"][0]
    scores = predict_scores(a, data)
    accuracy = float(((scores > 0.5) == data.tensors[1].numpy()).mean())
    assert accuracy > 0.9
    c = tiny_model(seed=3)
    train_supervised(
        c, data, epochs=1, lr=0.02, batch_size=16, seed=6, progress=False, optimizer="sgd"
    )
    assert not torch.equal(flat_trainable(a), flat_trainable(c))


def test_train_supervised_refuses_non_finite_loss():
    x = torch.randn(16, FEATURES)
    x[3, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="loss"):
        train_supervised(
            tiny_model(),
            TensorDataset(x, torch.zeros(16, dtype=torch.long)),
            epochs=1,
            lr=0.01,
            batch_size=16,
            seed=0,
            progress=False,
        )


def test_predict_scores_on_waves_and_dataset_agree_with_softmax():
    data = synthetic(37)
    model = tiny_model()
    model.train()
    from_data = predict_scores(model, data, batch_size=10)
    from_waves = predict_scores(model, data.tensors[0].numpy(), batch_size=7)
    with torch.no_grad():
        model.eval()
        expected = torch.softmax(model(data.tensors[0]), -1)[:, 1].double().numpy()
    assert from_data.shape == (37,) and from_data.dtype == np.float64
    np.testing.assert_allclose(from_data, expected, rtol=1e-6)
    np.testing.assert_allclose(from_waves, expected, rtol=1e-6)


def test_fedavg_over_torch_problems_lowers_the_loss():
    # Two clients with shifted decision boundaries; a few FedAvg rounds on the torch bridge.
    datasets = [synthetic(64, seed=1, shift=0.5), synthetic(64, seed=2, shift=-0.5)]
    model = tiny_model()
    problems = [TorchLocalProblem(model, d, batch_size=16) for d in datasets]
    strategy = BASELINES["fedavg-w"](lr=0.2, local_steps=10)
    server = strategy.init_server(flat_trainable(model))

    def pooled_loss(params):
        problems[0].load(params)
        with torch.no_grad():
            return sum(float(F.cross_entropy(model(d.tensors[0]), d.tensors[1])) for d in datasets)

    start = pooled_loss(server.global_params)
    g = torch.Generator().manual_seed(0)
    states = [ClientState(), ClientState()]
    for r in range(1, 4):
        results = []
        for k, p in enumerate(problems):
            res, states[k] = strategy.client_update(
                strategy.configure_client(server, f"c{k}", r), states[k], p, g
            )
            results.append(res)
        server = strategy.aggregate(server, results, 1.0)
    assert pooled_loss(server.global_params) < 0.8 * start


def test_wake_word_cnn_through_the_bridge():
    kws = pytest.importorskip("wakefl.models.kws_cnn.model")
    flat = pytest.importorskip("wakefl.models.kws_cnn.flat_params")
    from wakefl.models.kws_cnn.config import ModelConfig

    torch.manual_seed(0)
    model = kws.KwsCnn(ModelConfig(width=0.25))
    g = torch.Generator().manual_seed(0)
    waves = 0.1 * torch.randn(4, model.cfg.window_samples, generator=g)
    labels = torch.tensor([0, 1, 1, 0])
    problem = TorchLocalProblem(model, TensorDataset(waves, labels), batch_size=4)
    params = flat.get_flat_params(model)
    assert torch.equal(problem.initial_params(), params)  # same vector layout as the model's
    grad = problem.gradient(params, torch.Generator().manual_seed(1))
    torch.testing.assert_close(grad, autograd_mean_loss(model, waves, labels), rtol=1e-4, atol=1e-6)
    # pFedVEM personalizes exactly the model's head range.
    head = flat.head_slice(model)
    strategy = BASELINES["pfedvem"](head=head, local_steps=1, mc_samples=1)
    server = strategy.init_server(params)
    result, state = strategy.client_update(
        strategy.configure_client(server, "a", 1), ClientState(), problem, torch.Generator()
    )
    assert state.tensors["mu"].numel() == head.stop - head.start
    assert result.params.shape == params.shape and result.scalars["tau"] > 0
    scores = predict_scores(model, waves, batch_size=2)
    assert scores.shape == (4,) and ((scores >= 0) & (scores <= 1)).all()
