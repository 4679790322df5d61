"""Autograd "region" functions: the vocabulary of tensor and sequence parallelism.

Each is a pair of collectives, one in forward and its adjoint in backward (Shoeybi et al.
2019, the f/g operators; Korthikanti et al. 2022, the g/ḡ operators of sequence parallel):

    copy_to_tp             forward identity          backward all-reduce     (f)
    reduce_from_tp         forward all-reduce        backward identity       (g)
    scatter_to_sp          forward keep my chunk     backward all-gather
    gather_from_sp         forward all-gather        backward keep my chunk
    all_gather_from_sp     forward all-gather        backward reduce-scatter (ḡ)
    reduce_scatter_to_sp   forward reduce-scatter    backward all-gather     (g with SP)

The adjoints follow from linearity: the transpose of "replicate" is "sum", the transpose of
"concatenate" is "split". Sequence chunks are along dim `seq_dim` (1 for (batch, seq, hidden))
and go to ranks in their order along the mesh dim. Every collective goes through
`plait.comm.ops`, so the ledger sees it with the tag given here (`<tag>.fwd` / `<tag>.bwd`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.autograd import Function

from plait.comm import ops

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


# ---- public functions (a dim of size 1 is the identity, as for every collective) ----------

def copy_to_tp(x: torch.Tensor, mesh: ParallelMesh, dim: str = "tp", tag: str = "tp"
               ) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward: enters a column-parallel region."""
    return x if mesh.size(dim) == 1 else _CopyToTP.apply(x, mesh, dim, tag)


def reduce_from_tp(x: torch.Tensor, mesh: ParallelMesh, dim: str = "tp", tag: str = "tp"
                   ) -> torch.Tensor:
    """All-reduce forward, identity backward: leaves a row-parallel region."""
    return x if mesh.size(dim) == 1 else _ReduceFromTP.apply(x, mesh, dim, tag)


def scatter_to_sp(x: torch.Tensor, mesh: ParallelMesh, dim: str = "tp", seq_dim: int = 1,
                  tag: str = "sp") -> torch.Tensor:
    """Keep this rank's sequence chunk of a replicated tensor; all-gather the gradient."""
    return x if mesh.size(dim) == 1 else _ScatterToSP.apply(x, mesh, dim, seq_dim, tag)


def gather_from_sp(x: torch.Tensor, mesh: ParallelMesh, dim: str = "tp", seq_dim: int = 1,
                   tag: str = "sp") -> torch.Tensor:
    """All-gather the sequence chunks; the gradient keeps this rank's chunk (no reduction)."""
    return x if mesh.size(dim) == 1 else _GatherFromSP.apply(x, mesh, dim, seq_dim, tag)


def all_gather_from_sp(x: torch.Tensor, mesh: ParallelMesh, dim: str = "tp", seq_dim: int = 1,
                       tag: str = "sp") -> torch.Tensor:
    """All-gather the sequence forward; reduce-scatter the (partial) gradient backward."""
    return x if mesh.size(dim) == 1 else _AllGatherFromSP.apply(x, mesh, dim, seq_dim, tag)


def reduce_scatter_to_sp(x: torch.Tensor, mesh: ParallelMesh, dim: str = "tp",
                         seq_dim: int = 1, tag: str = "sp") -> torch.Tensor:
    """Sum partial outputs and keep my sequence chunk forward; all-gather backward."""
    return x if mesh.size(dim) == 1 else _ReduceScatterToSP.apply(x, mesh, dim, seq_dim, tag)
