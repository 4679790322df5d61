"""Evaluate a layout: memory per rank, collectives per dimension, compute, pipeline, step.

`evaluate` is written over numpy arrays so the search (plait/plan/search.py) scores
thousands of layouts in one call with the same formulas `plait plan --layout` prints for
one: one cost model. With `simulate=True` (one layout) the pipeline time and the peak
in-flight activations come from the shared simulator; otherwise from closed forms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plait.plan import bubble, fp8, host_share, memory, memory_bound, overlap_slowdown, zero3_gpu
from plait.plan.basis import Basis, ChunkTimes, Layout, Training, basis_of
from plait.plan.comm import EXCHANGE_TERM, price
from plait.plan.comm.layer import TP_COLLECTIVES_FWD, LayerComm, layer_comm
from plait.plan.comm.step import block_scales_sync, dp_exposed_time, dualpipe_copies, pp_p2p
from plait.plan.comm.sync import SYNC_TERM, sync_seconds
from plait.plan.comm.zero import end_gathered, gathered_bytes, zero3_bytes
from plait.plan.compute import (
    Efficiency,
    gemm_time,
    hardware_flops_per_token,
    head_flops,
    model_flops_per_token,
    recompute_seconds,
    tp_floor_seconds,
)
from plait.plan.hardware import Cluster
from plait.plan.schedule_facts import facts
from plait.plan.shape import Shape
from plait.plan.stack import pp_overlapped
from plait.schedule.registry import schedule_spec
from plait.throughput import tokens_per_second, tokens_per_step

Num = Any
# the step-time term of the memory-bound kernels (norms, activations, residual adds, the
# loss) where plait/plan/memory_bound.py prices them
MEMORY_BOUND_TERM = "memory-bound kernels"


@dataclass
class Estimate:
    layout: Layout
    microbatches: Num
    memory: dict[str, Num]  # bytes on the most loaded rank, by category
    memory_total: Num
    peak_rank: Num  # "first" or "last" pipeline rank
    fits: Num
    collectives: list[price.Collective]
    time: dict[str, Num]  # step-time breakdown, seconds
    step_time: Num
    tokens_per_s: Num
    model_tflops: Num  # per GPU, model FLOPs (6N + attention)
    hardware_tflops: Num  # per GPU, FLOPs executed (with recompute)
    mfu: Num
    bubble_fraction: Num
    extra: dict[str, Any] = field(default_factory=dict)


def chunk_times(shape: Shape, cluster: Cluster, lay: Layout, eff: Efficiency, b: Basis,
                lc: LayerComm) -> ChunkTimes:
    """One layer's F, I, W with its exposed collectives, the head's, and one chunk's."""
    lt, gpu = b.lt, cluster.gpu
    f_layer = lt.forward + TP_COLLECTIVES_FWD * lc.t_ar + lc.seq_exp_f + lc.expert_exp_f
    i_layer = lt.gemm_fwd + 2 * lt.attn_fwd + lt.backward_elementwise + 2 * lc.t_ar \
        + lc.seq_exp_b + lc.expert_exp_b
    w_layer = lt.gemm_fwd
    policy = eff.policy_layer_seconds if lay.runtime_mode() == "selective" else 0.0
    tp_cpu, tp_out = tp_floor_seconds(eff, b.tp, lay.runtime_mode(), host_share.applies(cluster))
    i_layer = i_layer + recompute_seconds(lay, lt, f_layer) + policy + 2 * tp_cpu / 3
    f_layer = f_layer + tp_cpu / 3
    hf = head_flops(shape, b.tokens, b.tp)
    head_g = gemm_time(hf, gpu, eff, b.gemm_scale)
    if memory_bound.priced(eff):  # the final norm and the loss, both passes, kernel by kernel
        head_mb = memory_bound.loss_seconds(shape, b.tokens, b.tp, lay.sp, b.e, gpu, eff,
                                            b.fused_kernels)
    else:  # writing the logits and their fp32 copy
        head_mb = memory.logits_bytes(shape, b.mbs, b.tp, b.seq_split, b.e) / gpu.hbm_bw
    head_f = head_g + head_mb \
        + eff.op_seconds * eff.outside_ops + tp_out  # embedding, norm, head, loss: ops
    n = b.chunk_layers
    return ChunkTimes(f_layer, i_layer, w_layer, hf, head_g, head_f, n * f_layer,
                      n * i_layer, n * w_layer, policy, tp_cpu,
                      head_mb if memory_bound.priced(eff) else 0.0)


def _pipeline_time(shape: Shape, b: Basis, ct: ChunkTimes, t_pp: Num, simulate: bool,
                   optimizer_sync: str = "barrier", post: float = 0.0, gap: float = 0.0
                   ) -> tuple[Num, Num, dict[str, Any]]:
    """(pipeline time, bubble fraction, the simulator's result or {}); `post`: a rank's
    time per batch of transfers posted (a measured profile's p2p_post); `gap`: its own
    runtime work before each compute action (a measured profile's pipeline_gap)."""
    if simulate:
        res = bubble.simulate_layers(shape.layers, b.sched, int(b.pp), int(b.m), int(b.v),
                                     float(ct.f_layer), float(ct.i_layer), float(ct.w_layer),
                                     float(ct.head_f), float(ct.head_g), float(t_pp),
                                     optimizer_sync, post, gap)
        return res["step"], res["bubble"], res
    # ranking: the last rank's chunks carry the LM head (spread over its chunks); a post
    # of transfers and the runtime's gap before each chunk's F and B, the gap before a
    # split schedule's W too (rank time, idle: not in busy_of)
    cpr, po, ga = b.cpr, np.where(b.pp > 1, post, 0.0), np.where(b.pp > 1, gap, 0.0)
    ga_w = ga if schedule_spec(b.sched).split_backward else 0.0
    pipe = bubble.closed_form(b.sched, b.pp, b.m, b.v, ct.f_c + ct.head_f / cpr + po + ga,
                              ct.i_c + ct.head_g / cpr + po + ga,
                              ct.w_c + ct.head_g / cpr + ga_w, t_pp)
    bub = np.where(b.pp > 1, 1 - busy_of(b.m, cpr, ct.f_c, ct.i_c, ct.w_c, ct.head_f,
                                         ct.head_g, b.sched) / pipe, 0.0)
    return pipe, bub, {}


@dataclass
class _RankMemory:
    """Memory of the most loaded rank (the first or the last pipeline rank)."""

    mem: dict[str, Num]  # bytes by category
    total: Num
    use_first: Num  # the first pipeline rank is the most loaded
    params: Num  # parameters on the rank (dense of the larger end, plus experts)
    expert_params: Num  # of which routed experts (their gradients sync over edp)
    # each end's parameters (the first holds the embedding), what one chunk holds (dense,
    # experts) and (embedding, head, dense extra on model stage 0, its dense layers' share
    # of the experts): ZeRO-3's gathers by stage (plait/plan/comm/zero.py)
    first_dense: Num
    last_dense: Num
    first_experts: Num
    last_experts: Num
    chunk: tuple[Num, Num]
    ends: tuple[Num, Num, Num, Num]


def _rank_memory(shape: Shape, train: Training, lay: Layout, b: Basis,
                 info: dict[str, Any], simulate: bool) -> _RankMemory:
    tp, pp, m, cpr = b.tp, b.pp, b.m, b.cpr
    terms = memory.param_terms(shape, tp, b.expert_split)
    dense_l, expert_l, emb, head = terms.layer, terms.expert, terms.embedding, terms.head
    # dense parameters are copied on every replica, routed experts on the replicas that
    # hold the same experts; ZeRO shards over them, or over one shard group of them
    # (hybrid sharding: zero_split)
    dshard, eshard = b.zero_split, b.zero_split / b.expert_split
    both_ends = facts(b.sched).head_on_first_rank
    # an MoE model's leading dense layers sit on the first stage (counted there only:
    # exact while they fit in one chunk, dense_layers <= L/(p v)); their norms whole too
    nd = np.minimum(shape.dense_layers, b.chunk_layers) if shape.moe else 0.0
    dense_extra = nd * (terms.dense_layer - dense_l)
    # the ends' layers: uneven stages (Training.stack) or the even split's rank_layers
    l_first, l_last = b.first_layers, b.last_layers
    first_p = l_first * dense_l + emb + np.where((pp == 1) | both_ends, head, 0.0) \
        + dense_extra
    last_p = l_last * dense_l + head + np.where(pp == 1, dense_extra, 0.0)
    ex_first = (l_first - nd) * expert_l
    ex_last = np.where(pp == 1, ex_first, l_last * expert_l)
    in0, in_last = memory.inflight_chunks(b.sched, pp, m, b.v)
    if simulate and info.get("peaks"):
        in0, in_last = float(info["peaks"][0]), float(info["peaks"][-1])
        if both_ends:
            in_last = in0
    logits = memory.logits_bytes(shape, b.mbs, tp, b.seq_split, b.e)
    buffers = memory.comm_buffers(shape, b.mbs, tp, b.seq_split, pp, lay.zero,
                                  dense_l + expert_l, lay.sp, train.precision)

    kinds = (train.precision, train.optimizer, train.optimizer_sync)  # post-val.: + copy

    def rank_mem(dense_p: Num, ex_p: Num, inflight: Num, has_logits: Num,
                 chunk: Num) -> dict[str, Num]:
        st = memory.model_states(dense_p, dshard, lay.zero, *kinds, pp, lay.zero3_gather)
        ex = memory.model_states(ex_p, eshard, lay.zero, *kinds, pp, lay.zero3_gather)
        out = {k: st[k] + ex[k] for k in st}
        out["activations"] = np.minimum(inflight, m * cpr) * chunk * b.saved
        out["logits"] = np.where(has_logits, logits, 0.0)
        out["communication buffers"] = buffers
        return out

    first = rank_mem(first_p, ex_first, in0, (pp == 1) | both_ends, l_first / cpr)
    last = rank_mem(last_p, ex_last, in_last, True, l_last / cpr)
    t_first, t_last = sum(first.values()), sum(last.values())
    use_first = t_first >= t_last
    mem = {k: np.where(use_first, first[k], last[k]) for k in first}
    ex_p = np.maximum(ex_first, ex_last)
    return _RankMemory(mem, np.maximum(t_first, t_last), use_first,
                       np.maximum(first_p, last_p) + ex_p, ex_p, first_p, last_p, ex_first,
                       ex_last, (b.chunk_layers * dense_l, b.chunk_layers * expert_l),
                       (emb, head, dense_extra, nd * expert_l))


def _busiest(train: Training, lay: Layout, b: Basis, pr: tuple[Num, Num], chunk: Num,
             ends: tuple[Num, Num, Num], layer_linear: Num = 0.0) -> tuple[Num, Num, Num]:
    """(parameters, ZeRO-3's gathered parameters, their bytes) of the pipeline end whose
    ZeRO-3 bytes are the larger (`end_gathered` of each); `layer_linear`: a layer's
    block-linear weights where they are gathered in fewer bytes (fp8), gathered with
    each of the end's layers (the first and last stage's `first_layers`,
    `last_layers`)."""
    out = []
    for last, layers in ((False, b.first_layers), (True, b.last_layers)):
        params, gathered = end_gathered(lay, b, last, pr[int(last)], chunk, ends)
        linear = end_gathered(lay, b, last, layers * layer_linear,
                              b.chunk_layers * layer_linear, (0.0, 0.0, 0.0))[1]
        out.append((params, gathered, gathered_bytes(train, gathered, linear),
                    zero3_bytes(train, lay, b, params, gathered, linear)))
    take_first = out[0][3] >= out[1][3]
    return tuple(np.where(take_first, f, la) for f, la in zip(out[0][:3], out[1][:3],
                                                               strict=True))  # type: ignore


def _optimizer_time(cluster: Cluster, train: Training, lay: Layout, b: Basis,
                    pr: Num, eff: Efficiency) -> Num:
    """The optimizer step: reading and writing the rank's (ZeRO: shard of the) states."""
    pb, gb, kb = memory.state_bytes(train.precision, train.optimizer)
    opt_shard = b.zero_split if lay.zero >= 1 else 1.0
    if memory_bound.priced(eff):
        return memory_bound.optimizer_seconds(pr / opt_shard, train.precision,
                                              train.optimizer, cluster.gpu, eff)
    return pr / opt_shard * (2 * kb + gb + pb) / cluster.gpu.hbm_bw


def _time_breakdown(lay: Layout, b: Basis, lc: LayerComm, ct: ChunkTimes, pipe: Num,
                    dp_exposed: Num, t_opt: Num) -> dict[str, Num]:
    m, cpr, lt = b.m, b.cpr, b.lt
    busy = busy_of(m, cpr, ct.f_c, ct.i_c, ct.w_c, ct.head_f, ct.head_g, b.sched)
    chains = schedule_spec(b.sched).chains
    compute = m * (cpr * b.chunk_layers * (3 * (lt.gemm_fwd + lt.attn_fwd) + lt.elementwise_fwd
                                           + lt.backward_elementwise + ct.tp_cpu)
                   + ct.head_f + 2 * ct.head_g) / chains
    # the memory-bound kernels priced one by one (published GPU numbers) shown apart
    mb = m * (cpr * b.chunk_layers * (lt.elementwise_fwd + lt.backward_elementwise)
              + ct.head_mb) / chains if lt.elementwise_bwd is not None else None
    out = {
        "compute": compute if mb is None else compute - mb,
        "tp comm (exposed)": lc.tp_count * lc.t_ar,
        EXCHANGE_TERM: lc.exchange_exposed() * b.rank_layers * m,
        # the replayed tp collectives are in "tp comm" (its count has them): not twice
        "recompute": m * cpr * b.chunk_layers * (recompute_seconds(
            lay, lt, ct.f_layer - ct.tp_cpu / 3) + ct.policy - (
            0.0 if lay.runtime_mode() == "none" else TP_COLLECTIVES_FWD * lc.t_ar)),
        "pipeline bubble + p2p": np.maximum(pipe - busy, 0.0),
        "dp comm (exposed)": dp_exposed,
        "optimizer step": t_opt,
    }
    if mb is not None:
        out[MEMORY_BOUND_TERM] = mb
    return out


def _step_flops(shape: Shape, train: Training, lay: Layout, b: Basis) -> tuple[Num, Num]:
    """(model FLOPs, hardware FLOPs: with recompute) of one step."""
    tokens_step = tokens_per_step(train.global_batch, shape.seq)
    hardware = hardware_flops_per_token(shape, lay.recompute, lay.attention, lay.recompute_ops)
    return model_flops_per_token(shape) * tokens_step, hardware * tokens_step


def evaluate(shape: Shape, cluster: Cluster, train: Training, lay: Layout, eff: Efficiency,
             simulate: bool = False) -> Estimate:
    """Memory, collectives, compute, pipeline and step time of `lay` (numeric fields may
    be arrays: a batch of layouts scored at once)."""
    b = basis_of(shape, cluster, train, lay, eff)
    lc = layer_comm(shape, cluster, lay, eff, b)
    colls = lc.colls
    ct = chunk_times(shape, cluster, lay, eff, b, lc)
    t_pp = pp_p2p(shape, cluster, eff, b, colls, lay.sp)
    # sends hidden behind compute (stack.py); a measured profile prices plait's own
    # runtime's sends (its p2p_post) instead
    if pp_overlapped(train.stack, b.sched) and not eff.runtime_comm:
        t_pp = 0.0 * t_pp
    pipe, bub, info = _pipeline_time(shape, b, ct, t_pp, simulate, train.optimizer_sync,
                                     eff.p2p_post, eff.pipeline_gap)
    rm = _rank_memory(shape, train, lay, b, info, simulate)
    # dense parameters sync over the replicas, routed experts over the replicas that hold
    # the same experts (plait/parallel/expert.py)
    dense, gathered, g_bytes = rm.params - rm.expert_params, None, None
    experts, g_experts = rm.expert_params, None
    if lay.zero == 3:  # each the end that moves more (ZeRO-3's gathers differ by stage)
        linear = fp8.gathered_linear(shape, b.tp, train.precision)
        dense, gathered, g_bytes = _busiest(train, lay, b, (rm.first_dense, rm.last_dense),
                                            rm.chunk[0], rm.ends[:3], linear)
        experts, g_experts, _ = _busiest(train, lay, b, (rm.first_experts, rm.last_experts),
                                         rm.chunk[1], (0.0, 0.0, -rm.ends[3]))
    dp_exposed = dp_exposed_time(cluster, train, lay, eff, b, ct, dense, colls,
                                 gathered=gathered, gathered_bytes=g_bytes)
    dp_exposed = dp_exposed + block_scales_sync(cluster, train, lay, eff, b, shape, colls)
    if shape.moe:
        dp_exposed = dp_exposed + dp_exposed_time(cluster, train, lay, eff, b, ct,
                                                  experts, colls, experts=True,
                                                  gathered=g_experts)
    copies = 0.0
    if zero3_gpu.applies(lay, eff):  # the published GPU numbers: FSDP's copies, step ends
        copies = zero3_gpu.copy_seconds(cluster, train, lay, eff, b, dense, gathered, g_bytes)
        if shape.moe:
            copies = copies + zero3_gpu.copy_seconds(
                cluster, train, lay, eff, b, experts, g_experts,
                gathered_bytes(train, g_experts), experts=True)
        dp_exposed = dp_exposed + zero3_gpu.end_collectives(cluster, train, lay, eff, b,
                                                            rm.ends[0], colls)
    if schedule_spec(b.sched).chains > 1 and np.any(b.pp > 1):
        colls.append(dualpipe_copies(cluster, train, eff, b, rm.params - rm.expert_params,
                                     rm.expert_params, lay.zero))
    t_opt = _optimizer_time(cluster, train, lay, b, rm.params, eff) + eff.op_seconds * (
        eff.optimizer_layer_ops * b.rank_layers + eff.optimizer_fixed_ops)
    time = _time_breakdown(lay, b, lc, ct, pipe, dp_exposed, t_opt)
    step = pipe + dp_exposed + t_opt
    if zero3_gpu.applies(lay, eff):
        time[zero3_gpu.COPIES_TERM], step = copies, step + copies
    if eff.overlap_slowdown:  # the published GPU numbers: compute beside collectives
        slowed = overlap_slowdown.slowdown_seconds(colls, time["compute"] + time["recompute"],
                                                   eff.overlap_slowdown)
        time[overlap_slowdown.TERM], step = slowed, step + slowed
    if eff.sync_extra or eff.desync_wait:  # a measured profile's (the presets: none)
        time[SYNC_TERM] = sync_seconds(eff, colls, time["compute"] + time["recompute"])
        step = step + time[SYNC_TERM]
    hidden = host_share.hidden_comm_cpu(cluster, colls, eff.comm_cpu_call, eff.comm_cpu_byte)
    if np.any(np.asarray(hidden) > 0):  # a CPU host whose ranks hold every core
        time[host_share.HIDDEN_TERM], step = hidden, step + hidden
    step = host_share.apply(cluster, time, colls, step, eff.comm_cpu_call,  # CPU hosts
                            eff.comm_cpu_byte)
    n_gpu = b.world
    tokens_step = tokens_per_step(train.global_batch, shape.seq)
    model_flops, hw_flops = _step_flops(shape, train, lay, b)
    gpu = cluster.gpu
    limit = gpu.hbm_bytes * train.mem_limit_frac
    return Estimate(
        layout=lay, microbatches=b.m, memory=rm.mem, memory_total=rm.total,
        peak_rank=np.where(rm.use_first, "first", "last"), fits=rm.total <= limit,
        collectives=colls, time=time, step_time=step,
        tokens_per_s=tokens_per_second(tokens_step, [step]),  # plait/throughput.py
        model_tflops=model_flops / step / n_gpu / 1e12,
        hardware_tflops=hw_flops / step / n_gpu / 1e12,
        mfu=model_flops / step / n_gpu / (gpu.peak_flops * b.peak_scale),
        bubble_fraction=bub, extra={"pipeline": info, "hf": ct.hf, "model_flops": model_flops,
                                    "hardware_flops": hw_flops, "rank_params": rm.params,
                                    "rank_expert_params": rm.expert_params},
    )


def busy_of(m: Num, cpr: Num, f_c: Num, i_c: Num, w_c: Num, head_f: Num, head_g: Num,
            sched: str) -> Num:
    """Busy time of the last pipeline rank (it holds the LM head) in one step."""
    per_mb = cpr * (f_c + i_c + w_c) + head_f + 2 * head_g
    return m * per_mb / schedule_spec(sched).chains  # each chain its share of the m

