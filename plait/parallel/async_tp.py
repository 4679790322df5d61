"""Async tensor parallel (`parallel.async_tp`): sequence parallel's all-gather before the
column-parallel matmuls and reduce-scatter after the row-parallel ones, each decomposed
into ring hops that overlap partial matmuls (the collective matmul: Wang et al. 2023,
ASPLOS, section 3; what torchtitan's async TP and Megatron-Core's `tp_comm_overlap` do
on GPUs). The maths and the bytes are plain tp + SP's (plait/parallel/tensor.py); only
the order of the work changes:

    region entry   x (b, s/t, h) --ring all-gather--> x_full; as each rank's chunk
                   arrives, the region's column-parallel linears that read x_full (wq, wk,
                   wv; w1, w3; the LM head) multiply it: their outputs are ready when the
                   gather is. Backward: dX_full's chunks (dy · W summed over those
                   linears) travel a ring reduce-scatter, each computed during the
                   previous hop; the weight gradients fill the hops too.
    region exit    the row-parallel linear (wo; w2) computes its partial output chunk by
                   chunk, destination by destination, and each travels the ring
                   reduce-scatter while the next is computed. Backward: dy's ring
                   all-gather, dz of each chunk as it arrives.

The hops are plait's (plait/comm/ring.py), so the ledger records each decomposed
collective as the one it replaces. A pipeline's split backward (I, then W) is served by
asking autograd's engine which gradients the running backward computes: I computes the
input gradients (and keeps the gathered dy of a row-parallel linear for W), W the weight
gradients from saved activations with no communication, as plain tp + SP does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function
from torch.autograd.graph import get_gradient_edge

from plait.comm.ring import ring_all_gather, ring_reduce_scatter
from plait.mesh import ParallelMesh

DIM = "tp"
SEQ = 1  # the sequence axis of (batch, seq, hidden)
# the column-parallel linears of a region that read the region's input (the others, MLA's
# up-projections, read latents computed from it and run as plain tp)
REGION_INPUT_LINEARS = ("wq", "wk", "wv", "w1", "w3")


def _computed(node) -> bool:
    """Whether the running backward computes the gradient whose edge is `node` (None: a
    tensor that takes no gradient)."""
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf asked for by autograd.grad: computed
        return True


def _edge(t: torch.Tensor):
    return get_gradient_edge(t).node if t.requires_grad else None


def _rows(t: torch.Tensor, d: int, c: int) -> torch.Tensor:
    """Sequence chunk d (c positions) of a (b, s, ...) tensor."""
    return t.narrow(SEQ, d * c, c)


class _GatherMatmuls(Function):
    """(x_full, x_full · W_1ᵀ, ...) from x's sequence chunk, the matmuls done per chunk as
    the ring brings it."""

    @staticmethod
    def forward(ctx, x, mesh: ParallelMesh, tag: str, *weights):
        ctx.set_materialize_grads(False)
        n = mesh.size(DIM)
        b, c, h = x.shape
        chunks = x.new_empty((n, b, c, h))
        chunks[mesh.coord(DIM)] = x
        ys = [x.new_empty((b, n, c, w.shape[0])) for w in weights]
        for src in ring_all_gather(chunks, mesh, DIM, tag=f"{tag}.fwd"):
            for y, w in zip(ys, weights, strict=True):
                y[:, src] = F.linear(chunks[src], w)
        x_full = chunks.transpose(0, 1).reshape(b, n * c, h)
        ctx.mesh, ctx.tag, ctx.c, ctx.deferred, ctx.x_full = mesh, tag, c, 0, None
        ctx.nodes = (_edge(x), *(_edge(w) for w in weights))
        ctx.save_for_backward(x_full, *weights)
        return (x_full, *(y.view(b, n * c, -1) for y in ys))

    @staticmethod
    def backward(ctx, dx_full, *dys):
        x_node, *w_nodes = ctx.nodes
        want_w = [dy is not None and _computed(node) for dy, node in zip(dys, w_nodes,
                                                                          strict=True)]
        if _computed(x_node):  # the input gradient: B, or a split backward's I
            x_full, *weights = ctx.saved_tensors
            # I leaves these weight gradients to W, one backward per linear over this one
            # node: after the first the saved tensors are freed, so W reads x_full here
            ctx.deferred = sum(dy is not None and node is not None and not want
                               for dy, node, want in zip(dys, w_nodes, want_w, strict=True))
            ctx.x_full = x_full if ctx.deferred else None
        else:  # W: weight gradients from the saved input only, no communication
            x_full, weights = ctx.x_full, None
            if x_full is None:
                x_full = ctx.saved_tensors[0]
            ctx.deferred -= sum(want_w)
            if ctx.deferred <= 0:
                ctx.x_full = None
        flat_x = x_full.flatten(0, 1)
        dws: list[torch.Tensor | None] = [None] * len(dys)

        def weight_grad(i: int) -> None:
            dws[i] = dys[i].flatten(0, 1).t() @ flat_x

        work = [lambda i=i: weight_grad(i) for i, want in enumerate(want_w) if want]
        dx = None
        if weights is not None:
            c = ctx.c

            def partial(d: int) -> torch.Tensor:
                out = None if dx_full is None else _rows(dx_full, d, c).clone()
                for dy, w in zip(dys, weights, strict=True):
                    if dy is not None:
                        term = _rows(dy, d, c) @ w
                        out = term if out is None else out + term
                return out if out is not None else x_full.new_zeros(_rows(x_full, d, c).shape)
            dx = ring_reduce_scatter(partial, ctx.mesh, DIM, tag=f"{ctx.tag}.bwd",
                                     side_work=work)
        else:
            for item in work:
                item()
        return (dx, None, None, *dws)


class _KeepForScatter(Function):
    """The identity, keeping the row-parallel linear's input for its backward. A node of
    its own, before the ring: recomputation (a checkpointed block's forward run again in
    backward) stops at the last tensor a block saves, so the ring after it, whose output
    no backward reads, is not run again (nor is the plain reduce-scatter)."""

    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return z.view_as(z)

    @staticmethod
    def backward(ctx, dz):
        return dz


class _MatmulScatter(Function):
    """This rank's sequence chunk of Σ_ranks z · Wᵀ: each destination's partial computed
    while the previous one travels the ring. z comes kept by `_KeepForScatter`."""

    @staticmethod
    def forward(ctx, z, weight, mesh: ParallelMesh, tag: str):
        n = mesh.size(DIM)
        c = z.shape[SEQ] // n
        y = ring_reduce_scatter(lambda d: F.linear(_rows(z, d, c), weight), mesh, DIM,
                                tag=f"{tag}.fwd")
        ctx.mesh, ctx.tag, ctx.kept, ctx.weight = mesh, tag, z.grad_fn, weight
        ctx.nodes = (_edge(z), _edge(weight))
        ctx.dy_full = None  # a split backward's I keeps the gathered dy for W
        return y

    @staticmethod
    def backward(ctx, dy):
        (z,), weight = ctx.kept.saved_tensors, ctx.weight
        mesh, n = ctx.mesh, ctx.mesh.size(DIM)
        z_node, w_node = ctx.nodes
        want_w = _computed(w_node)
        dz = None
        if _computed(z_node):
            b, c, h = dy.shape
            chunks = dy.new_empty((n, b, c, h))
            chunks[mesh.coord(DIM)] = dy
            dz = z.new_empty((b, n, c, z.shape[-1]))
            for src in ring_all_gather(chunks, mesh, DIM, tag=f"{ctx.tag}.bwd"):
                dz[:, src] = chunks[src] @ weight
            dz = dz.view_as(z)
            dy_full = chunks.transpose(0, 1).reshape(b, n * c, h)
            if not want_w and w_node is not None:
                ctx.dy_full = dy_full  # I: W reads it
        else:  # W: the dy that I gathered
            dy_full, ctx.dy_full = ctx.dy_full, None
            if dy_full is None:
                raise RuntimeError("async tensor parallel: a weight-only backward found no "
                                   "gathered output gradient (the input backward runs first)")
        dw = dy_full.flatten(0, 1).t() @ z.flatten(0, 1) if want_w else None
        return dz, dw, None, None


def matmul_reduce_scatter(z: torch.Tensor, weight: torch.Tensor, mesh: ParallelMesh,
                          tag: str) -> torch.Tensor:
    """reduce_scatter_to_sp(z · Wᵀ) as one ring (z: (b, s, f/t) -> (b, s/t, h))."""
    return _MatmulScatter.apply(_KeepForScatter.apply(z), weight, mesh, tag)


# ---- the modules a region's linears become ---------------------------------------------

class _Gathered:
    """What a region's entry computed: the gathered input and its linears' outputs."""

    def __init__(self) -> None:
        self.x_full: torch.Tensor | None = None
        self.outputs: dict[int, torch.Tensor] = {}


class GatheredColumnLinear(nn.Module):
    """A column-parallel linear reading the region's gathered input: its output was computed
    during the gather, chunk by chunk; called with that input, it returns it."""

    def __init__(self, weight: nn.Parameter, gathered: _Gathered, index: int, name: str):
        super().__init__()
        self.weight, self.gathered, self.index, self.name = weight, gathered, index, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x is not self.gathered.x_full or self.index not in self.gathered.outputs:
            raise RuntimeError(f"async tensor parallel: {self.name} was called on another "
                               "tensor than its region's gathered input")
        return self.gathered.outputs.pop(self.index)


class ScatteredRowLinear(nn.Module):
    """A row-parallel linear whose output is reduce-scattered as it is computed."""

    def __init__(self, weight: nn.Parameter, mesh: ParallelMesh, tag: str):
        super().__init__()
        self.weight, self.mesh, self.tag = weight, mesh, tag
        self.last: torch.Tensor | None = None

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        self.last = matmul_reduce_scatter(z, self.weight, self.mesh, self.tag)
        return self.last


class GatheredHead(nn.Module):
    """The LM head (column-parallel over the vocabulary) on the sequence-split hidden
    states: the all-gather and the logits' matmul as one ring."""

    def __init__(self, weight: nn.Parameter, mesh: ParallelMesh, tag: str):
        super().__init__()
        self.weight, self.mesh, self.tag = weight, mesh, tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherMatmuls.apply(x, self.mesh, self.tag, self.weight)[1]


def install_async_region(region: nn.Module, mesh: ParallelMesh, tag: str,
                         column: type, row: type) -> list:
    """Swap a region's linears (already `column` / `row` parallel) for their ring forms and
    enter it by the gathering ring; its output is its row-parallel linear's, scattered
    already. Returns the hook handles."""
    gathered = _Gathered()
    reads_input = []
    for name in REGION_INPUT_LINEARS:
        child = getattr(region, name, None)
        if isinstance(child, column):
            reads_input.append(child.weight)
            setattr(region, name, GatheredColumnLinear(child.weight, gathered,
                                                       len(reads_input) - 1,
                                                       f"{tag}.{name}"))
    rows = [(n, m) for n, m in region.named_children() if isinstance(m, row)]
    if len(rows) != 1:
        raise ValueError(f"async tensor parallel: region {tag} needs one row-parallel "
                         f"linear, has {len(rows)}")
    out_name, out_linear = rows[0]
    scattered = ScatteredRowLinear(out_linear.weight, mesh, tag)
    setattr(region, out_name, scattered)

    def enter(_m, args):
        x_full, *ys = _GatherMatmuls.apply(args[0], mesh, tag, *reads_input)
        gathered.x_full, gathered.outputs = x_full, dict(enumerate(ys))
        return (x_full, *args[1:])

    def leave(_m, _args, out):
        gathered.x_full, gathered.outputs = None, {}
        if out is not scattered.last:
            raise RuntimeError(f"async tensor parallel: region {tag} must return its "
                               f"row-parallel linear's output ({out_name})")
        scattered.last = None
        return out

    return [region.register_forward_pre_hook(enter), region.register_forward_hook(leave)]
