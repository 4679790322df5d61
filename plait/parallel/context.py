"""Context parallel: the sequence split over the `cp` ranks, attention exchanging K/V.

Each cp rank holds seq/cp tokens of every sequence, and every layer but attention is
per-token, so only attention talks. Two ways (`parallel.cp_mode`):

* **ring** (default; Liu et al. 2023, "Ring Attention with Blockwise Transformers"): the
  packed K/V chunk of each rank travels around the cp ring, one hop per step, posted
  asynchronously (`plait.comm.ops.batch_send_recv`) before the current chunk is computed,
  so the transfer overlaps the compute. Each (query chunk, key chunk) block gives a partial
  output and its log-sum-exp; partials merge exactly (o = Σ o_i·exp(lse_i − lse)). The
  backward travels the ring again: K/V hop on as in forward and an accumulator of dK/dV
  follows each chunk one hop behind, ending at the chunk's owner. K and V travel as one
  buffer of width dk + dv a head: with multi-head latent attention (plait/model/mla.py)
  that is the per-head K (nope + RoPE features) and V after the up-projection. Per layer
  and micro-batch a rank sends (cp−1) K/V chunks forward and 2(cp−1) backward (K/V, then dK/dV).
* **allgather** (Dubey et al. 2024, Llama 3, section 3.3.2): all-gather K/V over cp before
  attention, reduce-scatter dK/dV in backward: (cp−1)/cp of the gathered K/V each way.
  Cheap with GQA's few K/V heads; no overlap (`all_gather_kv`, plait/comm/autograd.py).
* **a2a** (DeepSpeed-Ulysses, Jacobs et al. 2023): all-to-all from sequence-split to
  head-split q, k, v, whole-sequence attention of heads/cp heads, all-to-all back
  (plait/parallel/context_a2a.py); KV heads repeated where fewer than cp.

Causal masking is exact at chunk granularity: the sequence is cut into equal chunks with
global ids; a key chunk after the query chunk is skipped, the diagonal one is causal, an
earlier one is full. **Load balance** (`parallel.cp_layout`): with a contiguous split rank
r computes r+1 blocks, the last rank cp of them; "zigzag" cuts 2·cp chunks and gives rank
r chunks r and 2cp−1−r, so every rank computes 2cp+1 half-size blocks (Stanford CS336,
lecture 8; the "load-balanced" layout of Llama 3 section 3.3.2). RoPE and the loss follow
the permutation: the rank's token positions (`ContextLayout.positions`) index its inputs
and targets and give RoPE its angles.

Parameters are replicated over cp: each rank's gradient is its tokens' share (dK/dV came
back from the ranks whose queries used its keys), so gradients are summed over dp×cp (the
mesh's product dim "dp_cp", plait/parallel/optimizer.py), and the logged loss over cp.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from plait.comm import ops
from plait.comm.autograd import all_gather_kv
from plait.config import Config
from plait.dims.cp import a2a_degree
from plait.mesh import ParallelMesh
from plait.model.packed import document_mask
from plait.model.precision import wide_dtype, widened
from plait.model.rope import Positions
from plait.model.transformer import CausalAttentionCore
from plait.parallel.attention_blocks import (
    block_backward,
    block_forward,
    fused_available,
    merge_partials,
)
from plait.parallel.context_a2a import (
    INNER,
    OUTER,
    add_hierarchy_groups,
    heads_to_ranks,
    kv_repeats,
    repeat_kv,
    tokens_to_ranks,
    ulysses_attention,
)
from plait.parallel.context_balance import document_split

DIM = "cp"
MODES = ("ring", "allgather", "a2a", "hierarchical")
LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class ContextLayout:
    """Which chunks of a sequence of `seq_len` tokens each of `cp` ranks holds."""

    cp: int
    seq_len: int
    layout: str = "zigzag"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"cp layout {self.layout!r}; use one of {', '.join(LAYOUTS)}")
        if self.seq_len % self.n_chunks:
            raise ValueError(f"seq_len {self.seq_len} does not split into {self.n_chunks} "
                             f"chunks ({self.layout}, cp={self.cp})")

    @property
    def n_chunks(self) -> int:
        return 2 * self.cp if self.layout == "zigzag" else self.cp

    @property
    def chunk_len(self) -> int:
        return self.seq_len // self.n_chunks

    def chunks(self, rank: int) -> tuple[int, ...]:
        """Global chunk ids rank `rank` holds, in the order it holds them."""
        if self.layout == "zigzag":
            return (rank, 2 * self.cp - 1 - rank)
        return (rank,)

    def positions(self, rank: int, device: torch.device | str) -> torch.Tensor:
        """int64 (seq_len/cp,): the positions of rank `rank`'s tokens in the sequence."""
        c = self.chunk_len
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                          for i in self.chunks(rank)])

    def work(self, rank: int) -> float:
        """Causal attention scores rank `rank` needs per (batch, head): a full block is c²,
        a diagonal one c²/2, a future one nothing. Its share of the attention work."""
        mine, c = self.chunks(rank), self.chunk_len
        return sum(c * c * (1.0 if k < q else 0.5) for q in mine for r in range(self.cp)
                   for k in self.chunks(r) if k <= q)


@dataclass
class Ring:
    """This rank's place on the cp ring and the layout: what the autograd function needs.

    `fused`: block maths by torch's CPU flash kernel (None: where it exists, see
    `fused_available`). `work` and `compute_s` measure the balance: the last forward's
    causal scores per (batch, head) (= `ContextLayout.work`), and the thread CPU seconds
    spent in block maths, forward and backward, since the last reset."""

    mesh: ParallelMesh
    layout: ContextLayout
    tag: str = "cp"
    fused: bool | None = None
    work: float = 0.0
    compute_s: float = 0.0
    # the hierarchical mode's ring across node groups: its mesh dim, and the cp ranks
    # whose chunks each ring position holds after the all-to-all inside its group
    dim: str = DIM
    group: int = 1

    @property
    def me(self) -> int:
        return self.mesh.coord(self.dim)

    def peer(self, offset: int) -> int:
        ranks = self.mesh.group_ranks[self.dim]
        return ranks[(self.me + offset) % len(ranks)]

    def chunks(self, pos: int) -> tuple[int, ...]:
        """The chunk ids ring position `pos` holds, in its order."""
        return tuple(c for r in range(pos * self.group, (pos + 1) * self.group)
                     for c in self.layout.chunks(r))

    def use_fused(self, device: torch.device) -> bool:
        return fused_available(device) if self.fused is None else self.fused

    def slot_ids(self, split: torch.Tensor, pos: int, i: int) -> torch.Tensor:
        """(b, c): the sequence indices of ring position pos's chunk slot i under a split by
        documents (`split` (b, cp, s/cp), plait/parallel/context_balance.py)."""
        c, per = self.layout.chunk_len, self.layout.n_chunks // self.layout.cp
        r, half = pos * self.group + i // per, i % per
        return split[:, r, half * c:(half + 1) * c]

    def block_mask(self, docs: torch.Tensor | None, i: int, src: int, j: int,
                   causal: bool, split: torch.Tensor | None = None) -> torch.Tensor | None:
        """Packed documents: (b, c, c) visible pairs of my chunk slot i against src's slot
        j (same document, and the triangle on the diagonal); None without documents. Split
        by documents, from each token's (document, sequence index), not from chunk ids."""
        if docs is None:
            return None
        if split is not None:
            qi, ki = self.slot_ids(split, self.me, i), self.slot_ids(split, src, j)
            return ((docs.gather(1, qi).unsqueeze(-1) == docs.gather(1, ki).unsqueeze(-2))
                    & (ki.unsqueeze(-2) <= qi.unsqueeze(-1)))
        c = self.layout.chunk_len
        qc, kc = self.chunks(self.me)[i], self.chunks(src)[j]
        mask = (docs[:, qc * c:(qc + 1) * c, None] == docs[:, None, kc * c:(kc + 1) * c])
        if causal:
            mask = mask & torch.ones(c, c, dtype=torch.bool, device=mask.device).tril()
        return mask

    def pairs(self, src: int, split: torch.Tensor | None = None
              ) -> list[tuple[int, int, bool]]:
        """(my chunk slot, src's chunk slot, causal) of the blocks to compute against rank
        src's keys; blocks entirely in the future are skipped. Split by documents every
        slot pair is a candidate (the mask decides)."""
        mine, theirs = self.chunks(self.me), self.chunks(src)
        if split is not None:
            return [(i, j, False) for i in range(len(mine)) for j in range(len(theirs))]
        return [(i, j, kq == qq) for i, qq in enumerate(mine) for j, kq in enumerate(theirs)
                if kq <= qq]


def _slot(t: torch.Tensor, i: int, c: int) -> torch.Tensor:
    """Chunk slot i (of length c) along the sequence axis (-2) of (..., L, d)."""
    return t[..., i * c:(i + 1) * c, :]


def _rows(t: torch.Tensor, i: int, c: int) -> torch.Tensor:
    """Chunk slot i of a per-row statistic (..., L)."""
    return t[..., i * c:(i + 1) * c]


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V as one buffer (b, kv, L, dk + dv): one message a hop, any value width."""
    return torch.cat([k, v], -1).contiguous()


def _unpack(kv: torch.Tensor, dk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv[..., :dk], kv[..., dk:]


def _ring_forward(ring: Ring, q: torch.Tensor, kv: torch.Tensor, scale: float,
                  docs: torch.Tensor | None = None, split: torch.Tensor | None = None):
    """Forward around the ring: q (b, h, L, dk) fp32, kv (b, kv, L, dk + dv) packed.
    `docs` (b, seq): packed documents; a block with no pair in one document is skipped.
    `split` (b, cp, s/cp): the tokens split by documents (None: the layout's chunks)."""
    n, c, fused = ring.mesh.size(ring.dim), ring.layout.chunk_len, ring.use_fused(q.device)
    dk = q.shape[-1]
    acc: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    sends, cur, work = [], kv, 0.0
    for t in range(n):
        src = (ring.me - t) % n
        if t < n - 1:  # post the next hop before computing on this chunk: overlap
            nxt = torch.empty_like(cur)
            send, recv = ops.batch_send_recv([(cur, ring.peer(1))], [(nxt, ring.peer(-1))],
                                             ring.mesh, ring.dim, tag=f"{ring.tag}.fwd")
            sends.append(send)
        c0 = time.thread_time()
        k, v = (widened(t) for t in _unpack(cur, dk))
        for i, j, causal in ring.pairs(src, split):
            mask = ring.block_mask(docs, i, src, j, causal, split)
            if mask is not None and not mask.any():
                continue
            part = block_forward(_slot(q, i, c), _slot(k, j, c), _slot(v, j, c), causal,
                                  scale, fused, mask)
            acc[i] = merge_partials(acc.get(i), *part)
            work += (c * c * (0.5 if causal else 1.0) if mask is None
                     else float(mask.sum()) / mask.shape[0])
        ring.compute_s += time.thread_time() - c0
        if t < n - 1:
            recv.wait()
            cur = nxt
    for h in sends:
        h.wait()
    ring.work = work
    slots = sorted(acc)
    return (torch.cat([acc[i][0] for i in slots], -2), torch.cat([acc[i][1] for i in slots], -1))


def _ring_backward(ring: Ring, q, kv, out, lse, dout, scale: float, docs=None, split=None):
    """Backward around the ring: K/V hop on as in forward; each chunk's dK/dV accumulator
    follows one hop behind and reaches the owner after the last step."""
    n, c, fused = ring.mesh.size(ring.dim), ring.layout.chunk_len, ring.use_fused(q.device)
    dk = q.shape[-1]
    dq = torch.zeros_like(q)
    sends, cur, own, acc_in = [], kv, None, None
    for t in range(n):
        src = (ring.me - t) % n
        if t < n - 1:
            nxt = torch.empty_like(cur)
            s, kv_recv = ops.batch_send_recv([(cur, ring.peer(1))], [(nxt, ring.peer(-1))],
                                             ring.mesh, ring.dim, tag=f"{ring.tag}.bwd")
            sends.append(s)
        c0 = time.thread_time()
        k, v = (widened(t) for t in _unpack(cur, dk))
        dkv = torch.zeros(cur.shape, dtype=wide_dtype(cur.dtype), device=cur.device)
        for i, j, causal in ring.pairs(src, split):
            mask = ring.block_mask(docs, i, src, j, causal, split)
            if mask is not None and not mask.any():
                continue
            dqi, dkj, dvj = block_backward(
                _slot(q, i, c), _slot(k, j, c), _slot(v, j, c), _slot(out, i, c),
                _rows(lse, i, c), _slot(dout, i, c), causal, scale, fused, mask)
            _slot(dq, i, c).add_(dqi)
            _slot(dkv, j, c)[..., :dk].add_(dkj)
            _slot(dkv, j, c)[..., dk:].add_(dvj)
        ring.compute_s += time.thread_time() - c0
        if t == 0:
            own = dkv
        else:
            if acc_in is not None:  # the accumulator for this chunk, from the previous rank
                acc_in[1].wait()
                dkv += widened(acc_in[0])
            buf = torch.empty_like(kv)
            s, r = ops.batch_send_recv([(dkv.to(kv.dtype), ring.peer(1))],
                                       [(buf, ring.peer(-1))], ring.mesh, ring.dim,
                                       tag=f"{ring.tag}.bwd")
            sends.append(s)
            acc_in = (buf, r)
        if t < n - 1:
            kv_recv.wait()
            cur = nxt
    if acc_in is not None:  # my own chunk's dK/dV from every other rank
        acc_in[1].wait()
        own += widened(acc_in[0])
    for h in sends:
        h.wait()
    return dq, own


class _RingAttention(Function):
    """softmax(q kᵀ/√d, causal by position) v over the whole sequence, K/V on a ring."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, docs, split=None):
        scale = q.shape[-1] ** -0.5
        kv = _pack(k, v)
        out, lse = _ring_forward(ring, widened(q), kv, scale, docs, split)
        out = out.to(q.dtype)  # kept in the compute dtype, as a flash kernel keeps it
        ctx.save_for_backward(q, kv, out, lse)
        ctx.ring, ctx.scale, ctx.docs, ctx.split = ring, scale, docs, split
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        dq, dkv = _ring_backward(ctx.ring, widened(q), kv, widened(out), lse,
                                 widened(dout).contiguous(), ctx.scale, ctx.docs, ctx.split)
        dk, dv = _unpack(dkv.to(kv.dtype), q.shape[-1])
        return dq.to(q.dtype), dk, dv, None, None, None


class ContextParallelAttention(nn.Module):
    """The attention core under context parallel (swapped in for `CausalAttentionCore`):
    q, k, v are this rank's tokens (after RoPE at their positions), in `layout` order."""

    def __init__(self, mesh: ParallelMesh, layout: ContextLayout, mode: str = "ring",
                 tag: str = "cp", fused: bool | None = None, degree: int = 1,
                 by_documents: bool = False):
        super().__init__()
        # packed documents split by document (`document_split`): each forward's tokens are
        # its micro-batch's split, not the layout's chunks
        self.by_documents = by_documents
        if mode not in MODES:
            raise ValueError(f"cp mode {mode!r}; use one of {', '.join(MODES)}")
        self.mesh, self.layout, self.mode, self.tag = mesh, layout, mode, tag
        self.ring = Ring(mesh, layout, tag, fused)
        if mode == "hierarchical":  # the ring across the all-to-all groups of `degree`
            self.ring = Ring(mesh, layout, tag, fused, dim=OUTER, group=degree)
        me = mesh.coord(DIM)
        self.q_pos = layout.positions(me, mesh.device.torch)
        self.k_pos = torch.cat([layout.positions(r, mesh.device.torch)
                                for r in range(layout.cp)])
        # a2a: the index that puts the gathered (rank-order) sequence in sequence order
        natural = torch.equal(self.k_pos, torch.arange(layout.seq_len, device=self.k_pos.device))
        self.order = None if natural else torch.argsort(self.k_pos)
        self._checked = False  # the positions are checked once: they never change

    def _split(self, q: torch.Tensor, positions: Positions) -> torch.Tensor | None:
        """The micro-batch's split by documents (b, cp, s/cp), or None for the layout's;
        raises when the tokens are not this rank's."""
        docs, me = positions.docs, self.mesh.coord(DIM)
        if self.by_documents and docs is not None:
            split = document_split(docs, self.layout.cp)
            if positions.ids is None or not torch.equal(positions.ids, split[:, me]):
                raise ValueError("context parallel: the attention's tokens are not this "
                                 "rank's share of its micro-batch's documents")
            return split
        if q.shape[-2] != self.q_pos.numel() or not self._checked and (
                positions.ids is None or not torch.equal(positions.ids, self.q_pos)):
            raise ValueError("context parallel: the attention's tokens are not this rank's "
                             f"{self.layout.layout} chunks {self.layout.chunks(self.ring.me)}")
        self._checked = True
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: Positions) -> torch.Tensor:
        split, docs = self._split(q, positions), positions.docs
        if self.mode == "ring":
            return _RingAttention.apply(q, k, v, self.ring, docs, split)
        if self.mode == "hierarchical":
            rep = kv_repeats(q.shape[1], k.shape[1], self.mesh.size(INNER))
            qh, kh, vh = heads_to_ranks([q, repeat_kv(k, rep), repeat_kv(v, rep)], self.mesh,
                                        INNER, f"{self.tag}.qkv")
            out = _RingAttention.apply(qh, kh, vh, self.ring, docs, split)
            return tokens_to_ranks(out, self.mesh, INNER, f"{self.tag}.out")
        if self.mode == "a2a":
            every = torch.arange(self.layout.seq_len, device=q.device)
            mask = None if docs is None else document_mask(docs, docs, every, every)
            return ulysses_attention(q, k, v, self.mesh, DIM, self.tag, mask, self.order)
        # (cp, b, kv, L, dk + dv) -> (b, kv, cp*L, dk + dv), rank order
        full = all_gather_kv(_pack(k, v), self.mesh, self.tag, DIM)
        kf, vf = _unpack(full.permute(1, 2, 0, 3, 4).flatten(2, 3), q.shape[-1])
        mask = self.k_pos.unsqueeze(0) <= self.q_pos.unsqueeze(1)  # key <= query, exact
        if split is not None:  # each row's own split: rank order, as gathered
            qi, ki = split[:, self.mesh.coord(DIM)], split.flatten(1)
            mask = document_mask(docs.gather(1, qi), docs.gather(1, ki), qi, ki)
        elif docs is not None:
            mask = document_mask(docs[:, self.q_pos], docs[:, self.k_pos], self.q_pos,
                                 self.k_pos)
        return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask,
                                              enable_gqa=q.shape[1] != k.shape[1])


def apply_context_parallel(stages: dict[int, nn.Module], mesh: ParallelMesh, mode: str,
                           layout: ContextLayout, degree: int = 1,
                           by_documents: bool = False) -> torch.Tensor:
    """Swap every attention core of this rank's stages for the cp one; mark the stages'
    boundary as split cp ways along the sequence. Returns this rank's token positions (the
    indices of its inputs and targets in each sequence, and RoPE's positions). `degree`:
    the hierarchical mode's all-to-all group (its groups are made here). `by_documents`:
    packed documents split by document, per micro-batch (`splits_documents`)."""
    if mode == "hierarchical":
        add_hierarchy_groups(mesh, DIM, degree)
    for stage in stages.values():
        for name, mod in stage.named_modules():
            core = getattr(mod, "core", None)
            if core is None:
                continue
            if type(core) is not CausalAttentionCore:
                raise ValueError(f"context parallel cannot shard {name}.core "
                                 f"({type(core).__name__}): it knows causal attention only")
            mod.core = ContextParallelAttention(mesh, layout, mode, f"cp.{name}",
                                                degree=degree, by_documents=by_documents)
        stage.seq_shards *= layout.cp
    return layout.positions(mesh.coord(DIM), mesh.device.torch)


def context_parallel_stages(stages: dict[int, nn.Module], mesh: ParallelMesh, cfg: Config
                            ) -> torch.Tensor | None:
    """With cp > 1, `apply_context_parallel` on this rank's stages in the configured mode
    and layout; this rank's token positions, or None when the sequence is whole."""
    p = cfg.parallel
    if p.cp == 1:
        return None
    return apply_context_parallel(stages, mesh, p.cp_mode,
                                  ContextLayout(p.cp, cfg.train.seq_len, p.cp_layout),
                                  a2a_degree(p), splits_documents(cfg))


def splits_documents(cfg: Config) -> bool:
    """Whether training splits each micro-batch by its documents: packed documents under
    cp > 1 in the zigzag layout, in the modes whose work follows the split (ring,
    all-gather, hierarchical's ring). a2a attends the whole sequence for heads/cp heads on
    every rank, balanced by heads whatever the split, and keeps the zigzag one."""
    p = cfg.parallel
    return (cfg.train.documents and p.cp > 1 and p.cp_layout == "zigzag"
            and p.cp_mode != "a2a")


def documents_positions(cfg: Config, mesh: ParallelMesh
                        ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Where each micro-batch is split by its documents (`splits_documents`): the function
    from its document ids (b, s) to this rank's positions (b, s/cp); None otherwise."""
    if not splits_documents(cfg):
        return None
    cp, me = cfg.parallel.cp, mesh.coord(DIM)
    return lambda docs: document_split(docs, cp)[:, me]
