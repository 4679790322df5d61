"""The collectives inside a layer: tensor parallel's, context parallel's K/V exchange and
expert parallel's all-to-all, each with the part not hidden behind compute (`layer_comm`;
`evaluate`, plait/plan/estimate.py, builds the layer and chunk times from it).

tp's collectives are counted twice over. The step time keeps Megatron's per-layer count
(`TP_COLLECTIVES_FWD` forward, as many backward, replayed under recompute), on which its
calibration was fitted (Korthikanti et al. 2022: reentrant recompute replays every forward
collective). The list `plait plan` prints and `plait report` sets beside the ledger is the
runtime's own (`tp_collectives`); tests/test_matrix.py checks it equal, byte for byte, to
the ledger of every matrix layout (docs/parity.md), and a measured profile prices it
instead of Megatron's count.

Counts per micro-batch and layer (s = one micro-batch's activation on a rank, tokens x
hidden x bytes; the ledger's payload is the full message, see plait/ledger.py):

  tp, dense layer     2 all-reduces forward, 2 backward (Megatron's f/g pairs); SP: each
                      an all-gather + reduce-scatter; SP norm gains: 2 all-reduces of
                      their gradients (replicated weights, sequence-split inputs)
  tp, MoE layer       attention's pair only (the MoE block is whole on every tp rank);
                      SP: every MoE weight's gradient all-reduced (its tokens are split)
  tp, MLA             its down-projections and latent norms are whole on every rank and
                      each rank's heads give a part of their gradient: one all-reduce
                      each, per micro-batch
  full recompute      replays the block's forward up to the last tensor backward needs
                      (torch.utils.checkpoint stops early): every forward collective but
                      a dense block's last one (the MLP's all-reduce / reduce-scatter);
                      an I/W-split schedule reruns the stage's whole forward in I: every
                      forward collective, the head's and the loss's included
  selective           replays what full does (its policy saves matmul outputs only: every
                      collective is recomputed, up to the same early stop); cp's K/V
                      exchange and ep's dispatch + combine are replayed whole under both
  embedding / head    vocab-parallel: the embedding's all-reduce forward (SP: reduce-
                      scatter forward, all-gather backward), the head input's all-reduce
                      backward (SP: all-gather forward, reduce-scatter backward, the final
                      norm's gradient all-reduce); the vocab-parallel loss's max and sums
                      (fp32, 4 + 8 bytes a token; float64 in an fp64 run)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from plait.plan.basis import Basis, Layout
from plait.plan.comm import price
from plait.plan.comm.async_tp import async_tp_exposed
from plait.plan.comm.cp_modes import a2a_collectives, hierarchical_collectives
from plait.plan.compute import Efficiency, Num
from plait.plan.hardware import Cluster
from plait.plan.schedule_facts import facts
from plait.plan.shape import Shape
from plait.schedule.ir import paired_share
from plait.schedule.registry import build_schedule, schedule_spec

TP_COLLECTIVES_FWD = 2  # per layer in the forward: attention's and the MLP's (Megatron)


@dataclass
class LayerComm:
    """The collectives inside a layer (tp, cp, ep) and their exposed time per layer."""

    colls: list[price.Collective]
    t_ar: Num  # one tp all-reduce (or all-gather + reduce-scatter pair)
    tp_count: Num  # tp collectives per step on one rank
    # exposed seconds per layer, forward and backward, of the split sequence's K/V
    # exchange (cp) and of the routed experts' all-to-alls (ep)
    seq_exp_f: Num
    seq_exp_b: Num
    expert_exp_f: Num
    expert_exp_b: Num

    def exchange_exposed(self) -> Num:
        """Both exchanges' exposed seconds per layer and micro-batch (`EXCHANGE_TERM`)."""
        return self.seq_exp_f + self.seq_exp_b + self.expert_exp_f + self.expert_exp_b


def layer_comm(shape: Shape, cluster: Cluster, lay: Layout, eff: Efficiency,
               b: Basis, ends: tuple[Num, Num] | None = None) -> LayerComm:
    """`ends`: tp_collectives' (one pipeline rank's embedding and head micro-batches)."""
    colls: list[price.Collective] = []
    gpu, gpn = cluster.gpu, cluster.gpus_per_node
    tp_intra = price.intra_node(b.strides["tp"], b.tp, gpn)
    bw, al = price.link(gpu, tp_intra, eff.link_efficiency)
    s_tp = b.tokens * shape.hidden * b.e
    t_ar, _ = price.all_reduce(s_tp, b.tp, bw, al)
    # a recomputed forward replays the forward's 2 (Megatron's count; plait's full and its
    # selective both re-issue them, math's selective only redoes the attention core)
    n_tp_bwd = 2 + (0 if lay.runtime_mode() == "none" else 2)
    tp_count = (TP_COLLECTIVES_FWD + n_tp_bwd) * b.rank_layers * b.m
    # the collectives listed are the runtime's (`tp_collectives` below); the time above
    # keeps Megatron's count, on which the step-time model was calibrated
    tp_list = tp_collectives(shape, cluster, lay, eff, b, ends)
    colls.extend(tp_list)
    if eff.runtime_comm and tp_list:  # a measured profile: the runtime's list, its time
        total = sum(c.count * c.time_each for c in tp_list)  # spread over Megatron's slots
        t_ar = np.where(tp_count > 0, total / np.maximum(tp_count, 1e-30), t_ar)
    if lay.async_tp and lay.sp:  # what of each pair the rings' matmuls leave exposed
        t_ar = async_tp_exposed(t_ar, b.lt.gemm_fwd, b.tp, eff.comm_overlap)
    # the recomputed forward's exchanges (plait's full and selective both redo attention
    # and the all-to-alls)
    replay = 0 if lay.runtime_mode() == "none" else 1
    if lay.cp_mode == "hierarchical":  # plait/plan/comm/cp_modes.py
        more, cp_exp_f, cp_exp_b = hierarchical_collectives(
            ("cp", "cp_a2a", "cp_ring"), shape, b, lay.cp_a2a, cluster.gpus_per_node,
            lambda intra: price.link(cluster.gpu, intra, eff.link_efficiency),
            layer_visits(b), replay)
        colls.extend(more)
    else:
        cp_exp_f, cp_exp_b = _cp_exposure(shape, cluster, eff, b, colls, lay.cp_mode, replay)
    ep_exp_f, ep_exp_b = _ep_exposure(shape, cluster, eff, b, colls, replay, lay.overlap_fb)
    return LayerComm(colls, t_ar, tp_count, cp_exp_f, cp_exp_b, ep_exp_f, ep_exp_b)


def _cp_exposure(shape: Shape, cluster: Cluster, eff: Efficiency, b: Basis,
                 colls: list[price.Collective], mode: str = "ring", replay: int = 0
                 ) -> tuple[Num, Num]:
    """Exposed (forward, backward) K/V time per layer; appends cp's collective. Ring: the
    local K/V chunk hops cp-1 times forward, K/V and dK/dV 2(cp-1) times backward, each
    hop hidden behind a block's compute; all-gather: K/V gathered forward, dK/dV
    reduce-scattered backward, not overlapped (plait/parallel/context.py)."""
    cp_intra = price.intra_node(b.strides["cp"], b.cp, cluster.gpus_per_node)
    bw, al = price.link(cluster.gpu, cp_intra, eff.link_efficiency)
    s_kv = b.tokens * shape.kv_exchange_dim * b.e / b.tp  # MLA: per-head K, V
    if mode == "a2a":  # Ulysses (plait/plan/comm/cp_modes.py)
        a2a, t_each = a2a_collectives("cp", shape, b, b.cp, cp_intra, bw, al, layer_visits(b),
                                      replay)
        colls.extend(a2a)
        return t_each, t_each
    if mode == "allgather":
        t_ag = price.gather_like(b.cp * s_kv, b.cp, bw, al)
        if np.any(b.cp > 1):
            n = layer_visits(b)
            colls.append(price.Collective("cp", "all-gather (K/V)", b.cp * s_kv,
                                         (1 + replay) * n, b.cp, cp_intra, t_ag,
                                         (1 + replay) * n * t_ag, "none: before attention"))
            colls.append(price.Collective("cp", "reduce-scatter (dK/dV)", b.cp * s_kv, n,
                                         b.cp, cp_intra, t_ag, n * t_ag,
                                         "none: after attention's backward"))
        return t_ag, t_ag
    t_kv = np.where(b.cp > 1, (b.cp - 1) * price.p2p(s_kv, bw, al), 0.0)
    cp_exp_f = np.maximum(t_kv - b.lt.attn_fwd, 0)
    cp_exp_b = np.maximum(2 * t_kv - 2 * b.lt.attn_fwd, 0)
    if np.any(b.cp > 1):
        n = (3 + replay) * (b.cp - 1) * layer_visits(b)
        colls.append(price.Collective("cp", "p2p (ring K/V)", s_kv, n, b.cp, cp_intra,
                                     price.p2p(s_kv, bw, al), (cp_exp_f + cp_exp_b)
                                     * layer_visits(b), "attention core compute"))
    return cp_exp_f, cp_exp_b


def _ep_exposure(shape: Shape, cluster: Cluster, eff: Efficiency, b: Basis,
                 colls: list[price.Collective], replay: int = 0, overlap_fb: bool = False
                 ) -> tuple[Num, Num]:
    """Exposed (forward, backward) expert all-to-all time per layer (0 for a dense
    model); appends ep's collective. Hidden behind the paired chunk only where the
    runtime overlaps DualPipe's F&B pairs (`overlap_fb`); otherwise all exposed."""
    if not shape.moe:
        return 0.0, 0.0
    tp, cp, pp, ep = b.tp, b.cp, b.pp, b.ep
    span = np.where(ep <= cp, tp * ep, tp * cp * pp * ep / cp)
    ep_intra = span <= cluster.gpus_per_node
    bw, al = price.link(cluster.gpu, ep_intra, eff.link_efficiency)
    s_a2a = b.tokens * shape.top_k * shape.hidden * b.e / b.moe_split
    t_a2a = price.gather_like(s_a2a, ep, bw, al)
    if overlap_fb and facts(b.sched).pairs_forward_with_backward and np.all(pp > 1):
        # hidden by the paired chunk, in the chunks the runtime pairs (the rest exposed)
        share = paired_share_of(b)
        ep_exp_f = share * np.maximum(2 * t_a2a - b.lt.forward, 0) + (1 - share) * 2 * t_a2a
        ep_exp_b = share * np.maximum(2 * t_a2a - 2 * b.lt.forward, 0) + (
            1 - share) * 2 * t_a2a
        how = "the other micro-batch's compute (DualPipe)"
    else:
        ep_exp_f, ep_exp_b = 2 * t_a2a, 2 * t_a2a
        how = "none: on the critical path"
    if np.any(ep > 1):
        n = (4 + 2 * replay) * layer_visits(b)  # dispatch + combine, both ways
        colls.append(price.Collective("ep", "all-to-all", s_a2a, n, ep, ep_intra, t_a2a,
                                     (ep_exp_f + ep_exp_b) * layer_visits(b), how))
    return ep_exp_f, ep_exp_b


@lru_cache(maxsize=1024)
def _paired_share(sched: str, pp: int, m: int, v: int) -> float:
    try:
        return paired_share(build_schedule(sched, pp, m, v))
    except ValueError:  # no such schedule at (pp, m): nothing paired
        return 0.0


def paired_share_of(b: Basis) -> Num:
    """Per layout, the least share of a rank's chunks that its schedule, as the runtime
    builds it, runs as F&B pairs (`ir.paired_share`)."""
    return np.vectorize(lambda pp, m, v: _paired_share(b.sched, int(pp), int(m), int(v)),
                        otypes=[float])(b.pp, b.m, b.v)


def chains(sched: str) -> int:
    """Pipeline chains: DualPipe runs each micro-batch through one of its two."""
    return schedule_spec(sched).chains


def layer_visits(b: Basis) -> Num:
    """Layer passes of one step on a rank: each micro-batch through each layer it holds
    (DualPipe: through one chain's half of them)."""
    return b.rank_layers * b.m / chains(b.sched)


def _per_layer(moe: bool, sp: bool, recomputed: bool, split: bool) -> dict[str, int]:
    """tp collectives of one layer and micro-batch by op (module docstring). `split`: an
    I/W-split schedule, whose I step reruns the stage's whole forward (no early stop)."""
    pairs = 1 if moe else 2  # attention's (and a dense MLP's) forward pair
    if not recomputed:
        replay_first = replay_second = 0
    elif split:
        replay_first = replay_second = pairs
    else:  # early stop: a dense block's last collective (the MLP's second) is not redone
        replay_first, replay_second = pairs, pairs - (0 if moe else 1)
    if not sp:
        return {"all-reduce": 2 * pairs + replay_second}
    return {"all-gather": 2 * pairs + replay_first, "reduce-scatter": 2 * pairs + replay_second}


def tp_collectives(shape: Shape, cluster: Cluster, lay: Layout, eff: Efficiency,
                   b: Basis, ends: tuple[Num, Num] | None = None) -> list[price.Collective]:
    """The rank's tp collectives in a step. `ends`: the micro-batches per step through the
    embedding and through the head on this rank (plait/plan/comm/rank.py, one pipeline
    rank); None: the most loaded rank's, the head's."""
    if not np.any(b.tp > 1):
        return []
    intra = price.intra_node(b.strides["tp"], b.tp, cluster.gpus_per_node)
    bw, al = price.link(cluster.gpu, intra, eff.link_efficiency)
    s = b.tokens * shape.hidden * b.e
    t_ar, _ = price.all_reduce(s, b.tp, bw, al)
    t_g = price.gather_like(s, b.tp, bw, al)
    m, visits, sp = b.m / chains(b.sched), layer_visits(b), lay.sp
    spec = schedule_spec(b.sched)
    # plait's selective recomputes the tp collectives too (non-matmul ops: the policy saves
    # matmul outputs only), up to the same early stop: measured equal to full's replays
    recomputed = lay.runtime_mode() != "none"
    per = _per_layer(shape.moe, sp, recomputed, spec.split_backward)
    # an I/W-split schedule's recomputed forward also reruns the head's and the loss's
    rerun = 1.0 if recomputed and spec.split_backward else 0.0
    # the head (and the loss) sit on the last rank, or on rank 0 with the embedding (V
    # shapes), or everything on the one rank without a pipeline: the most loaded rank
    embed = np.where((b.pp == 1) | facts(b.sched).head_on_first_rank, 1.0, 0.0)
    emb_m, head_m = (embed * m, m) if ends is None else ends
    out: list[price.Collective] = []

    def add(op: str, size: Num, count: Num, t_each: Num, what: str) -> None:
        out.append(price.Collective("tp", op, size, count, b.tp, intra, t_each,
                                   count * t_each, what))

    for op, k in per.items():
        add(f"{op} (layers)", s, k * visits, t_ar if op == "all-reduce" else t_g,
            "none: on the critical path")
    # forward collectives are rerun: the head input's gather (SP) and the embedding's out
    if sp:
        add("all-gather (head input, embedding grad)", s, (1 + rerun) * head_m + emb_m, t_g,
            "none: on the critical path")
        add("reduce-scatter (embedding out, head grad)", s, head_m + (1 + rerun) * emb_m,
            t_g, "none: on the critical path")
        g = shape.hidden * b.e  # two norms a layer, the final one on the head rank
        add("all-reduce (SP norm gains' grads)", g, 2 * visits + head_m,
            price.all_reduce(g, b.tp, bw, al)[0], "none: each micro-batch's backward")
        if shape.moe:  # one call per MoE weight; size: all of a layer's on this rank
            g = (shape.dense_mlp_params() + shape.expert_params() / b.expert_split) * b.e
            add("all-reduce (SP MoE weights' grads)", g, visits,
                price.all_reduce(g, b.tp, bw, al)[0], "none: each micro-batch's backward")
    else:
        add("all-reduce (embedding out, head grad)", s, head_m + (1 + rerun) * emb_m,
            t_ar, "none: on the critical path")
    if shape.mla:  # one call per down-projection and latent norm; size: a layer's
        g = shape.mla_replicated_params() * b.e
        add("all-reduce (MLA down-projections' grads)", g, visits,
            price.all_reduce(g, b.tp, bw, al)[0], "none: each micro-batch's backward")
    wide = max(4, b.e)  # the loss's fp32 (float64 in an fp64 run) max and two sums
    for what, nbytes in (("max", wide), ("sums", 2 * wide)):
        size = b.tokens * nbytes
        add(f"all-reduce (vocab-parallel loss {what}, fp{8 * wide})", size, (1 + rerun) * head_m,
            price.all_reduce(size, b.tp, bw, al)[0], "none: on the critical path")
    return out
