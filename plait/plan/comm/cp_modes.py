"""Context parallel's all-to-all modes, priced: Ulysses (`a2a`) and the hierarchical mode's
all-to-all inside a node (plait/parallel/context_a2a.py). The ring and all-gather modes
are priced beside tp's and ep's in plait/plan/comm/layer.py.

Per layer and micro-batch a rank's all-to-alls carry its tokens' q and K/V (KV heads
repeated to a multiple of the group, `a2a_kv_heads`) to the ranks of their heads, and the
output back; backward the same two, reversed; a recomputed forward replays the forward's.
Sizes are what a rank puts in (price.py's convention), which the ledger records.
"""

from __future__ import annotations

import numpy as np

from plait.plan.basis import Basis
from plait.plan.comm import price
from plait.plan.compute import Num
from plait.plan.shape import Shape


def a2a_kv_heads(shape: Shape, tp: Num, n: Num) -> Num:
    """A tp rank's KV heads after the repeats that split them over n ranks:
    lcm(KV heads a rank holds, n) (MLA: its per-head K and V, one a query head)."""
    tp = np.asarray(tp, dtype=np.int64)
    kv = (np.full_like(tp, shape.heads) // tp if shape.mla
          else np.maximum(shape.kv_heads // tp, 1))
    return np.lcm(kv, np.asarray(n, dtype=np.int64)).astype(float)


def a2a_sizes(shape: Shape, b: Basis, n: Num, tokens: Num) -> tuple[Num, Num]:
    """(q + K/V in, output back) bytes a rank puts into the two all-to-alls of a layer's
    forward over n ranks holding `tokens` tokens each."""
    heads = shape.heads / b.tp
    kv = a2a_kv_heads(shape, b.tp, n)
    qkv = tokens * (heads * shape.qk_dim + kv * (shape.qk_dim + shape.v_dim)) * b.e
    return qkv, tokens * heads * shape.v_dim * b.e


def a2a_collectives(dim: str, shape: Shape, b: Basis, n: Num, intra: Num, bw: Num, al: Num,
                    visits: Num, replay: int, what: str = "") -> tuple[list, Num]:
    """The two all-to-alls over n ranks of mesh dim `dim` (forward, backward and replays)
    and their seconds per layer and micro-batch, each way (not overlapped: attention waits
    for them)."""
    s_in, s_out = a2a_sizes(shape, b, n, b.tokens)
    t_in, t_out = price.gather_like(s_in, n, bw, al), price.gather_like(s_out, n, bw, al)
    count = (2 + replay) * visits  # forward, backward, the recomputed forward
    colls = [] if not np.any(n > 1) else [
        price.Collective(dim, f"all-to-all{what} (q, K/V)", s_in, count, n, intra, t_in,
                         count * t_in, "none: before attention", "pairwise"),
        price.Collective(dim, f"all-to-all{what} (output)", s_out, count, n, intra, t_out,
                         count * t_out, "none: after attention", "pairwise")]
    return colls, t_in + t_out


def hierarchical_collectives(dims: tuple[str, str, str], shape: Shape, b: Basis,
                             degree: Num, gpus_per_node: int, bw_of, visits: Num, replay: int
                             ) -> tuple[list, Num, Num]:
    """All-to-all inside groups of `degree` consecutive ranks of the sequence's dim
    (dims[0]; its groups dims[1]), ring attention across the groups (dims[2]): after the
    all-to-all a rank holds its group's tokens of its head group, so each ring hop carries
    tokens x degree x (repeated KV heads / degree) x (dk + dv), the group's K/V share.
    `bw_of(intra)`: (bandwidth, latency) of a link. Returns the collectives and the exposed
    (forward, backward) seconds per layer and micro-batch: the all-to-alls whole, the hops
    past the attention compute they hide behind (as the ring's)."""
    stride, n_ring = b.strides[dims[0]], b.sizes[dims[0]] / degree
    in_intra = price.intra_node(stride, degree, gpus_per_node)
    out_intra = price.intra_node(stride * degree, n_ring, gpus_per_node)
    bw, al = bw_of(in_intra)
    colls, t_a2a = a2a_collectives(dims[1], shape, b, degree, in_intra, bw, al, visits,
                                   replay)
    bw, al = bw_of(out_intra)
    s_kv = b.tokens * a2a_kv_heads(shape, b.tp, degree) * (shape.qk_dim + shape.v_dim) * b.e
    t_kv = np.where(n_ring > 1, (n_ring - 1) * price.p2p(s_kv, bw, al), 0.0)
    exp_f = np.maximum(t_kv - b.lt.attn_fwd, 0)
    exp_b = np.maximum(2 * t_kv - 2 * b.lt.attn_fwd, 0)
    if np.any(n_ring > 1):
        n = (3 + replay) * (n_ring - 1) * visits
        colls.append(price.Collective(dims[2], "p2p (ring K/V across groups)", s_kv, n,
                                      n_ring, out_intra, price.p2p(s_kv, bw, al),
                                      (exp_f + exp_b) * visits, "attention core compute"))
    return colls, t_a2a + exp_f, t_a2a + exp_b
