"""Pretraining on CUDA: a training step draws the same masks and warp as on the CPU and
computes the same function, and a checkpoint written on one device resumes on the other.
Skipped where no CUDA device is visible, as in CI (conftest hides GPUs unless
CUDA_VISIBLE_DEVICES is set); on a GPU machine: CUDA_VISIBLE_DEVICES=0 pytest this file."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from wakefl.models.kws_cnn import KwsCnn
from wakefl.tools.training.checkpoints import load_state, save_state
from wakefl.tools.training.pretrain import augmented_log_mel, seeded_model, train_step
from wakefl.tools.training.settings import PretrainSettings, model_config

# Today's layout, the one the width-1.0 legs train (pooled frame decisions), and the one
# with every context-robust choice (per-frame norm, PCEN, first pool 2).
ARCHS = ("v1", "v2,norm=group,gain_norm=none,first_time_pool=3", "v2")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(autouse=True)
def _exact_fp32():
    # TF32 convolutions round to 10 bits; the comparisons below are about the pipeline.
    was = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = was


def _batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return 0.1 * torch.randn(n, 24000, generator=g), torch.arange(n) % 2


@pytest.mark.parametrize("arch", ARCHS)
def test_training_forward_on_cuda_is_the_cpu_forward(arch: str) -> None:
    torch.manual_seed(0)
    model = KwsCnn(model_config(arch, 0.25)).train()
    wave, _ = _batch()
    logits = []
    for device in ("cpu", "cuda"):
        gen = torch.Generator().manual_seed(7)  # masks and warps: drawn on the CPU
        m = copy.deepcopy(model).to(device)
        feats = augmented_log_mel(m, wave.to(device), gen, True, 0.1, 0.3)
        logits.append(m.classify(feats).cpu())
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    feats = augmented_log_mel(model, wave, torch.Generator().manual_seed(7), False, 0.1, 0.3)
    no_masks = model.classify(feats)
    assert not torch.allclose(no_masks, logits[0], atol=1e-4)  # the masks took effect


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("first,second", [("cpu", "cuda"), ("cuda", "cpu")])
def test_a_checkpoint_resumes_on_the_other_device(
    first: str, second: str, arch: str, tmp_path: Path
) -> None:
    x, y = _batch()
    runs = {}
    for device in (first, second):
        s = PretrainSettings(
            width=0.25, batch_size=8, samples=64, warmup_steps=1, device=device, arch=arch
        )
        runs[device] = (*seeded_model(s), s)
    model, opt, s = runs[first]
    train_step(model, opt, x, y, 0, torch.Generator(), s)
    save_state(tmp_path, model, opt, {"step": 1})
    model2, opt2, s2 = runs[second]
    assert load_state(tmp_path, model2, opt2)["step"] == 1
    assert all(st["exp_avg"].device.type == second for st in opt2.state.values())
    # The next step from the checkpoint is the same step on either device.
    loss1 = train_step(model, opt, x, y, 1, torch.Generator(), s)
    loss2 = train_step(model2, opt2, x, y, 1, torch.Generator(), s2)
    assert loss2 == pytest.approx(loss1, rel=1e-4)
    other = model2.state_dict()
    for k, a in model.state_dict().items():
        torch.testing.assert_close(other[k].cpu(), a.cpu(), rtol=1e-4, atol=1e-5, msg=k)
