"""ZeRO-3's float8 weights under the blockwise recipe (`train.fp8_recipe = "blockwise"`):
each weight cast in B x B blocks, each block with its own scale (plait/model/fp8_blockwise.py).

A ZeRO shard is a flat slice of the unit's weights, so it may hold part of a block. After
each update every rank takes the amax of each block over the elements its shard holds,
and one all-reduce (max) of those amaxes over the unit's shard dim gives every rank every
block's amax, hence its scale, as one process computes it from the whole block; each rank
casts its shard with those scales and the all-gather moves the float8 payload, one byte
an element (plait/parallel/zero_fp8.py). The scales so cost their amaxes' bytes once a
step (4 a block; 8 around float64), a data collective (`SCALES_TAG`) that the planner
counts beside the payload (plait/plan/fp8.py). No reduction over tp: the config checks
make each tp rank's share of a weight whole blocks (plait/config/fp8_checks.py).
"""

from __future__ import annotations

import torch

from plait import comm
from plait.mesh import ParallelMesh
from plait.model.fp8 import E4M3, scale_for, to_fp8
from plait.model.precision import wide_dtype, widened
from plait.parallel.zero_units import _Unit

SCALES_TAG = "fp8.scales"  # data: a block's amax, 4 bytes (8 in float64) a block


def block_count(shape: torch.Size | tuple[int, ...], block: int) -> int:
    """Blocks of a (rows, cols) weight: partial ones at its ends included."""
    rows, cols = shape
    return -(-rows // block) * -(-cols // block)


def _block_ids(shape: torch.Size, block: int, start: int, stop: int,
               device: torch.device) -> torch.Tensor:
    """The block of each flat element start..stop-1 of a row-major (rows, cols) weight."""
    cols = shape[1]
    flat = torch.arange(start, stop, device=device)
    return (flat // cols // block) * -(-cols // block) + flat % cols // block


def _pieces(u: _Unit, block: int) -> list[tuple[int, int, int, torch.Tensor]]:
    """(shard start, shard end, parameter index, block ids) of each weight in the shard."""
    index = {id(p): i for i, p in enumerate(u.params)}
    out = []
    for a, b, p in u.segments():
        i = index[id(p)]
        start = u.lo + a - u.offsets[i]
        out.append((a, b, i, _block_ids(p.shape, block, start, start + b - a,
                                        u.shard.device)))
    return out


def cast_block_shards(units: list[_Unit], mesh: ParallelMesh, block: int) -> None:
    """Each float8 unit's shard cast to E4M3 in its weights' B x B blocks (the module
    docstring); `u.fp8_scales` become each weight's inverse block scales. Collective over
    the units' shard dims."""
    counts = {id(u): [block_count(p.shape, block) for p in u.params] for u in units}
    amax = {id(u): [torch.zeros(n, dtype=wide_dtype(u.shard.dtype), device=u.shard.device)
                    for n in counts[id(u)]] for u in units}
    pieces = {id(u): _pieces(u, block) for u in units}
    for u in units:
        for a, b, i, ids in pieces[id(u)]:
            amax[id(u)][i].scatter_reduce_(0, ids, widened(u.shard[a:b].detach().abs()),
                                           "amax")
    for dim in dict.fromkeys(u.dim for u in units):
        on_dim = [u for u in units if u.dim == dim]
        flat = torch.cat([t for u in on_dim for t in amax[id(u)]])
        comm.all_reduce(flat, mesh, dim, op="max", tag=SCALES_TAG)
        parts = iter(flat.split([n for u in on_dim for n in counts[id(u)]]))
        for u in on_dim:
            amax[id(u)] = [next(parts) for _ in u.params]
    for u in units:
        scales = [scale_for(a, E4M3) for a in amax[id(u)]]
        shard8 = torch.zeros(u.k, dtype=E4M3, device=u.shard.device)
        for a, b, i, ids in pieces[id(u)]:
            shard8[a:b] = to_fp8(u.shard[a:b], scales[i][ids], E4M3)
        u.fp8_shard = shard8.view(torch.uint8)  # gloo and NCCL move bytes
        u.fp8_scales = [(1 / s).view(-(-p.shape[0] // block), -1)
                        for s, p in zip(scales, u.params, strict=True)]
