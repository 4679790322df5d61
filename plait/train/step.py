"""One optimizer step: micro-batches forward/backward, gradient sync, norm, clip, update.

The loss of a micro-batch is its summed token cross-entropy divided by the number of
tokens in the *global* batch, so gradients summed over micro-batches and over dp are
exactly the gradient of the global mean loss, and the logged loss (summed the same way)
is the quantity a single-process run logs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from plait import comm
from plait.mesh import ParallelMesh
from plait.model.loss import token_loss  # the stages' loss too; re-exported here
from plait.placement import PlacementTable


def global_grad_norm(params: list[nn.Parameter], mesh: ParallelMesh,
                     placements: PlacementTable) -> float:
    """L2 norm of the full gradient across the mesh, each parameter element counted once.

    A parameter replicated over a dim contributes only from the rank at coordinate 0 of
    that dim (`placements.counts_in_norm`); the partial sums are then all-reduced once over
    the world. When nothing is sharded every rank already holds the whole gradient and no
    communication is needed.
    """
    grads = [(p, p.grad) for p in params if p.grad is not None]
    if not placements.any_sharded([p for p, _ in grads]) or mesh.world_size == 1:
        sq = sum(float(g.float().pow(2).sum()) for _, g in grads)
        return math.sqrt(sq)
    total = torch.zeros(1, dtype=torch.float64, device=mesh.device.torch)
    for p, g in grads:
        if placements.counts_in_norm(p, mesh):
            total += g.double().pow(2).sum()
    comm.all_reduce(total, mesh, "world", tag="grad_norm")
    return math.sqrt(float(total))


def microbatch_loss(model: nn.Module, tokens: torch.Tensor, tokens_in_global_batch: int,
                    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                    ) -> torch.Tensor:
    """Summed next-token cross-entropy of `tokens` / tokens in the global batch."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    return token_loss(model(inputs), targets, tokens_in_global_batch, loss_fn)

