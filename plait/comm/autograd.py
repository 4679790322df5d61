"""Differentiable collectives: every collective that autograd runs, forward and backward.

Each is a small `torch.autograd.Function` and a public function. A collective in forward
has its adjoint in backward, which follows from linearity: the transpose of "replicate" is
"sum", the transpose of "concatenate" is "split".

    name                  forward                   backward                 used by
    copy_to_tp            identity                  all-reduce               tensor.py (f)
    reduce_from_tp        all-reduce                identity                 tensor.py (g)
    scatter_to_sp         keep my sequence chunk    all-gather               tests
    gather_from_sp        all-gather                keep my chunk            tests
    all_gather_from_sp    all-gather                reduce-scatter           tensor.py (ḡ)
    reduce_scatter_to_sp  reduce-scatter            all-gather               tensor.py (g, SP)
    all_to_all_tokens     all-to-all (uneven)       the reverse all-to-all   expert.py
    all_gather_kv         all-gather K/V            reduce-scatter dK/dV     context.py

(f/g: Shoeybi et al. 2019, Megatron-LM; g/ḡ: Korthikanti et al. 2022, sequence parallel;
the modules under "used by" are in plait/parallel/.) The first six are tensor and
sequence parallel's regions: sequence chunks are along dim `seq_dim` (1 for (batch, seq,
hidden)) and go to ranks in their order along the mesh dim; on a dim of size 1 each is the
identity, with no autograd node. `all_to_all_tokens` moves expert parallel's token rows
(plait/parallel/expert.py), `all_gather_kv` context parallel's packed K/V in its
"allgather" mode (plait/parallel/context.py); both always run their Function.

Every collective goes through `plait.comm.ops`, so the ledger sees it with the tag given
here: `<tag>.fwd` / `<tag>.bwd` for the regions and the K/V gather; `<tag>` forward and
`<tag>.grad` backward for the all-to-all. Collectives that are not a pair of adjoints live
with the maths they serve: the vocab-parallel loss's all-reduces (plait/parallel/tensor.py)
and the ring attention's send/receive (plait/parallel/context.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.autograd import Function

from plait.comm import ops
from plait.comm.ops import Handle

if TYPE_CHECKING:
    from plait.mesh import ParallelMesh


def _all_reduce(x: torch.Tensor, mesh: ParallelMesh, dim: str, tag: str) -> torch.Tensor:
    # a fresh buffer: the incoming tensor may be shared (autograd hands one gradient to both
    # branches of a residual add), so it must never be reduced in place
    out = x.contiguous().clone()
    ops.all_reduce(out, mesh, dim, tag=tag)
    return out


def _gather_seq(x: torch.Tensor, mesh: ParallelMesh, dim: str, seq_dim: int,
                tag: str) -> torch.Tensor:
    """Concatenate every rank's chunk along seq_dim (rank order)."""
    n = mesh.size(dim)
    # all_gather_into_tensor stacks along the first axis: move the sequence axis there
    front = x.movedim(seq_dim, 0).contiguous()
    buf = torch.empty((n * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    ops.all_gather(buf, front, mesh, dim, tag=tag)
    return buf.movedim(0, seq_dim).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, mesh: ParallelMesh, dim: str, seq_dim: int,
                        tag: str) -> torch.Tensor:
    """Sum over ranks, each keeping its chunk along seq_dim."""
    n = mesh.size(dim)
    if x.shape[seq_dim] % n:
        raise ValueError(f"sequence length {x.shape[seq_dim]} is not divisible by {dim}={n}")
    front = x.movedim(seq_dim, 0).contiguous()
    out = torch.empty((front.shape[0] // n, *front.shape[1:]), dtype=x.dtype, device=x.device)
    ops.reduce_scatter(out, front, mesh, dim, tag=tag)
    return out.movedim(0, seq_dim).contiguous()


def _my_chunk(x: torch.Tensor, mesh: ParallelMesh, dim: str, seq_dim: int) -> torch.Tensor:
    n = mesh.size(dim)
    if x.shape[seq_dim] % n:
        raise ValueError(f"sequence length {x.shape[seq_dim]} is not divisible by {dim}={n}")
    return x.chunk(n, seq_dim)[mesh.coord(dim)].contiguous()


# ---- tensor and sequence parallel regions ---------------------------------------------------

class _CopyToTP(Function):
    @staticmethod
    def forward(ctx, x, mesh, dim, tag):
        ctx.args = (mesh, dim, tag)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        mesh, dim, tag = ctx.args
        return _all_reduce(g, mesh, dim, f"{tag}.bwd"), None, None, None


class _ReduceFromTP(Function):
    @staticmethod
    def forward(ctx, x, mesh, dim, tag):
        return _all_reduce(x, mesh, dim, f"{tag}.fwd")

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


class _ScatterToSP(Function):
    @staticmethod
    def forward(ctx, x, mesh, dim, seq_dim, tag):
        ctx.args = (mesh, dim, seq_dim, tag)
        return _my_chunk(x, mesh, dim, seq_dim)

    @staticmethod
    def backward(ctx, g):
        mesh, dim, seq_dim, tag = ctx.args
        return _gather_seq(g, mesh, dim, seq_dim, f"{tag}.bwd"), None, None, None, None


class _GatherFromSP(Function):
    @staticmethod
    def forward(ctx, x, mesh, dim, seq_dim, tag):
        ctx.args = (mesh, dim, seq_dim)
        return _gather_seq(x, mesh, dim, seq_dim, f"{tag}.fwd")

    @staticmethod
    def backward(ctx, g):
        mesh, dim, seq_dim = ctx.args
        return _my_chunk(g, mesh, dim, seq_dim), None, None, None, None


class _AllGatherFromSP(Function):
    @staticmethod
    def forward(ctx, x, mesh, dim, seq_dim, tag):
        ctx.args = (mesh, dim, seq_dim, tag)
        return _gather_seq(x, mesh, dim, seq_dim, f"{tag}.fwd")

    @staticmethod
    def backward(ctx, g):
        mesh, dim, seq_dim, tag = ctx.args
        return _reduce_scatter_seq(g, mesh, dim, seq_dim, f"{tag}.bwd"), None, None, None, None


class _ReduceScatterToSP(Function):
    @staticmethod
    def forward(ctx, x, mesh, dim, seq_dim, tag):
        ctx.args = (mesh, dim, seq_dim, tag)
        return _reduce_scatter_seq(x, mesh, dim, seq_dim, f"{tag}.fwd")

    @staticmethod
    def backward(ctx, g):
        mesh, dim, seq_dim, tag = ctx.args
        return _gather_seq(g, mesh, dim, seq_dim, f"{tag}.bwd"), None, None, None, None


# a dim of size 1 is the identity, as for every collective

def copy_to_tp(x: torch.Tensor, mesh: ParallelMesh, dim: str = "tp", tag: str = "tp"
               ) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce of the gradient (`<tag>.bwd`). Enters a
    column-parallel region."""
    return x if mesh.size(dim) == 1 else _CopyToTP.apply(x, mesh, dim, tag)


def reduce_from_tp(x: torch.Tensor, mesh: ParallelMesh, dim: str = "tp", tag: str = "tp"
                   ) -> torch.Tensor:
    """Forward: all-reduce (`<tag>.fwd`). Backward: identity. Leaves a row-parallel
    region."""
    return x if mesh.size(dim) == 1 else _ReduceFromTP.apply(x, mesh, dim, tag)


def scatter_to_sp(x: torch.Tensor, mesh: ParallelMesh, dim: str = "tp", seq_dim: int = 1,
                  tag: str = "sp") -> torch.Tensor:
    """Forward: keep this rank's sequence chunk of a replicated tensor. Backward: all-gather
    the gradient (`<tag>.bwd`)."""
    return x if mesh.size(dim) == 1 else _ScatterToSP.apply(x, mesh, dim, seq_dim, tag)


def gather_from_sp(x: torch.Tensor, mesh: ParallelMesh, dim: str = "tp", seq_dim: int = 1,
                   tag: str = "sp") -> torch.Tensor:
    """Forward: all-gather the sequence chunks (`<tag>.fwd`). Backward: the gradient keeps
    this rank's chunk (no reduction)."""
    return x if mesh.size(dim) == 1 else _GatherFromSP.apply(x, mesh, dim, seq_dim, tag)


def all_gather_from_sp(x: torch.Tensor, mesh: ParallelMesh, dim: str = "tp", seq_dim: int = 1,
                       tag: str = "sp") -> torch.Tensor:
    """Forward: all-gather the sequence (`<tag>.fwd`). Backward: reduce-scatter the
    (partial) gradient (`<tag>.bwd`)."""
    return x if mesh.size(dim) == 1 else _AllGatherFromSP.apply(x, mesh, dim, seq_dim, tag)


def reduce_scatter_to_sp(x: torch.Tensor, mesh: ParallelMesh, dim: str = "tp",
                         seq_dim: int = 1, tag: str = "sp") -> torch.Tensor:
    """Forward: sum partial outputs and keep my sequence chunk (reduce-scatter,
    `<tag>.fwd`). Backward: all-gather (`<tag>.bwd`)."""
    return x if mesh.size(dim) == 1 else _ReduceScatterToSP.apply(x, mesh, dim, seq_dim, tag)


# ---- expert parallel: token rows to their experts' ranks ----------------------------------

class OverlapSeam:
    """Where an overlapped F&B pair (plait/parallel/pipeline/fb_overlap.py) takes over the
    waits of the all-to-alls it interleaves: while `wait` is set, each is issued async and
    handed to `wait(handle, backward)`, which runs the pair's other side before completing
    it; None: each completes at once (a blocking collective)."""

    def __init__(self) -> None:
        self.wait: Callable[[Handle, bool], None] | None = None


def _exchange(out: torch.Tensor, x: torch.Tensor, mesh: ParallelMesh, dim: str,
              splits: tuple[list[int], list[int]], tag: str, seam: OverlapSeam | None,
              backward: bool) -> None:
    wait = seam.wait if seam is not None else None
    if wait is None:
        ops.all_to_all(out, x, mesh, dim, *splits, tag=tag)
        return
    wait(ops.all_to_all(out, x, mesh, dim, *splits, async_op=True, tag=tag), backward)


class _AllToAll(Function):
    """all_to_all_single with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, mesh, out_splits, in_splits, tag, dim, seam):
        ctx.mesh, ctx.splits, ctx.tag, ctx.dim = mesh, (out_splits, in_splits), tag, dim
        ctx.seam = seam
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        _exchange(out, x.contiguous(), mesh, dim, (out_splits, in_splits), tag, seam, False)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        _exchange(back, grad.contiguous(), ctx.mesh, ctx.dim, (in_splits, out_splits),
                  ctx.tag + ".grad", ctx.seam, True)
        return back, None, None, None, None, None, None


def all_to_all_tokens(x: torch.Tensor, mesh: ParallelMesh, out_splits: list[int],
                      in_splits: list[int], tag: str, dim: str,
                      seam: OverlapSeam | None = None) -> torch.Tensor:
    """Forward: all-to-all of `x`'s rows (`in_splits[r]` rows to rank r, `out_splits[r]`
    from it; `<tag>`). Backward: the reverse all-to-all sends the gradient rows back
    (`<tag>.grad`). `seam`: read when each direction is issued (see OverlapSeam)."""
    return _AllToAll.apply(x, mesh, out_splits, in_splits, tag, dim, seam)


# ---- context parallel ("allgather" mode): K/V over its ranks ------------------------------

class _GatherKV(Function):
    """All-gather the packed K/V over `dim` (rank order); backward: reduce-scatter dK/dV."""

    @staticmethod
    def forward(ctx, kv, mesh: ParallelMesh, tag: str, dim: str):
        ctx.mesh, ctx.tag, ctx.dim = mesh, tag, dim
        n = mesh.size(dim)
        out = torch.empty(n * kv.numel(), dtype=kv.dtype, device=kv.device)
        ops.all_gather(out, kv.reshape(-1), mesh, dim, tag=f"{tag}.fwd")
        return out.view(n, *kv.shape)

    @staticmethod
    def backward(ctx, g):
        out = torch.empty(g[0].numel(), dtype=g.dtype, device=g.device)
        ops.reduce_scatter(out, g.reshape(-1), ctx.mesh, ctx.dim, tag=f"{ctx.tag}.bwd")
        return out.view(g.shape[1:]), None, None, None


def all_gather_kv(kv: torch.Tensor, mesh: ParallelMesh, tag: str, dim: str
                  ) -> torch.Tensor:
    """Forward: all-gather the packed K/V over `dim` into (n, *kv.shape), rank order
    (`<tag>.fwd`). Backward: reduce-scatter dK/dV, each rank keeping its own (`<tag>.bwd`)."""
    return _GatherKV.apply(kv, mesh, tag, dim)
