"""A hinge on the window's logit, beside cross-entropy: where the operating point lives.

The detector fires when the window's score, sigmoid(logit[1] - logit[0]), passes a threshold
set by the highest-scoring negatives of hours of stream: 0.985-0.995 for the shipped models,
a logit difference of 4.2-5.3. Cross-entropy's pull on a positive is 1 - score, so a phrase
under babble that scores 0.98 is pushed up by 0.02, while a near-rhyme at 0.99 is pushed
down by 0.99: the phrases just under the threshold are the ones training barely moves.
The hinge asks every positive for a logit difference of at least `margin`, every negative for
at most -`margin`, and pulls with a constant force on each window short of it.

Asked of both sides at once, that hinge spread the logits until the top stream negatives
scored 1 - 4e-7, where float32 leaves no threshold between them and the phrases. The
bounded form (`positive_margin_loss`) asks it of the phrases alone, and only of those the
model already half believes (score above 0.5: a phrase buried under louder babble is left
to cross-entropy, or the model would learn that babble is the phrase), and holds every
window's logit difference under a cap, so scores stay where a threshold can tell them
apart."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

# A margin above this asks scores beyond float32's reach of 1 (sigmoid(17) = 1 - 4e-8).
MAX_MARGIN = 16.0


def logit_margin_loss(logits: Tensor, labels: Tensor, margin: float) -> Tensor:
    """Mean over the batch of max(0, margin - d) for positives and max(0, margin + d) for
    negatives, with d = logits[:, 1] - logits[:, 0] ([B, 2] logits, [B] labels in {0, 1})."""
    import torch

    d = logits[:, 1] - logits[:, 0]
    sign = labels.to(d.dtype) * 2.0 - 1.0  # +1 for the phrase, -1 for the rest
    return torch.relu(margin - sign * d).mean()


def positive_margin_loss(logits: Tensor, labels: Tensor, margin: float, cap: float) -> Tensor:
    """Mean over the batch of max(0, margin - d) for positives with d > 0, plus max(0, d -
    cap) for every window (d = logits[:, 1] - logits[:, 0]; [B, 2] logits, [B] labels);
    `cap` 0 leaves d uncapped."""
    import torch

    d = logits[:, 1] - logits[:, 0]
    near = (labels == 1) & (d.detach() > 0.0)
    loss = torch.where(near, torch.relu(margin - d), torch.zeros_like(d))
    if cap > 0:
        loss = loss + torch.relu(d - cap)
    return loss.mean()
