"""Regional compilation (`train.compile`): torch.compile applied to each transformer
block's forward, as torchtitan compiles each block, so that every block reuses one
compiled graph (the blocks differ only in their parameters, which the graph takes as
inputs) and compile time does not grow with depth.

Only a block's `forward` is compiled, not its module call: the hooks on the block itself
(ZeRO-3's gather before a unit's forward and its release after) stay eager around it.
Inside, plait's communication is never traced. Its collectives are Python around the
process group's calls (ledger records, timing, buffer lifetimes), which dynamo cannot
compile and would retrace for every layer's tag; so every hook on a module inside a block
(tensor parallel's region entry and exit, ZeRO's weight-gradient roots) and every module
that communicates or routes tokens by data-dependent counts (context parallel's attention
core, a MoE block's experts, async tensor parallel's ring linears, float8 linears with
their scales' all-reduce) is marked opaque: a
graph break, run eagerly. The compiled graphs are the compute between them: a block
without tensor parallel is one graph forward and one backward; under tp the norms and
residuals, the attention between its region's entry and exit, and the MLP between its.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from plait.config.compile_checks import COMPILE_BACKENDS
from plait.model.layers import CausalAttentionCore
from plait.model.moe import MoE
from plait.model.transformer import Block
from plait.parallel import async_tp
from plait.parallel.fp8 import is_float8

# modules that communicate inside a block (besides the hooks)
_COMMUNICATING = (MoE, async_tp.GatheredColumnLinear, async_tp.ScatteredRowLinear)


def _opaque_inside(block: nn.Module) -> int:
    """Mark every hook and communicating module inside `block` as a graph break; returns
    how many were marked."""
    marked = 0
    for module in block.modules():
        if module is block:  # its own hooks run outside its compiled forward
            continue
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key, hook in hooks.items():
                hooks[key] = torch.compiler.disable(hook)
                marked += 1
        swapped_core = (hasattr(module, "core")
                        and not isinstance(module.core, CausalAttentionCore))
        if swapped_core:  # context parallel's ring or all-gather attention
            module.core.forward = torch.compiler.disable(module.core.forward)
            marked += 1
        if isinstance(module, _COMMUNICATING) or is_float8(module):  # fp8: amax reductions
            module.forward = torch.compiler.disable(module.forward)
            marked += 1
    return marked


def compile_blocks(stages: Iterable[nn.Module], backend: str = "inductor") -> int:
    """Compile the forward of every `Block` in `stages`, in place, after marking what
    inside it must stay eager; returns how many blocks."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile backend {backend!r}; use one of "
                         f"{', '.join(COMPILE_BACKENDS)}")
    blocks = {id(m): m for stage in stages for m in stage.modules() if isinstance(m, Block)}
    for block in blocks.values():
        _opaque_inside(block)
        block.forward = torch.compile(block.forward, backend=backend)
    return len(blocks)
