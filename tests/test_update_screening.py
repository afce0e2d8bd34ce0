"""Update screening (sdk/selffl/update_screening.py) against closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from wakefl.errors import ConfigError
from wakefl.sdk.selffl.update_screening import (
    ScreeningRules,
    apply_scale,
    delta_norm,
    screen_updates,
)


def test_delta_norm_in_float64_survives_float32_extremes():
    g = torch.zeros(4)
    p = torch.full((4,), 3e38)
    assert delta_norm(p, g) == pytest.approx(6e38)  # sqrt(4) * 3e38; float32 would give inf
    assert delta_norm(torch.tensor([3.0, 4.0]), torch.zeros(2)) == 5.0


def test_median_based_floor_clip_and_refusal():
    norms = [1.0, 2.0, 3.0, 25.0, 1e6]
    sigmas = [0.2, 0.4, 0.6, 0.0, 0.0]
    s = screen_updates(norms, sigmas, global_norm=10.0)
    assert s.reference_norm == 3.0 and s.reference_sigma_sq == 0.2
    assert s.sigma_floor == pytest.approx(0.02)
    assert s.clip_bound == 30.0 and s.refuse_bound == 300.0
    assert [v.action for v in s.verdicts] == ["keep", "keep", "keep", "keep", "refuse"]
    assert [v.sigma_sq for v in s.verdicts] == pytest.approx([0.2, 0.4, 0.6, 0.02, 0.02])
    clipped = screen_updates([1.0, 2.0, 3.0, 40.0], [1.0] * 4, global_norm=10.0)
    v = clipped.verdicts[3]
    assert v.action == "clip" and v.scale == pytest.approx(25.0 / 40.0)  # R = 2.5, bound 25
    assert "refuse" not in [x.action for x in clipped.verdicts[:3]]
    assert "median distance" in s.verdicts[4].reason


def test_small_round_uses_previous_reference_or_absolute_bound():
    # two updates: no median of their own; the previous round's reference applies
    s = screen_updates(
        [1.0, 500.0], [0.5, 0.0], global_norm=1.0, previous_norm=2.0, previous_sigma_sq=0.5
    )
    assert [v.action for v in s.verdicts] == ["keep", "refuse"]
    assert s.verdicts[1].sigma_sq == pytest.approx(0.05)
    # no reference at all: only the absolute bound 1e3 * max(||theta_g||, 1)
    s = screen_updates(
        [1.0, 500.0, 2e3],
        [0.5, 0.1, 0.1],
        global_norm=0.5,
        rules=ScreeningRules(min_reference_updates=4),
    )
    assert [v.action for v in s.verdicts] == ["keep", "keep", "refuse"]
    assert "absolute bound" in s.verdicts[2].reason and math.isinf(s.clip_bound)


def test_apply_scale_is_exact_and_identity_for_keep():
    g = torch.tensor([1.0, -1.0, 0.0])
    p = torch.tensor([3.0, 1.0, 4.0])
    assert apply_scale(p, g, 1.0) is p
    torch.testing.assert_close(apply_scale(p, g, 0.5), torch.tensor([2.0, 0.0, 2.0]))
    big = torch.full((3,), 3e38)
    out = apply_scale(big, -big, 1e-38)  # the difference overflows float32, not float64
    assert torch.isfinite(out).all()


def test_bad_inputs_and_rules_refused():
    with pytest.raises(ConfigError):
        screen_updates([1.0], [1.0, 2.0], 1.0)
    with pytest.raises(ConfigError):
        screen_updates([float("inf")], [1.0], 1.0)
    with pytest.raises(ConfigError):
        ScreeningRules(clip_factor=5.0, refuse_factor=2.0)
