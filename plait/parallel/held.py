"""What an optimizer holds of each state on this rank, as a checkpoint names it.

Each GradSyncOptimizer (plait/parallel/optimizer.py) lists its `held_states()`: for every
parameter of this rank and every fp32 state it keeps (`master` and, for AdamW, `exp_avg`
and `exp_avg_sq`), the elements it holds and the live tensor that holds them. The
checkpoint (plait/checkpoint/pieces.py) places each in the global tensor (the tensor-
parallel box, from the PlacementTable) and decides who writes it; it never asks which
optimizer made the list. Its own module: replicated.py and zero_index.py build these, and
optimizer.py (which imports them both) declares the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, eq=False)
class HeldState:
    """Elements [start, stop) of parameter `name`'s state `state`, flattened over this rank's
    (tp-local) parameter `param`, held in the live tensor `tensor`: a load fills it in place.

    `flat`: `tensor` is the run's stop - start elements, flat (ZeRO's shard); else it is the
    whole local tensor, shaped like `param` (start 0, stop its numel). `sharded_over`: the
    mesh dims whose ranks hold different runs (ZeRO's unit dim), beside the placement's own
    splits. `copies_over`: mesh groups whose ranks hold the same run (hybrid sharding's
    replica groups): only their coordinate 0 writes it. `second_copy`: a copy equal to one
    held elsewhere (DualPipe's chain 1): never written, filled on load."""

    name: str  # the model's parameter name
    state: str  # master | exp_avg | exp_avg_sq
    param: nn.Parameter  # this rank's parameter: its placement says where it sits
    start: int
    stop: int
    tensor: torch.Tensor
    flat: bool = False
    sharded_over: tuple[str, ...] = ()
    copies_over: tuple[str, ...] = ()
    second_copy: bool = False
