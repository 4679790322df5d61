"""FLOPs and compute time of one layer for one micro-batch on one rank.

FLOPs (Narayanan et al. 2021, appendix; Korthikanti et al. 2022, section 6): a GEMM of
m x k by k x n costs 2mkn; the backward pass costs twice the forward (input gradient and
weight gradient, one GEMM each). Attention adds QK^T and PV, 2 * 2 * s * h per token
forward. The math kernel computes the full s x s score matrix and masks it (the GPT runs
of the calibration set did); flash kernels skip the masked half.

Time: each GEMM at peak x efficiency(work), a saturating curve of the GEMM's FLOPs
    eff(W) = e_max * W / (W + W_half)
(small GEMMs cannot fill the GPU's SMs; e_max and W_half are fitted once in
plait/plan/calibration.py, or published per GPU: plait/plan/gpu_data.py). With the
published numbers the math kernel's attention GEMMs also meet a roofline: their bytes
over the achievable HBM bandwidth bound their time (their inner dimension is the head's
width, far below a large GEMM's). Elementwise kernels (norms, softmax, activation functions,
dropout) are memory bound: `elementwise_passes` x the bytes the layer saves, over HBM
bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.model.recompute_settings import DEFAULT_OPS
from plait.plan.hardware import GPU
from plait.plan.shape import Shape, check_attention

Num = Any


@dataclass(frozen=True)
class Efficiency:
    """The fitted constants (values live in plait/plan/calibration.py)."""

    gemm_max: float  # asymptotic fraction of peak a large GEMM reaches
    gemm_half: float  # FLOPs of a GEMM that reaches half of gemm_max
    link_efficiency: float  # achieved / datasheet link bandwidth
    elementwise_passes: float  # HBM traffic of elementwise kernels / saved bytes
    # attention core throughput / the GEMM curve's at the same FLOPs (a measured profile's;
    # 1 for the calibration set, which does not separate them)
    attention_scale: float = 1.0
    # per-operation cost (a measured profile's dispatch floor; 0 for the GPU presets, whose
    # calibration set cannot separate it) and the operations plait's runtime issues, counted
    # by plait calibrate: per layer (forward + backward, / 3: the planner runs a layer's
    # elementwise time three times), outside the layers per micro-batch, per optimizer step
    op_seconds: float = 0.0
    layer_ops: float = 0.0
    outside_ops: float = 0.0
    optimizer_layer_ops: float = 0.0
    optimizer_fixed_ops: float = 0.0
    # seconds per layer and micro-batch (forward + backward) plait's selective recompute
    # policy adds on its own (a dispatch mode: Python per operation; a measured profile's,
    # 0 for the presets)
    policy_layer_seconds: float = 0.0
    # CPU seconds per layer and micro-batch a tp rank's layer costs beyond the prices above
    # (the per-operation floor, the collectives' comm_cpu) where a host's ranks share its
    # cores: plait calibrate's tp floor (plait/calibrate/tp.py), recompute none and
    # selective; 0 for the presets (a GPU's rank owns its chip)
    tp_shared_layer_seconds: float = 0.0
    tp_shared_layer_seconds_selective: float = 0.0
    # and the rest of the floor's step (per micro-batch: the embedding, head and loss, the
    # optimizer, the calls outside the layers)
    tp_shared_outside_seconds: float = 0.0
    tp_shared_outside_seconds_selective: float = 0.0
    # bytes/s of element-wise traffic (a measured profile's cache-sized rate; 0: the
    # GPU's HBM bandwidth)
    elementwise_bw: float = 0.0
    # the share of a collective that compute issued beside it hides (plait calibrate's
    # measured overlap; 1 for the GPU presets: copy engines and SMs run both at once)
    comm_overlap: float = 1.0
    # price the collectives plait's runtime issues (plait/plan/comm/layer.py's tp list, one
    # per ZeRO unit, the step's grad-norm and loss all-reduces) instead of Megatron's count,
    # on which the calibration set was fitted: a measured profile's (plait's own runtime)
    runtime_comm: bool = False
    # GEMM throughput of a rank while the host's other ranks run theirs, over one alone
    # (plait calibrate's concurrent GEMMs; 1 for the presets: a GPU's rank owns its chip)
    concurrent_gemm: float = 1.0
    # a synchronising collective issued after compute, as the runtime issues it (plait
    # calibrate's measure_sync; none for the GPU presets, whose calibration set has them
    # inside its fit): the mean seconds past the alpha-beta price once every rank has
    # arrived, and the mean wait for the last rank to arrive after `desync_compute`
    # seconds of compute on each (two points of a power law: plait/plan/comm/sync.py)
    sync_extra: float = 0.0
    desync_compute: tuple[float, ...] = ()
    desync_wait: tuple[float, ...] = ()
    # the seconds past the alpha-beta price after each of `desync_compute`'s segments
    # (sync_extra is their mean; empty in a profile that predates them)
    sync_after: tuple[float, ...] = ()
    # and the extra's growth per byte of a larger call (measured at one larger size,
    # `sync_bytes_measured`: a call's growth is held there, not extrapolated beyond; the
    # size measure_sync has always timed for profiles that predate the field)
    sync_per_byte: float = 0.0
    sync_bytes_measured: float = 128 * 1024
    # seconds posting one batch of pipeline transfers holds a rank (plait calibrate's
    # measure_post; the shared simulator's `post`); 0 for the GPU presets, whose
    # calibration set has the pipeline's sends inside its fit
    p2p_post: float = 0.0
    # seconds of the pipeline runtime's own work before each compute action of a
    # pipelined rank (plait calibrate's measure_gap; the shared simulator's `gap`); 0 for
    # the GPU presets, whose calibration set has it inside its fit
    pipeline_gap: float = 0.0
    # CPU seconds (every thread of a rank: the caller's and gloo's) a collective costs per
    # call and per payload byte (plait calibrate's collectives; 0 for the presets): the
    # part of a call that needs a core when ranks share a host's cores (host_share.py)
    comm_cpu_call: float = 0.0
    comm_cpu_byte: float = 0.0
    # fused attention's measured fraction of peak by sequence length, ((seq, fraction),
    # ...) ascending (plait/plan/gpu_data.py's published points); empty: the GEMM curve
    # times attention_scale
    attention_curve: tuple[tuple[float, float], ...] = ()
    # the fraction of the datasheet HBM bandwidth a streaming copy reaches and the CPU
    # seconds to issue one kernel: the published GPU numbers' (plait/plan/gpu_data.py),
    # which price each memory-bound kernel (plait/plan/memory_bound.py); 0: not priced
    # there (the fitted passes above, or a measured profile's element-wise rate)
    hbm_fraction: float = 0.0
    launch_seconds: float = 0.0
    # float8 GEMMs' ceiling and half point (the published GPU numbers' `fp8_gemm_*`;
    # 0: the bf16 curve's, gemm_max and gemm_half): plait/plan/fp8.py
    fp8_gemm_max: float = 0.0
    fp8_gemm_half: float = 0.0
    # how much longer compute runs beside a collective than alone (the published GPU
    # numbers' `overlap_compute_slowdown`: plait/plan/overlap_slowdown.py; 0: not priced)
    overlap_slowdown: float = 0.0


def attention_eff(seq: Num, curve: tuple[tuple[float, float], ...]) -> Num:
    """Fused attention's fraction of peak at sequence length `seq`: `curve` interpolated
    in log(seq), held flat beyond its ends."""
    xs = np.log([float(s) for s, _ in curve])
    ys = np.array([float(f) for _, f in curve])
    return np.interp(np.log(np.maximum(np.asarray(seq, dtype=float), 1.0)), xs, ys)


def gemm_eff(work: Num, eff: Efficiency) -> Num:
    return eff.gemm_max * work / (work + eff.gemm_half)


def gemm_time(flops: Num, gpu: GPU, eff: Efficiency, peak_scale: float = 1.0) -> Num:
    return flops / (gpu.peak_flops * peak_scale * gemm_eff(flops, eff))


def layer_gemms(shape: Shape, tokens: Num, tp: Num, moe_split: Num = 1
                ) -> list[tuple[str, Num]]:
    """(name, forward FLOPs) of each weight GEMM of one layer on one rank. An MoE block is
    replicated over tp (plait/parallel/expert.py): its tokens split `moe_split` ways (tp
    under sequence parallel, else 1: every tp rank routes them all)."""
    h, t = shape.hidden, np.asarray(tp, dtype=float)
    ms = np.asarray(moe_split, dtype=float)
    n = np.asarray(tokens, dtype=float)
    out = [("qkv", 2 * n * h * (h + 2 * shape.kv_dim) / t), ("out", 2 * n * h * h / t)]
    if shape.mla:  # down-projections whole on every tp rank, the rest split by heads
        out = [("latents (down-projections)", 2 * n * (shape.mla_replicated_params()
                                                       - shape.q_lora - shape.kv_lora)),
               ("q, kv up-projections and out", 2 * n * shape.mla_split_params() / t)]
    if shape.arch == "gpt":  # GeLU MLP: two matrices of h x ffn
        return out + [("fc1", 2 * n * h * shape.ffn / t), ("fc2", 2 * n * shape.ffn * h / t)]
    if not shape.moe:  # gate and up fused in one GEMM (Megatron-LM's fc1), down apart
        return out + [("mlp gate+up", 2 * n * h * 2 * shape.ffn / t),
                      ("mlp down", 2 * n * shape.ffn * h / t)]
    fe = shape.expert_ffn
    out.append(("router", 2 * n * h * shape.experts / ms))
    out.append(("routed experts", 2 * n * shape.top_k * 3 * h * fe / ms))
    if shape.shared_experts:
        out.append(("shared experts", 2 * n * shape.shared_experts * 3 * h * fe / ms))
    return out


def gemm_weights(shape: Shape, tp: Num) -> Num:
    """Weight elements of one layer's weight GEMMs on one rank (each GEMM's forward FLOPs
    a token over 2): the block linears, without norms or biases."""
    return sum(f for _, f in layer_gemms(shape, 1, tp)) / 2


def float8_gathered_weights(shape: Shape, tp: Num) -> Num:
    """Weight elements of one layer on one rank that ZeRO-3 all-gathers in float8
    (`--precision fp8`): the block linears, but in an MoE layer not the router and the
    routed experts, which travel at the parameters' bytes; an MoE model's dense first
    layers averaged in (exact for a rank that holds every layer)."""
    if not shape.moe:
        return gemm_weights(shape, tp)
    moe = sum(f for name, f in layer_gemms(shape, 1, tp)
              if name not in ("router", "routed experts")) / 2
    dense = gemm_weights(shape.dense_version(), tp)
    return ((shape.layers - shape.dense_layers) * moe + shape.dense_layers * dense) / shape.layers


def causal_fraction(shape: Shape, attention: str | None = None) -> float:
    """Fraction of the s x s score matrix computed. A kernel's (`attention`): math computes
    the full masked matrix (the GPT runs of the calibration set did), flash skips the
    masked half. None: the model-FLOPs convention of the block, PaLM's full matrix for the
    GPT block, half for the llama block's causal kernels (`ModelConfig.flops_per_token`)."""
    if attention is None:
        return 1.0 if shape.arch == "gpt" else 0.5
    check_attention(attention)
    return 1.0 if attention == "math" else 0.5


def attention_core_flops(shape: Shape, tokens: Num, tp: Num, attention: str | None = None
                         ) -> Num:
    """QK^T and PV, forward: 2 * tokens * s * a * (d_qk + d_v) / tp, = 2 * 2 * tokens * s *
    h / tp for GQA's heads of h / a (queries of this rank against all s keys, also under
    context parallelism), times the kernel's `causal_fraction`."""
    width = shape.heads * (shape.qk_dim + shape.v_dim)
    return 2 * np.asarray(tokens, dtype=float) * shape.seq * width * causal_fraction(
        shape, attention) / np.asarray(tp, dtype=float)


def math_attention_bytes(shape: Shape, tokens: Num, tp: Num) -> Num:
    """HBM bytes the math kernel's two forward GEMMs move on one rank (bf16): QK^T writes
    the tokens x s scores of each of the rank's heads and PV reads them back, beside Q, K,
    V and the output. Per FLOP this is 1 / head dim (the GEMMs' inner dimension is the
    head's width), so these GEMMs are memory-bound where the head dim is under the GPU's
    FLOPs per byte; the backward's four GEMMs move the scores four times for twice the
    FLOPs, the same ratio."""
    t = np.asarray(tokens, dtype=float)
    heads = shape.heads / np.asarray(tp, dtype=float)
    return 2.0 * heads * (2 * t * shape.seq + 2 * t * (shape.qk_dim + shape.v_dim))


def head_flops(shape: Shape, tokens: Num, tp: Num) -> Num:
    """LM head forward (vocab-parallel over tp)."""
    return 2 * np.asarray(tokens, dtype=float) * shape.hidden * shape.vocab / np.asarray(
        tp, dtype=float)


def _per_layer_types(shape: Shape) -> list[tuple[int, Shape]]:
    """(count, shape) of the layer types: an MoE model's leading dense layers apart."""
    if not shape.moe or not shape.dense_layers:
        return [(shape.layers, shape)]
    return [(shape.moe_layers, shape), (shape.dense_layers, shape.dense_version())]


def layers_forward_flops_per_token(shape: Shape, attention: str | None = None) -> float:
    """Forward FLOPs per token of all layers: weight GEMMs + attention core (an MoE
    model's leading dense layers counted with their dense MLP); `attention` as in
    causal_fraction (None: the model-FLOPs convention)."""
    return sum(n * float(sum(f for _, f in layer_gemms(s, 1, 1))
                         + attention_core_flops(s, 1, 1, attention))
               for n, s in _per_layer_types(shape))


def model_flops_per_token(shape: Shape) -> float:
    """Training FLOPs per token, without recompute (the MFU numerator): 3 x the forward
    (forward + backward = 2 x forward) of every weight GEMM and the attention core and the
    LM head, i.e. 6 x active matmul parameters + 3 x the attention core forward
    (Narayanan et al. 2021, section 5.1; Chowdhery et al. 2022 (PaLM), appendix B:
    6N + 12LHQT). The attention term is PaLM's for the GPT block (the full s x s scores
    computed); causal kernels (the llama block) compute half of it: 6N + 6LHQT.
    Biases, norms, softmax and activation functions are not counted (as in both)."""
    return 3 * (layers_forward_flops_per_token(shape) + head_flops(shape, 1, 1))


def recomputed_flops_per_token(shape: Shape, recompute: str, attention: str,
                               ops: tuple[str, ...] = DEFAULT_OPS) -> float:
    """Forward FLOPs per token that `recompute` runs again, once per micro-batch, of
    exactly what it drops: full the layers' forward; selective with the math kernel the
    attention core (Korthikanti et al. 2022, sec. 5); selective with flash plait's
    operator policy, the groups in `ops` (attention: the core; matmul: the weight GEMMs;
    element-wise ops are memory-bound and not FLOPs), as the runtime's
    `extra_forward_flops_per_token` counts for a whole-backward schedule."""
    if recompute == "none":
        return 0.0
    if recompute == "full":
        return layers_forward_flops_per_token(shape, attention)
    core = shape.layers * float(attention_core_flops(shape, 1, 1, attention))
    if attention == "math":
        return core
    gemms = sum(n * float(sum(f for _, f in layer_gemms(s, 1, 1)))
                for n, s in _per_layer_types(shape))
    return core * ("attention" in ops) + gemms * ("matmul" in ops)


def hardware_flops_per_token(shape: Shape, recompute: str, attention: str,
                             ops: tuple[str, ...] = DEFAULT_OPS) -> float:
    """FLOPs per token the kernels execute: 3 x the forward with the kernel's share of the
    score matrix, plus the recomputation (equal to the model FLOPs + recompute for the
    block's own convention: gpt with math, llama with flash)."""
    executed = 3 * (layers_forward_flops_per_token(shape, attention) + head_flops(shape, 1, 1))
    return executed + recomputed_flops_per_token(shape, recompute, attention, ops)


FLOP_DEFINITIONS = {
    "model": "model FLOPs (the MFU numerator, no recompute): 6 x matmul parameters per "
             "token + 3 x the attention core forward; PaLM's 6N + 12LHQT (Chowdhery et al. "
             "2022, appendix B) for the GPT block (full score matrix), its attention term "
             "halved for causal kernels (llama)",
    "hardware": "hardware FLOPs: what the kernels execute (the attention core at the "
                "kernel's share of the score matrix: math the full masked matrix, flash "
                "half) plus what recompute runs again (full: the layers' forward, Narayanan "
                "et al. 2021 eq. 3's 4 passes; selective with math: the attention core "
                "forward, Korthikanti et al. 2022 sec. 5; selective with flash: the groups "
                "plait's policy recomputes, by default the attention core)",
}


@dataclass
class LayerTimes:
    """Seconds for one layer, one micro-batch, one rank (arrays in a search)."""

    gemm_fwd: Num
    attn_fwd: Num
    elementwise_fwd: Num
    flops_fwd: Num  # GEMM + attention core FLOPs, forward
    # the backward's element-wise seconds (None: twice the forward's)
    elementwise_bwd: Num = None

    @property
    def forward(self) -> Num:
        return self.gemm_fwd + self.attn_fwd + self.elementwise_fwd

    @property
    def backward_elementwise(self) -> Num:
        if self.elementwise_bwd is None:
            return 2 * self.elementwise_fwd
        return self.elementwise_bwd


def layer_times(shape: Shape, tokens: Num, tp: Num, gpu: GPU, eff: Efficiency,
                saved_bytes: Num, peak_scale: float = 1.0, moe_split: Num = 1,
                attention: str = "flash", weight_gemms: tuple[Efficiency, float] | None = None
                ) -> LayerTimes:
    """Forward times of one layer; `saved_bytes` is what the layer saves without recompute
    (memory.layer_activations with recompute='none'), the proxy for elementwise traffic
    (with the math kernel it holds the probabilities written and read). `weight_gemms`:
    the weight GEMMs' (efficiency, peak scale) where they differ from the rest's (float8:
    plait/plan/fp8.py); the attention core keeps `eff` and `peak_scale`."""
    gemms = layer_gemms(shape, tokens, tp, moe_split)
    g_eff, g_scale = weight_gemms or (eff, peak_scale)
    g_time = sum(gemm_time(f, gpu, g_eff, g_scale) for _, f in gemms)
    a_flops = attention_core_flops(shape, tokens, tp, attention)
    # batched per-head GEMMs: efficiency of the whole batch's work
    if eff.attention_curve and attention == "flash":  # a published fused sweep
        a_time = a_flops / (gpu.peak_flops * peak_scale
                            * attention_eff(shape.seq, eff.attention_curve))
    else:
        a_time = gemm_time(a_flops, gpu, eff, peak_scale) / eff.attention_scale
    if attention == "math" and eff.hbm_fraction > 0:  # the published numbers: a roofline
        a_time = np.maximum(a_time, math_attention_bytes(shape, tokens, tp)
                            / (gpu.hbm_bw * eff.hbm_fraction))
    bw = eff.elementwise_bw or gpu.hbm_bw
    elt = eff.elementwise_passes * saved_bytes / bw + eff.op_seconds * eff.layer_ops / 3
    return LayerTimes(g_time, a_time, elt, sum(f for _, f in gemms) + a_flops)


def tp_floor_seconds(eff: Efficiency, tp: Num, mode: str, shared_host: bool
                     ) -> tuple[Num, Num]:
    """(per layer, outside the layers) CPU seconds per micro-batch a tp rank adds beyond
    the per-operation and per-collective prices where its host's cores are shared
    (`shared_host`: Efficiency.tp_shared_*, the selective rows under selective
    recompute); 0 where tp = 1 or a rank has a core."""
    on = (np.asarray(tp) > 1) & shared_host
    name = "_selective" if mode == "selective" else ""
    return (np.where(on, getattr(eff, f"tp_shared_layer_seconds{name}"), 0.0),
            np.where(on, getattr(eff, f"tp_shared_outside_seconds{name}"), 0.0))


def recompute_seconds(lay: Any, lt: LayerTimes, f_layer: Any) -> Any:
    """Seconds one layer's backward adds by recomputing, of exactly what the layout's
    `recompute` (with its `attention` and `recompute_ops`: estimate.Layout) drops
    (recomputed_flops_per_token counts the same FLOPs): full its forward (with its
    exchanges, `f_layer`); selective with math the attention core; selective with flash
    the groups of plait's policy, the element-wise ops always, and with them the forward's
    exchanges (a collective is an element-wise op to the policy: the runtime re-issues
    them, docs/recompute.md)."""
    if lay.recompute == "full":
        return f_layer
    if lay.recompute != "selective":
        return 0.0 * f_layer
    if lay.attention == "math":
        return lt.attn_fwd
    ops, exchanges = lay.recompute_ops, f_layer - lt.forward
    return (lt.elementwise_fwd + exchanges + lt.attn_fwd * ("attention" in ops)
            + lt.gemm_fwd * ("matmul" in ops))
