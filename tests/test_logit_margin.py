"""The logit hinge beside cross-entropy: closed forms, and the pull it adds where
cross-entropy's vanishes (a phrase scoring just under a 0.99 threshold)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from wakefl.tools.training.logit_margin import (
    MAX_MARGIN,
    logit_margin_loss,
    positive_margin_loss,
)


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


@pytest.mark.parametrize(
    ("d", "labels", "cap", "expected"),
    [
        ([4.0], [1], 12.0, 2.0),  # a phrase at 0.982, believed: pulled to 6
        ([-2.0], [1], 12.0, 0.0),  # a phrase buried (0.12): left to cross-entropy
        ([5.0], [0], 12.0, 0.0),  # a near-rhyme at 0.993: left to cross-entropy
        ([14.0], [1], 12.0, 2.0),  # a phrase past the cap: held under it
        ([13.0], [0], 12.0, 1.0),  # so is a negative
        ([14.0], [1], 0.0, 0.0),  # no cap
        ([4.0, -2.0, 5.0, 13.0], [1, 1, 0, 0], 12.0, (2.0 + 1.0) / 4),
    ],
)
def test_the_bounded_hinge_is_its_closed_form(d, labels, cap, expected) -> None:
    got = positive_margin_loss(_logits(d), torch.tensor(labels), 6.0, cap)
    assert math.isclose(got.item(), expected, rel_tol=1e-6)


def test_the_bounded_hinge_pulls_only_believed_phrases_and_caps_every_window() -> None:
    """Its gradient on the logit difference: -1/B on a phrase between 0.5 and the margin,
    nothing on a buried phrase or on any negative under the cap, +1/B past the cap."""
    d = torch.tensor([3.9, -1.0, 4.5, 8.0, 13.0], requires_grad=True)
    labels = torch.tensor([1, 1, 0, 1, 0])
    (g,) = torch.autograd.grad(
        positive_margin_loss(torch.stack([torch.zeros(5), d], 1), labels, 6.0, 12.0), d
    )
    assert torch.equal(g, torch.tensor([-1.0, 0.0, 0.0, 0.0, 1.0]) / 5)


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
    for hinge in ({}, {"logit_margin": 6.0}):
        model = KwsCnn(ModelConfig(width=0.25))
        model.load_state_dict(start.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s = PretrainSettings(width=0.25, warmup_steps=1, spec_masks=False, **hinge)
        losses.append(train_step(model, opt, x, y, 5, torch.Generator(), s))
        ends.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert not torch.equal(ends[0], ends[1])
    # An untrained model's logit differences are near 0, so every window is short of 6.
    assert losses[1] > losses[0] + 5.0


def test_a_training_step_with_the_bounded_hinge_moves_the_model_another_way() -> None:
    """`--positive-margin` reaches the optimizer. The start's last bias puts every window's
    logit difference near 3 (score 0.95): its phrases are believed, short of 6, and pulled."""
    from wakefl.models.kws_cnn import KwsCnn, ModelConfig
    from wakefl.tools.training.pretrain import train_step
    from wakefl.tools.training.settings import PretrainSettings

    torch.manual_seed(0)
    start = KwsCnn(ModelConfig(width=0.25))
    with torch.no_grad():
        start.head[-1].bias.copy_(torch.tensor([0.0, 3.0]))
    x = torch.randn(4, start.cfg.window_samples) * 0.05
    y = torch.tensor([1, 0, 1, 0])
    ends, losses = [], []
    for margin in (0.0, 6.0):
        model = KwsCnn(ModelConfig(width=0.25))
        model.load_state_dict(start.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s = PretrainSettings(width=0.25, positive_margin=margin, warmup_steps=1, spec_masks=False)
        losses.append(train_step(model, opt, x, y, 5, torch.Generator(), s))
        ends.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert not torch.equal(ends[0], ends[1])
    # Two of four windows are phrases about 3 short of the margin; the negatives add nothing.
    assert 1.0 < losses[1] - losses[0] < 2.0
