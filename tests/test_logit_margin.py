"""The logit hinge beside cross-entropy: closed forms, and the pull it adds where
cross-entropy's vanishes (a phrase scoring just under a 0.99 threshold)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from wakefl.tools.training.logit_margin import MAX_MARGIN, logit_margin_loss


def _logits(d: list[float]) -> torch.Tensor:
    """Window logits whose difference (phrase minus rest) is `d`."""
    return torch.stack([torch.zeros(len(d)), torch.tensor(d)], dim=1)


@pytest.mark.parametrize(
    ("d", "labels", "expected"),
    [
        ([8.0], [1], 0.0),  # a phrase beyond the margin
        ([4.0], [1], 2.0),  # a phrase at score 0.982: 6 - 4
        ([-8.0], [0], 0.0),  # another window well below
        ([5.0], [0], 11.0),  # a near-rhyme at 0.993: 6 + 5
        ([4.0, 5.0, 8.0, -8.0], [1, 0, 1, 0], (2.0 + 11.0) / 4),
    ],
)
def test_the_hinge_is_its_closed_form(d, labels, expected) -> None:
    got = logit_margin_loss(_logits(d), torch.tensor(labels), 6.0)
    assert math.isclose(got.item(), expected, rel_tol=1e-6)


def test_it_pulls_a_phrase_just_under_the_threshold_where_cross_entropy_barely_does() -> None:
    """A phrase at score 0.98 (logit difference 3.9): cross-entropy's gradient on its logit
    difference is 1 - 0.98; the hinge's is 1, fifty times more."""
    d = torch.tensor([math.log(0.98 / 0.02)], requires_grad=True)
    logits = torch.stack([torch.zeros(1), d], dim=1)
    y = torch.tensor([1])
    (ce_grad,) = torch.autograd.grad(F.cross_entropy(logits, y), d)
    (hinge_grad,) = torch.autograd.grad(logit_margin_loss(logits, y, 6.0), d)
    assert math.isclose(ce_grad.item(), -0.02, rel_tol=1e-4)
    assert hinge_grad.item() == -1.0
    # Beyond the margin it lets go: no pull on a phrase already at 0.9999.
    far = torch.tensor([9.2], requires_grad=True)
    (g,) = torch.autograd.grad(
        logit_margin_loss(torch.stack([torch.zeros(1), far], 1), y, 6.0), far
    )
    assert g.item() == 0.0


def test_the_margin_cap_is_within_float32_reach() -> None:
    assert torch.sigmoid(torch.tensor(MAX_MARGIN, dtype=torch.float32)).item() < 1.0


def test_a_training_step_with_the_margin_moves_the_model_another_way() -> None:
    """`--logit-margin` reaches the optimizer: the same step from the same weights on the
    same batch ends elsewhere with it, and its loss is cross-entropy's plus the hinge."""
    from wakefl.models.kws_cnn import KwsCnn, ModelConfig
    from wakefl.tools.training.pretrain import train_step
    from wakefl.tools.training.settings import PretrainSettings

    torch.manual_seed(0)
    start = KwsCnn(ModelConfig(width=0.25))
    x = torch.randn(4, start.cfg.window_samples) * 0.05
    y = torch.tensor([1, 0, 1, 0])
    ends, losses = [], []
    for margin in (0.0, 6.0):
        model = KwsCnn(ModelConfig(width=0.25))
        model.load_state_dict(start.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s = PretrainSettings(width=0.25, logit_margin=margin, warmup_steps=1, spec_masks=False)
        losses.append(train_step(model, opt, x, y, 5, torch.Generator(), s))
        ends.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert not torch.equal(ends[0], ends[1])
    # An untrained model's logit differences are near 0, so every window is short of 6.
    assert losses[1] > losses[0] + 5.0
