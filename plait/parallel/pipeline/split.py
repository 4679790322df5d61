"""The I/W split of a backward, generic through autograd (no backward written by hand).

During F, forward hooks on every module that owns parameters directly (Linear, RMSNorm,
Embedding, whatever a strategy swapped in) keep that module's output y (`OutputCapture`).
I asks autograd for the gradient w.r.t. the stage input *and* every kept y, with the graph
retained: one pass that computes exactly the input-gradient chain (autograd prunes the
weight branches, since no parameter is asked for). W then asks, module by module, for the
gradient of y w.r.t. that module's own parameters, seeded with dy: autograd walks only the
branch from y to those parameters, so each weight gradient is computed once, from saved
activations, and accumulated into .grad like any backward.

Between I and W only what W reads stays (`SavedStore`): the forward's saved tensors go
through torch's saved-tensor hooks into the store, and after I it keeps those of the nodes
on the branches from each y to its parameters (a linear's input, a norm's normalised
value, an embedding's ids), not the rest of the graph (attention's q/k/v, the SwiGLU
intermediates, the norms' statistics, ...), nor the values of the ys themselves (W's
roots: their gradient is given). Where a branch holds a node whose saved tensors cannot
be listed (a Python autograd Function), nothing is released. A tensor released by mistake
is never read silently: W raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import torch
from torch import nn

Deferred = list[tuple[list[nn.Parameter], torch.Tensor, torch.Tensor]]  # (params, y, dy)


class OutputCapture:
    """Keeps the output of each parameter-owning module of `root` while `active` is set."""

    def __init__(self, root: nn.Module):
        self.active: list[tuple[nn.Module, torch.Tensor]] | None = None
        self.owners = [m for m in root.modules() if any(True for _ in m.parameters(False))]
        shared = {id(p) for m in self.owners for p in m.parameters(False)}
        if len(shared) != sum(len(list(m.parameters(False))) for m in self.owners):
            raise ValueError("a parameter owned by two modules cannot be split into I and W")
        self._hooks = [m.register_forward_hook(self._keep) for m in self.owners]

    def _keep(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self.active is not None and torch.is_grad_enabled() and isinstance(
                output, torch.Tensor) and output.requires_grad:
            self.active.append((module, output))

    def start(self) -> None:
        self.active = []

    def stop(self) -> list[tuple[nn.Module, torch.Tensor]]:
        kept, self.active = self.active or [], None
        return kept


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None,
                   inputs: Sequence[torch.Tensor],
                   kept: list[tuple[nn.Module, torch.Tensor]]
                   ) -> tuple[list[torch.Tensor | None], Deferred]:
    """I: gradients w.r.t. `inputs`, and the deferred weight work (params, y, dy) for W."""
    ys = [y for _, y in kept]
    grads = torch.autograd.grad(output, [*inputs, *ys], grad_output, retain_graph=True,
                                allow_unused=True)
    deferred = [(list(m.parameters(False)), y, dy)
                for (m, y), dy in zip(kept, grads[len(inputs):], strict=True) if dy is not None]
    return list(grads[:len(inputs)]), deferred


def backward_weight(deferred: Deferred) -> None:
    """W: accumulate each module's weight gradient from its kept output and dy."""
    for params, y, dy in deferred:
        torch.autograd.backward(y, dy, inputs=[p for p in params if p.requires_grad])




def _key(t: torch.Tensor) -> tuple:
    """What identifies a saved tensor's data (unpacking may return another tensor object)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype)


@cache
def _saved_fields(node_type: type) -> tuple[str, ...] | None:
    """A node type's `_saved_*` fields (the same for every node of the type: looked up
    once, not with `dir` per node and I); None for a Python Function's node, whose saved
    tensors are not listed that way."""
    if hasattr(node_type, "saved_tensors"):
        return None
    return tuple(name for name in dir(node_type) if name.startswith("_saved_"))


def _saved_tensors(node: Any) -> list[torch.Tensor] | None:
    """The tensors an autograd node saved (its `_saved_*` fields); None for a Python
    Function's node."""
    fields = _saved_fields(type(node))
    if fields is None:
        return None
    out: list[torch.Tensor] = []
    for name in fields:
        value = getattr(node, name)
        values = value if isinstance(value, list | tuple) else [value]
        out += [v for v in values if isinstance(v, torch.Tensor)]
    return out


_DEPTH = 24  # a module's parameters sit a few nodes below its output (views, casts, t())


def _weight_branch(deferred: Deferred) -> list[Any] | None:
    """The nodes on the paths from each y to its module's parameters (what W runs), looked
    for within _DEPTH nodes of y and not past another module's output (a parameter is
    reached from its own module's output; the graph below the others is theirs to search:
    searching it from every y cost each I a millisecond); None if some parameter was not
    found so (nothing is released then)."""
    nodes: set[Any] = set()
    outputs = [y.grad_fn for _, y, _ in deferred]
    for params, y, _ in deferred:
        wanted = {id(p) for p in params if p.requires_grad}
        found: set[int] = set()
        memo: dict[Any, bool] = dict.fromkeys(outputs, False)
        memo.pop(y.grad_fn, None)

        def reaches(node: Any, depth: int, wanted=wanted, found=found, memo=memo) -> bool:
            if node is None or depth > _DEPTH:
                return False
            if node in memo:
                return memo[node]
            var = getattr(node, "variable", None)
            if var is not None:
                hit = id(var) in wanted
                found.update({id(var)} if hit else set())
            else:
                hit = any([reaches(n, depth + 1) for n, _ in node.next_functions])
                if hit:
                    nodes.add(node)
            memo[node] = hit
            return hit

        reaches(y.grad_fn, 0)
        if found != wanted:
            return None
    return list(nodes)


class SavedStore:
    """The tensors autograd saves during one (stage, micro-batch)'s forward, held here so
    that after I the ones W does not read can be let go (`keep_only_for_weights`)."""

    def __init__(self) -> None:
        self._held: dict[int, torch.Tensor] = {}
        self._count = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> int:
        self._count += 1
        handle = self._count
        self._held[handle] = t
        return handle

    def _unpack(self, handle: int) -> torch.Tensor:
        if handle not in self._held:
            raise RuntimeError("a saved tensor released after I was read by W: the "
                               "split's weight branch missed it (plait/parallel/pipeline/"
                               "split.py)")
        return self._held[handle]

    def release(self) -> None:
        """After W: let every tensor go now. (A saved tensor's node holds the hooks, which
        hold this store: a reference cycle the garbage collector would free only later.)"""
        self._held.clear()

    def keep_only_for_weights(self, deferred: Deferred) -> None:
        """After I: release every saved tensor W does not read, and the ys' values."""
        branch = _weight_branch(deferred)
        saved = [_saved_tensors(n) for n in branch or []]
        if branch is None or any(s is None for s in saved):
            return  # a parameter not found near its output, or a node we cannot see into
        need = {_key(t) for ts in saved for t in ts}
        self._held = {h: t for h, t in self._held.items() if _key(t) in need}
        storages = {k[0] for k in need}
        for _, y, _ in deferred:
            if y.untyped_storage().data_ptr() not in storages and not y._is_view():
                # W's root only: its shape is checked against dy, its values never read
                y.data = torch.zeros((), dtype=y.dtype, device=y.device).expand(y.shape)
