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

from plait.plan import bubble, comm, memory
from plait.plan.compute import (
    Efficiency,
    attention_core_flops,
    gemm_time,
    head_flops,
    layer_times,
    model_flops_per_token,
)
from plait.plan.hardware import Cluster
from plait.plan.shape import Shape

Num = Any


@dataclass
class Training:
    global_batch: int  # sequences per optimizer step
    precision: str = "bf16"
    optimizer: str = "adam"
    mem_limit_frac: float = 0.9  # of HBM usable: CUDA context, NCCL, fragmentation


@dataclass
class Layout:
    """One layout; numeric fields may be numpy arrays (a batch of layouts)."""

    tp: Num = 1
    pp: Num = 1
    dp: Num = 1
    cp: Num = 1
    ep: Num = 1
    mbs: Num = 1  # sequences per micro-batch
    schedule: str = "1f1b"
    v: Num = 1  # virtual stages per rank (interleaved)
    zero: int = 1
    recompute: str = "selective"
    sp: bool = True  # sequence parallelism with TP (Korthikanti et al. 2022)

    def label(self) -> str:
        s = f"tp={self.tp},pp={self.pp},dp={self.dp}"
        if self.cp != 1:
            s += f",cp={self.cp}"
        if self.ep != 1:
            s += f",ep={self.ep}"
        return s


@dataclass
class Estimate:
    layout: Layout
    microbatches: Num
    memory: dict[str, Num]  # bytes on the most loaded rank, by category
    memory_total: Num
    peak_rank: Num  # "first" or "last" pipeline rank
    fits: Num
    collectives: list[comm.Collective]
    time: dict[str, Num]  # step-time breakdown, seconds
    step_time: Num
    tokens_per_s: Num
    model_tflops: Num  # per GPU, model FLOPs (6N + attention)
    hardware_tflops: Num  # per GPU, FLOPs executed (with recompute)
    mfu: Num
    bubble_fraction: Num
    extra: dict[str, Any] = field(default_factory=dict)


def _f(x: Num) -> Num:
    return np.asarray(x, dtype=float)


def evaluate(shape: Shape, cluster: Cluster, train: Training, lay: Layout, eff: Efficiency,
             simulate: bool = False) -> Estimate:
    gpu, gpn = cluster.gpu, cluster.gpus_per_node
    tp, pp, dp, cp, ep, mbs, v = (_f(x) for x in (lay.tp, lay.pp, lay.dp, lay.cp, lay.ep,
                                                 lay.mbs, lay.v))
    sched = lay.schedule if np.all(pp > 1) else "1f1b"
    e = memory.PRECISIONS[train.precision][3]
    peak_scale = 0.5 if train.precision == "fp32" else 1.0  # TF32 tensor cores: half rate
    m = train.global_batch / (dp * mbs)
    tokens = mbs * shape.seq / cp
    cpr = _f(bubble.chunks_per_rank(sched, v))
    chunk_layers = np.ceil(shape.layers / _f(bubble.stages_per_chain(sched, pp, v)))
    rank_layers = chunk_layers * cpr

    # ---- compute per layer, per micro-batch -------------------------------------------
    saved_none = memory.layer_activations(shape, mbs, tp, cp, lay.sp, "none", e)
    saved = memory.layer_activations(shape, mbs, tp, cp, lay.sp, lay.recompute, e)
    lt = layer_times(shape, tokens, tp, gpu, eff, saved_none, peak_scale)

    # ---- collectives inside a layer ------------------------------------------------
    colls: list[comm.Collective] = []
    tp_intra = comm.intra_node(1, tp, gpn)
    bw, al = comm.link(gpu, tp_intra, eff.link_efficiency)
    s_tp = tokens * shape.hidden * e
    t_ar, tree = comm.all_reduce(s_tp, tp, bw, al)
    n_tp_fwd, n_tp_bwd = 2, 2 + (2 if lay.recompute == "full" else 0)
    tp_count = (n_tp_fwd + n_tp_bwd) * rank_layers * m
    if np.any(tp > 1):
        op = "all-gather + reduce-scatter" if lay.sp else "all-reduce"
        colls.append(comm.Collective("tp", op, s_tp, tp_count, tp, tp_intra, t_ar,
                                     tp_count * t_ar, "none: on the critical path",
                                     "ring" if not np.any(tree) else "tree/ring"))

    cp_intra = comm.intra_node(tp, cp, gpn)
    bw, al = comm.link(gpu, cp_intra, eff.link_efficiency)
    s_kv = 2 * tokens * shape.kv_dim * e / tp
    t_kv = np.where(cp > 1, (cp - 1) * comm.p2p(s_kv, bw, al), 0.0)
    cp_exp_f = np.maximum(t_kv - lt.attn_fwd, 0)
    cp_exp_b = np.maximum(2 * t_kv - 2 * lt.attn_fwd, 0)
    if np.any(cp > 1):
        n = 3 * (cp - 1) * rank_layers * m
        colls.append(comm.Collective("cp", "p2p (ring K/V)", s_kv, n, cp, cp_intra,
                                     comm.p2p(s_kv, bw, al), (cp_exp_f + cp_exp_b)
                                     * rank_layers * m, "attention core compute"))

    ep_exp_f = ep_exp_b = 0.0
    if shape.moe:
        span = np.where(ep <= cp, tp * ep, tp * cp * pp * ep / cp)
        ep_intra = span <= gpn
        bw, al = comm.link(gpu, ep_intra, eff.link_efficiency)
        s_a2a = tokens * shape.top_k * shape.hidden * e / tp
        t_a2a = comm.gather_like(s_a2a, ep, bw, al)
        if sched in ("dualpipe", "dualpipev") and np.all(pp > 1):
            ep_exp_f = np.maximum(2 * t_a2a - lt.forward, 0)  # hidden by the paired chunk
            ep_exp_b = np.maximum(2 * t_a2a - 2 * lt.forward, 0)
            how = "the other micro-batch's compute (DualPipe)"
        else:
            ep_exp_f, ep_exp_b = 2 * t_a2a, 2 * t_a2a
            how = "none: on the critical path"
        if np.any(ep > 1):
            n = 4 * rank_layers * m
            colls.append(comm.Collective("ep", "all-to-all", s_a2a, n, ep, ep_intra, t_a2a,
                                         (ep_exp_f + ep_exp_b) * rank_layers * m, how))

    # ---- per-chunk durations ---------------------------------------------------------
    f_layer = lt.forward + n_tp_fwd * t_ar + cp_exp_f + ep_exp_f
    i_layer = lt.gemm_fwd + 2 * lt.attn_fwd + 2 * lt.elementwise_fwd + 2 * t_ar + cp_exp_b \
        + ep_exp_b
    w_layer = lt.gemm_fwd
    if lay.recompute == "full":
        i_layer = i_layer + f_layer
    elif lay.recompute == "selective":
        i_layer = i_layer + lt.attn_fwd
    hf = head_flops(shape, tokens, tp)
    head_g = gemm_time(hf, gpu, eff, peak_scale)
    head_f = head_g + memory.logits_bytes(shape, mbs, tp, cp, e) / gpu.hbm_bw
    f_c, i_c, w_c = chunk_layers * f_layer, chunk_layers * i_layer, chunk_layers * w_layer

    pp_intra = comm.intra_node(tp * cp, pp, gpn)
    bw, al = comm.link(gpu, pp_intra, eff.link_efficiency)
    # Megatron's scatter/gather optimisation sends 1/tp of the activation per rank
    # (Narayanan et al. 2021, sec. 4.1), with or without SP
    s_pp = tokens * shape.hidden * e / tp
    t_pp = np.where(pp > 1, comm.p2p(s_pp, bw, al), 0.0)
    if np.any(pp > 1):
        n = 2 * m * cpr
        colls.append(comm.Collective("pp", "p2p", s_pp, n, 2, pp_intra, t_pp, 0.0,
                                     "inside the pipeline timeline (simulated)"))

    info: dict[str, Any] = {}
    if simulate:
        res = _simulate_one(shape, sched, int(pp), int(m), int(v), float(f_layer),
                            float(i_layer), float(w_layer), float(head_f), float(head_g),
                            float(t_pp))
        pipe, bub, info = res["step"], res["bubble"], res
    else:
        # ranking: the last rank's chunks carry the LM head (spread over its chunks)
        pipe = bubble.closed_form(sched, pp, m, v, f_c + head_f / cpr, i_c + head_g / cpr,
                                  w_c + head_g / cpr, t_pp)
        bub = np.where(pp > 1, 1 - busy_of(m, cpr, f_c, i_c, w_c, head_f, head_g, sched)
                       / pipe, 0.0)

    # ---- memory per rank -------------------------------------------------------------
    dense_l = (shape.attn_params() + shape.dense_mlp_params()) / tp
    expert_l = shape.expert_params() / (ep * tp)
    dshard, eshard = dp * cp, dp * cp / ep
    both_ends = sched in ("zb-v", "dualpipev", "dualpipe")
    emb, head = shape.embedding_params() / tp, shape.head_params() / tp
    first_p = rank_layers * dense_l + emb + np.where((pp == 1) | both_ends, head, 0.0)
    last_p = rank_layers * dense_l + head
    ex_p = rank_layers * expert_l
    in0, in_last = memory.inflight_chunks(sched, pp, m, v)
    if simulate and info.get("peaks"):
        in0, in_last = float(info["peaks"][0]), float(info["peaks"][-1])
        if both_ends:
            in_last = in0
    logits = memory.logits_bytes(shape, mbs, tp, cp, e)
    buffers = memory.comm_buffers(shape, mbs, tp, cp, ep, pp, lay.zero,
                                  dense_l + expert_l, lay.sp,
                                  train.precision)

    def rank_mem(dense_p: Num, inflight: Num, has_logits: Num) -> dict[str, Num]:
        st = memory.model_states(dense_p, dshard, lay.zero, train.precision, train.optimizer)
        ex = memory.model_states(ex_p, eshard, lay.zero, train.precision, train.optimizer)
        out = {k: st[k] + ex[k] for k in st}
        out["activations"] = np.minimum(inflight, m * cpr) * chunk_layers * saved
        out["logits"] = np.where(has_logits, logits, 0.0)
        out["communication buffers"] = buffers
        return out

    first = rank_mem(first_p, in0, (pp == 1) | both_ends)
    last = rank_mem(last_p, in_last, True)
    t_first, t_last = sum(first.values()), sum(last.values())
    use_first = t_first >= t_last
    mem = {k: np.where(use_first, first[k], last[k]) for k in first}
    mem_total = np.maximum(t_first, t_last)

    # ---- data parallel / ZeRO --------------------------------------------------------
    pb, gb, kb = memory.state_bytes(train.precision, train.optimizer)
    pr = np.maximum(first_p, last_p) + ex_p  # parameters on the rank
    span = np.where(dp > 1, tp * cp * pp * dp, tp * cp)
    dp_intra = span <= gpn
    bw, al = comm.link(gpu, dp_intra, eff.link_efficiency)
    g_bytes, p_bytes = pr * gb, pr * pb
    f_mb, b_mb = cpr * f_c, cpr * (i_c + w_c)  # one micro-batch on this rank
    n = dshard
    t_ar_dp, _ = comm.all_reduce(g_bytes, n, bw, al)
    t_rs = comm.gather_like(g_bytes, n, bw, al)
    t_ag = comm.gather_like(p_bytes, n, bw, al)
    dp_colls: list[tuple[str, Num, Num, Num, Num, str]] = []
    if lay.zero == 0:
        exp = np.maximum(t_ar_dp - b_mb, 0)
        dp_colls.append(("all-reduce (grads)", g_bytes, 1, t_ar_dp, exp, "last backward"))
    elif lay.zero in (1, 2):
        k = m if lay.zero == 2 else 1
        exp_rs = k * np.maximum(t_rs - b_mb, 0)
        dp_colls.append(("reduce-scatter (grads)", g_bytes, k, t_rs, exp_rs,
                         "each backward" if lay.zero == 2 else "last backward"))
        dp_colls.append(("all-gather (params)", p_bytes, 1, t_ag,
                         np.maximum(t_ag - f_mb, 0), "first forward"))
    else:
        dp_colls.append(("all-gather (params, fwd+bwd)", p_bytes, 2 * m, t_ag,
                         m * np.maximum(t_ag - f_mb, 0) + m * np.maximum(t_ag - b_mb / 2, 0),
                         "the layer before (prefetch)"))
        dp_colls.append(("reduce-scatter (grads)", g_bytes, m, t_rs,
                         m * np.maximum(t_rs - b_mb / 2, 0), "the next layer's backward"))
    dp_exposed = 0.0
    for op, size, count, t_each, exp, how in dp_colls:
        exp = np.where(n > 1, exp, 0.0)
        dp_exposed = dp_exposed + exp
        if np.any(n > 1):
            colls.append(comm.Collective("dp", op, size, _f(count), n, dp_intra, t_each, exp,
                                         how))

    opt_shard = dshard if lay.zero >= 1 else 1.0
    t_opt = pr / opt_shard * (2 * kb + gb + pb) / gpu.hbm_bw

    step = pipe + dp_exposed + t_opt
    tp_total = tp_count * t_ar
    busy = busy_of(m, cpr, f_c, i_c, w_c, head_f, head_g, sched)
    time = {
        "compute": m * (cpr * chunk_layers * 3 * lt.forward + head_f + 2 * head_g)
        / (1.0 if sched != "dualpipe" else 2.0),
        "tp comm (exposed)": tp_total,
        "cp/ep comm (exposed)": (cp_exp_f + cp_exp_b + ep_exp_f + ep_exp_b) * rank_layers * m,
        "recompute": m * cpr * chunk_layers * (f_layer if lay.recompute == "full" else
                                               lt.attn_fwd if lay.recompute == "selective"
                                               else 0.0),
        "pipeline bubble + p2p": np.maximum(pipe - busy, 0.0),
        "dp comm (exposed)": dp_exposed,
        "optimizer step": t_opt,
    }
    n_gpu = tp * pp * dp * cp
    tokens_step = train.global_batch * shape.seq
    model_flops = model_flops_per_token(shape) * tokens_step
    rec_per_token = 0.0
    if lay.recompute == "full":
        rec_per_token = shape.layers * lt.flops_fwd / tokens * tp
    elif lay.recompute == "selective":
        rec_per_token = shape.layers * attention_core_flops(shape, 1, 1)
    hw_flops = model_flops + rec_per_token * tokens_step
    limit = gpu.hbm_bytes * train.mem_limit_frac
    return Estimate(
        layout=lay, microbatches=m, memory=mem, memory_total=mem_total,
        peak_rank=np.where(use_first, "first", "last"), fits=mem_total <= limit,
        collectives=colls, time=time, step_time=step, tokens_per_s=tokens_step / step,
        model_tflops=model_flops / step / n_gpu / 1e12,
        hardware_tflops=hw_flops / step / n_gpu / 1e12,
        mfu=model_flops / step / n_gpu / (gpu.peak_flops * peak_scale),
        bubble_fraction=bub, extra={"pipeline": info, "hf": hf},
    )


def busy_of(m: Num, cpr: Num, f_c: Num, i_c: Num, w_c: Num, head_f: Num, head_g: Num,
            sched: str) -> Num:
    """Busy time of the last pipeline rank (it holds the LM head) in one step."""
    per_mb = cpr * (f_c + i_c + w_c) + head_f + 2 * head_g
    return m * per_mb / (2.0 if sched == "dualpipe" else 1.0)


def _simulate_one(shape: Shape, sched: str, pp: int, m: int, v: int, f: float, i: float,
                  w: float, head_f: float, head_g: float, p2p: float) -> dict[str, Any]:
    """Per-stage durations (layers split as evenly as possible, the head on the last stage
    of each chain) through the shared simulator."""
    if pp == 1:
        c = shape.layers
        step = m * (c * (f + i + w) + head_f + 2 * head_g)
        return {"step": step, "bubble": 0.0, "peaks": [1], "source": "no pipeline"}
    chains = 2 if sched == "dualpipe" else 1
    n = bubble.stages_per_chain(sched, pp, v)
    base, extra = divmod(shape.layers, n)
    layers = [base + (1 if s >= n - extra else 0) for s in range(n)]
    fs = [x * f for x in layers] * chains
    is_ = [x * i for x in layers] * chains
    ws = [x * w for x in layers] * chains
    for last in range(n - 1, n * chains, n):
        fs[last] += head_f
        is_[last] += head_g
        ws[last] += head_g
    return bubble.simulate_pipeline(sched, pp, m, v, fs, is_, ws, p2p)
