"""The tensor-, context-, expert- and pipeline-parallel collectives plait's runtime issues
in one step on the most loaded rank: the list `plait plan` prints and `plait report`
sets beside the ledger. tests/test_matrix.py checks it equal, byte for byte, to the
ledger of every matrix layout (docs/parity.md).

Counts per micro-batch and layer (s = one micro-batch's activation on a rank, tokens x
hidden x bytes; the ledger's payload is the full message, see plait/ledger.py):

  tp, dense layer     2 all-reduces forward, 2 backward (Megatron's f/g pairs); SP: each
                      an all-gather + reduce-scatter; SP norm gains: 2 all-reduces of
                      their gradients (replicated weights, sequence-split inputs)
  tp, MoE layer       attention's pair only (the MoE block is whole on every tp rank);
                      SP: every MoE weight's gradient all-reduced (its tokens are split)
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
                      (fp32, 4 + 8 bytes a token)
  pp                  a send per stage boundary the rank's stages cross, forward and
                      backward; the full activation (plait does not split it over tp; SP
                      already has); DualPipe also swaps the two copies' gradients

The step-time model (plait/plan/step_comm.py) keeps Megatron's per-layer collective count,
on which its calibration was fitted (Korthikanti et al. 2022: reentrant recompute replays
every forward collective).
"""

from __future__ import annotations

import numpy as np

from plait.parallel.pipeline.registry import schedule_spec
from plait.plan import comm, memory
from plait.plan.basis import Basis, Layout, Training
from plait.plan.compute import Efficiency, Num
from plait.plan.hardware import Cluster
from plait.plan.schedule_facts import facts
from plait.plan.shape import Shape


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
                   b: Basis, ends: tuple[Num, Num] | None = None) -> list[comm.Collective]:
    """The rank's tp collectives in a step. `ends`: the micro-batches per step through the
    embedding and through the head on this rank (plait/plan/rank_comm.py, one pipeline
    rank); None: the most loaded rank's, the head's."""
    if not np.any(b.tp > 1):
        return []
    intra = comm.intra_node(b.strides["tp"], b.tp, cluster.gpus_per_node)
    bw, al = comm.link(cluster.gpu, intra, eff.link_efficiency)
    s = b.tokens * shape.hidden * b.e
    t_ar, _ = comm.all_reduce(s, b.tp, bw, al)
    t_g = comm.gather_like(s, b.tp, bw, al)
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
    out: list[comm.Collective] = []

    def add(op: str, size: Num, count: Num, t_each: Num, what: str) -> None:
        out.append(comm.Collective("tp", op, size, count, b.tp, intra, t_each,
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
            comm.all_reduce(g, b.tp, bw, al)[0], "none: each micro-batch's backward")
        if shape.moe:  # one call per MoE weight; size: all of a layer's on this rank
            g = (shape.dense_mlp_params() + shape.expert_params() / b.ep) * b.e
            add("all-reduce (SP MoE weights' grads)", g, visits,
                comm.all_reduce(g, b.tp, bw, al)[0], "none: each micro-batch's backward")
    else:
        add("all-reduce (embedding out, head grad)", s, head_m + (1 + rerun) * emb_m,
            t_ar, "none: on the critical path")
    for what, nbytes in (("max", 4), ("sums", 8)):
        size = b.tokens * nbytes
        add(f"all-reduce (vocab-parallel loss {what}, fp32)", size, (1 + rerun) * head_m,
            comm.all_reduce(size, b.tp, bw, al)[0], "none: on the critical path")
    return out


def dualpipe_copies(cluster: Cluster, train: Training, eff: Efficiency, b: Basis,
                    rank_params: Num) -> comm.Collective:
    """DualPipe's swap of the two copies' gradients with the mirror rank: every gradient
    the rank holds, in the compute dtype, once a step (a send; the receive is the
    mirror's send)."""
    _, gb, _ = memory.state_bytes(train.precision, train.optimizer)
    intra = comm.intra_node(b.strides["pp"], b.pp, cluster.gpus_per_node)
    bw, al = comm.link(cluster.gpu, intra, eff.link_efficiency)
    size = rank_params * gb
    return comm.Collective("pp", "send (DualPipe copies' gradients)", size, 1.0, 2, intra,
                           comm.p2p(size, bw, al), comm.p2p(size, bw, al),
                           "none: after the last backward")
