"""The token loss: summed next-token cross-entropy over the tokens of the global batch.

Dividing each micro-batch's summed loss by the tokens of the *global* batch (not its own)
makes gradients summed over micro-batches and replicas exactly the gradient of the global
mean loss. Pure maths on logits: both the training step and a pipeline's last stage use it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def token_loss(logits: torch.Tensor, targets: torch.Tensor, tokens_in_global_batch: int,
               loss_fn: LossSum | None = None) -> torch.Tensor:
    """Summed cross-entropy of logits against targets / tokens in the global batch.

    `loss_fn(logits, targets)` (a summed loss) replaces the summed CE when the logits are
    split (tensor parallel's vocab-parallel loss).
    """
    if loss_fn is not None:
        return loss_fn(logits, targets) / tokens_in_global_batch
    loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               targets.reshape(-1), reduction="sum")
    return loss_sum / tokens_in_global_batch
