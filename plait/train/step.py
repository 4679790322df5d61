"""A micro-batch's loss (the grad norm is the optimizer's: plait/parallel/replicated.py).

The loss of a micro-batch is its summed token cross-entropy divided by the number of
tokens in the *global* batch, so gradients summed over micro-batches and over dp are
exactly the gradient of the global mean loss, and the logged loss (summed the same way)
is the quantity a single-process run logs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plait.model.loss import token_loss  # the stages' loss too; re-exported here


def microbatch_loss(model: nn.Module, tokens: torch.Tensor, tokens_in_global_batch: int,
                    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                    ) -> torch.Tensor:
    """Summed next-token cross-entropy of `tokens` / tokens in the global batch."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    return token_loss(model(inputs), targets, tokens_in_global_batch, loss_fn)

