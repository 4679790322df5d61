"""What the running autograd backward computes, for ZeRO-3 (plait/parallel/zero.py): a
unit's weights are gathered for the backwards that read them (the input gradient: B, or a
split backward's I), not for one that computes weight gradients only from saved
activations. Queries of torch's autograd engine, nothing of plait's."""

from __future__ import annotations

import torch


def in_backward() -> bool:
    """Inside autograd's backward (a recomputed forward runs there too)."""
    return torch._C._current_graph_task_id() != -1


def input_node(args: tuple) -> torch.autograd.graph.Node | None:
    """The autograd node of a module's first input when it takes a gradient (None for
    token ids, or a forward without a graph)."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if x is None or not x.requires_grad:
        return None
    return torch.autograd.graph.get_gradient_edge(x).node


def input_gradient_computed(node: torch.autograd.graph.Node | None) -> bool:
    """Whether the running backward computes the gradient of a unit's input (B, a split
    backward's I): what reads its weights; not W (weight gradients are computed from saved
    activations, though some formulas view the weight: ZeroOptimizer._weight_roots), nor
    any backward of the embedding (token ids take none)."""
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf asked for by autograd.grad: the stage input, in I
        return True
