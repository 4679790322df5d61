"""Context parallel by all-to-all ("a2a", DeepSpeed-Ulysses: Jacobs et al. 2023, "DeepSpeed
Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence Transformer
Models", section 3).

Each of the n ranks of the group holds seq/n tokens of every head. One all-to-all turns
that into all seq tokens of heads/n heads: rank j receives head group j of every rank's
tokens. Each rank then runs ordinary attention over the whole sequence for its heads,
and a second all-to-all sends each rank's tokens of the output back. Backward is the
same two all-to-alls reversed (the autograd all-to-all, `<tag>.grad` in the ledger).

q, k and v travel as one buffer (one message per peer, any head widths: MLA's values
are narrower than its keys). With GQA the KV heads must split n ways too: when a rank has
fewer KV heads than n (or a count n does not divide), each KV head is repeated
`kv_repeats` times first (Megatron-Core and DeepSpeed do the same), so the group can be
as large as the query heads; the repeats' gradients sum back by autograd.

Per layer and micro-batch a rank sends (n-1)/n of its q, K/V (after repeats) and output
forward, the same backward: the ledger's bytes, the planner's (plait/plan/comm/layer.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from plait.comm.autograd import all_to_all_tokens
from plait.mesh import ParallelMesh


def kv_repeats(heads: int, kv_heads: int, n: int) -> int:
    """Times each of a rank's `kv_heads` KV heads is repeated so that n ranks split them
    with the `heads` query heads: lcm(kv_heads, n) / kv_heads (kv_heads and n divide the
    heads, so their lcm does). Raises when the query heads do not split n ways."""
    if heads % n or heads % kv_heads:
        raise ValueError(f"the all-to-all over {n} ranks splits {heads} query heads "
                         f"({kv_heads} KV heads); use a group size that divides the heads "
                         "per tp rank, or the ring")
    return math.lcm(kv_heads, n) // kv_heads


def repeat_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    """Each KV head `rep` times in place (b, kv, ...) -> (b, kv*rep, ...): query head i
    keeps KV head i // (heads / kv) once the heads are split (not tiled: the copies of a
    head must stay beside each other)."""
    return t if rep == 1 else t.repeat_interleave(rep, 1)


def _pack(parts: list[torch.Tensor], n: int) -> tuple[torch.Tensor, list[torch.Size]]:
    """Tensors (b, heads, L, d) -> one (n, rest) buffer, row j the head group j of each;
    and the per-group shapes to unpack with."""
    rows, shapes = [], []
    for t in parts:
        g = t.unflatten(1, (n, -1)).movedim(1, 0)  # (n, b, heads/n, L, d)
        shapes.append(g.shape[1:])
        rows.append(g.reshape(n, -1))
    return torch.cat(rows, 1), shapes


def _unpack(buf: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """(n, rest) from `_pack`'s all-to-all -> each tensor (b, heads/n, n*L, d): rank j's
    tokens are the j-th block of L along the sequence."""
    out, at = [], 0
    for shape in shapes:
        size = math.prod(shape)
        t = buf[:, at:at + size].reshape(-1, *shape)  # (n, b, h/n, L, d)
        out.append(t.movedim(0, 2).flatten(2, 3))  # (b, h/n, n, L, d) -> (b, h/n, nL, d)
        at += size
    return out


def heads_to_ranks(parts: list[torch.Tensor], mesh: ParallelMesh, dim: str, tag: str
                   ) -> list[torch.Tensor]:
    """Sequence-split (b, h, L, d) tensors -> head-split (b, h/n, n*L, d), one all-to-all."""
    n = mesh.size(dim)
    buf, shapes = _pack(parts, n)
    got = all_to_all_tokens(buf, mesh, [1] * n, [1] * n, tag, dim)
    return _unpack(got, shapes)


def tokens_to_ranks(out: torch.Tensor, mesh: ParallelMesh, dim: str, tag: str
                    ) -> torch.Tensor:
    """Head-split (b, h/n, n*L, d) -> sequence-split (b, h, L, d), one all-to-all: block j
    of the sequence goes back to rank j, which stacks the head groups in rank order."""
    n = mesh.size(dim)
    blocks = out.unflatten(2, (n, -1)).movedim(2, 0)  # (n, b, h/n, L, d)
    shape = blocks.shape[1:]
    got = all_to_all_tokens(blocks.reshape(n, -1), mesh, [1] * n, [1] * n, tag, dim)
    return got.reshape(n, *shape).movedim(0, 1).flatten(1, 2)  # (b, n*h/n, L, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: ParallelMesh,
                      dim: str, tag: str, mask: torch.Tensor | None,
                      order: torch.Tensor | None) -> torch.Tensor:
    """Attention of this rank's tokens q (b, h, L, dk), k (b, kv, L, dk), v (b, kv, L, dv)
    over the whole sequence of the `dim` group, by two all-to-alls. The gathered sequence
    is the ranks' tokens in rank order; `order`: the index that puts it in sequence order
    (None: it already is), so causal attention is the plain triangle; `mask` (bool, key
    visible to query, in sequence order; None: causal) for packed documents."""
    n = mesh.size(dim)
    rep = kv_repeats(q.shape[1], k.shape[1], n)
    k, v = repeat_kv(k, rep), repeat_kv(v, rep)
    qf, kf, vf = heads_to_ranks([q, k, v], mesh, dim, f"{tag}.qkv")
    if order is not None:
        qf, kf, vf = (t.index_select(2, order) for t in (qf, kf, vf))
    gqa = qf.shape[1] != kf.shape[1]
    if mask is None:
        out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, enable_gqa=gqa)
    if order is not None:  # back to the gathered (rank) order
        out = out.index_select(2, torch.argsort(order))
    return tokens_to_ranks(out, mesh, dim, f"{tag}.out")


# ---- the hierarchical mode's groups: all-to-all inside, ring across ----------------------

INNER, OUTER = "cp_a2a", "cp_ring"


def add_hierarchy_groups(mesh: ParallelMesh, dim: str, degree: int) -> None:
    """Cut every `dim` group of the mesh into runs of `degree` consecutive ranks (INNER:
    the all-to-all, inside a node when the group's ranks are) and the ranks at one place
    of each run (OUTER: the ring across runs); this rank's are added to the mesh under
    those names. Collective over the world: every rank makes every group, in order."""
    import torch.distributed as dist

    def cut(ranks: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        runs = [ranks[i:i + degree] for i in range(0, len(ranks), degree)]
        return runs, [list(col) for col in zip(*runs, strict=True)]

    whole = sorted({tuple(mesh.ranks_along(dim, r)) for r in range(mesh.world_size)})
    for name, pick in ((INNER, 0), (OUTER, 1)):
        for ranks in (g for w in whole for g in cut(list(w))[pick]):
            group = dist.new_group(ranks) if len(ranks) > 1 and mesh.world_size > 1 else None
            if mesh.rank in ranks:
                mesh.group_ranks[name], mesh.groups[name] = ranks, group
