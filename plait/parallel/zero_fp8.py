"""ZeRO-3's all-gather of float8 weights (`train.precision = "fp8"`): the block linears'
weights travel in float8, one byte an element where bf16 takes two.

A ZeRO-3 unit holds either float8 linears' weights only, or none (zero_units.py splits a
block's parameters so). After each update (and before the first forward) every rank
casts its shard of each such weight to E4M3 with the *whole* weight's scale: the amax of
its own part of each weight, then one all-reduce (max) of those amaxes over the unit's
shard dim, and over tp where tp splits the weights, gives every rank the scale one
process computes from the whole weight (plait/model/fp8.py). The all-gather then moves
the float8 shard; each linear reads its float8 weight and scale straight from the
gathered buffer (`Float8Settings.gathered`), and the bf16 weight is never formed. The
values are those of casting the whole bf16 weight, bit for bit: the cast is element-wise
and the scale the same. torchao's float8 all-gather for FSDP2 does the same, its amaxes
in one all-reduce too (`precompute_float8_dynamic_scale_for_fsdp`). Under the blockwise
recipe each weight has a scale a block instead (plait/parallel/zero_fp8_blocks.py).
"""

from __future__ import annotations

import torch

from plait import comm
from plait.comm.ops import Handle
from plait.mesh import ParallelMesh
from plait.model.fp8 import E4M3, scale_for, to_fp8
from plait.model.precision import wide_dtype, widened
from plait.parallel.fp8 import AMAX_TAG
from plait.parallel.tensor import DIM as TP
from plait.parallel.zero_fp8_blocks import cast_block_shards
from plait.parallel.zero_units import _Unit


def cast_shards(units: list[_Unit], mesh: ParallelMesh) -> None:
    """Each float8 unit's shard cast to E4M3 (as bytes) with its weights' whole-tensor
    scales: the module docstring. Collective over the units' shard dims (and tp)."""
    fp8 = [u for u in units if u.fp8_modules]
    blockwise = [u for u in fp8 if u.fp8_modules[0].fp8.recipe == "blockwise"]
    if blockwise:
        cast_block_shards(blockwise, mesh, blockwise[0].fp8_modules[0].fp8.block)
        fp8 = [u for u in fp8 if u.fp8_modules[0].fp8.recipe != "blockwise"]
    if not fp8:
        return
    amax = {id(u): torch.zeros(len(u.params), dtype=wide_dtype(u.shard.dtype),
                               device=u.shard.device) for u in fp8}
    for u in fp8:
        index = {id(p): i for i, p in enumerate(u.params)}
        for a, b, p in u.segments():
            amax[id(u)][index[id(p)]] = widened(u.shard[a:b].detach().abs().amax())
    for dim in dict.fromkeys(u.dim for u in fp8):
        on_dim = [u for u in fp8 if u.dim == dim]
        flat = torch.cat([amax[id(u)] for u in on_dim])
        comm.all_reduce(flat, mesh, dim, op="max", tag=AMAX_TAG)
        if mesh.size(TP) > 1:  # a tp slice's amax is not the whole weight's
            comm.all_reduce(flat, mesh, TP, op="max", tag=AMAX_TAG)
        for u, part in zip(on_dim, flat.split([len(u.params) for u in on_dim]), strict=True):
            amax[id(u)] = part
    for u in fp8:
        u.fp8_scales = scale_for(amax[id(u)], E4M3)
        shard8 = torch.zeros(u.k, dtype=E4M3, device=u.shard.device)
        index = {id(p): i for i, p in enumerate(u.params)}
        for a, b, p in u.segments():
            shard8[a:b] = to_fp8(u.shard[a:b], u.fp8_scales[index[id(p)]], E4M3)
        u.fp8_shard = shard8.view(torch.uint8)  # gloo and NCCL move bytes


def issue_gather(u: _Unit, mesh: ParallelMesh) -> Handle | None:
    """The unit's float8 all-gather into a new byte buffer (async)."""
    u.fp8_full = torch.empty(u.k * u.n, dtype=torch.uint8, device=u.fp8_shard.device)
    return comm.all_gather(u.fp8_full, u.fp8_shard, mesh, u.dim, async_op=True,
                           tag=f"params:{u.index}")


def hand_to_linears(u: _Unit) -> None:
    """Each linear of the unit reads its float8 weight and scale from the gathered bytes."""
    full = u.fp8_full.view(E4M3)
    for i, (p, off, m) in enumerate(zip(u.params, u.offsets, u.fp8_modules, strict=True)):
        m.fp8.gathered = (full[off:off + p.numel()].view(p.shape), u.fp8_scales[i])


def free(u: _Unit) -> None:
    u.fp8_full = None
    for m in u.fp8_modules:
        m.fp8.gathered = None
