"""The token loss: summed next-token cross-entropy over the tokens of the global batch.

Dividing each micro-batch's summed loss by the tokens of the *global* batch (not its own)
makes gradients summed over micro-batches and replicas exactly the gradient of the global
mean loss, and the logged loss (summed the same way) is the quantity a single-process run
logs. `token_loss` is pure maths on logits: both the training step and a pipeline's last
stage use it. `microbatch_loss` is the same loss of a whole model's forward on a
micro-batch of token rows (the single-process step of tests and benchmarks; the grad norm
is the optimizer's: plait/parallel/replicated.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from plait.model.precision import widened

LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def token_loss(logits: torch.Tensor, targets: torch.Tensor, tokens_in_global_batch: int,
               loss_fn: LossSum | None = None) -> torch.Tensor:
    """Summed cross-entropy of logits against targets / tokens in the global batch.

    `loss_fn(logits, targets)` (a summed loss) replaces the summed CE when the logits are
    split (tensor parallel's vocab-parallel loss).
    """
    if loss_fn is not None:
        return loss_fn(logits, targets) / tokens_in_global_batch
    loss_sum = F.cross_entropy(widened(logits).reshape(-1, logits.shape[-1]),
                               targets.reshape(-1), reduction="sum")
    return loss_sum / tokens_in_global_batch


def microbatch_loss(model: nn.Module, tokens: torch.Tensor, tokens_in_global_batch: int,
                    loss_fn: LossSum | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy of `tokens` / tokens in the global batch."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    return token_loss(model(inputs), targets, tokens_in_global_batch, loss_fn)
