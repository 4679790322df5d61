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
