"""FLOPs and compute time of one layer for one micro-batch on one rank.

FLOPs (Narayanan et al. 2021, appendix; Korthikanti et al. 2022, section 6): a GEMM of
m x k by k x n costs 2mkn; the backward pass costs twice the forward (input gradient and
weight gradient, one GEMM each). Attention adds QK^T and PV, 2 * 2 * s * h per token
forward. The GPT runs of the calibration set computed the full s x s score matrix and
masked it; plait's block uses causal attention kernels that skip the masked half.

Time: each GEMM at peak x efficiency(work), a saturating curve of the GEMM's FLOPs
    eff(W) = e_max * W / (W + W_half)
(small GEMMs cannot fill the GPU's SMs; e_max and W_half are fitted once in
plait/plan/calibration.py). Elementwise kernels (norms, softmax, activation functions,
dropout) are memory bound: `elementwise_passes` x the bytes the layer saves, over HBM
bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.plan.hardware import GPU
from plait.plan.shape import Shape

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
    if shape.arch == "gpt":  # GeLU MLP: two matrices of h x ffn
        return out + [("fc1", 2 * n * h * shape.ffn / t), ("fc2", 2 * n * shape.ffn * h / t)]
    if not shape.moe:
        return out + [("mlp", 2 * n * h * 3 * shape.ffn / t)]
    fe = shape.expert_ffn
    out.append(("router", 2 * n * h * shape.experts / ms))
    out.append(("routed experts", 2 * n * shape.top_k * 3 * h * fe / ms))
    if shape.shared_experts:
        out.append(("shared experts", 2 * n * shape.shared_experts * 3 * h * fe / ms))
    return out


def causal_fraction(shape: Shape) -> float:
    """Fraction of the s x s score matrix computed: 1 for the GPT runs (masked full
    matrix), 1/2 for causal kernels."""
    return 1.0 if shape.arch == "gpt" else 0.5


def attention_core_flops(shape: Shape, tokens: Num, tp: Num) -> Num:
    """QK^T and PV, forward: 2 * 2 * tokens * s * h / tp (queries of this rank against all s
    keys, also under context parallelism)."""
    return 4 * np.asarray(tokens, dtype=float) * shape.seq * shape.hidden * causal_fraction(
        shape) / np.asarray(tp, dtype=float)


def head_flops(shape: Shape, tokens: Num, tp: Num) -> Num:
    """LM head forward (vocab-parallel over tp)."""
    return 2 * np.asarray(tokens, dtype=float) * shape.hidden * shape.vocab / np.asarray(
        tp, dtype=float)


def layers_forward_flops_per_token(shape: Shape) -> float:
    """Forward FLOPs per token of all layers: weight GEMMs + attention core (an MoE
    model's leading dense layers counted with their dense MLP)."""
    def one(s: Shape) -> float:
        return float(sum(f for _, f in layer_gemms(s, 1, 1)) + attention_core_flops(s, 1, 1))

    if not shape.moe or not shape.dense_layers:
        return shape.layers * one(shape)
    return shape.moe_layers * one(shape) + shape.dense_layers * one(shape.dense_version())


def model_flops_per_token(shape: Shape) -> float:
    """Training FLOPs per token, without recompute (the MFU numerator): 3 x the forward
    (forward + backward = 2 x forward) of every weight GEMM and the attention core and the
    LM head, i.e. 6 x active matmul parameters + 3 x the attention core forward
    (Narayanan et al. 2021, section 5.1; Chowdhery et al. 2022 (PaLM), appendix B:
    6N + 12LHQT). The attention term is PaLM's for the GPT block (the full s x s scores
    computed); causal kernels (the llama block) compute half of it: 6N + 6LHQT.
    Biases, norms, softmax and activation functions are not counted (as in both)."""
    return 3 * (layers_forward_flops_per_token(shape) + head_flops(shape, 1, 1))


FLOP_DEFINITIONS = {
    "model": "model FLOPs (the MFU numerator, no recompute): 6 x matmul parameters per "
             "token + 3 x the attention core forward; PaLM's 6N + 12LHQT (Chowdhery et al. "
             "2022, appendix B) for the GPT block (full score matrix), its attention term "
             "halved for causal kernels (llama)",
    "hardware": "hardware FLOPs: the model FLOPs plus what recompute runs again (full: the "
                "layers' forward, Narayanan et al. 2021 eq. 3's 4 passes; selective: the "
                "attention core forward)",
}


@dataclass
class LayerTimes:
    """Seconds for one layer, one micro-batch, one rank (arrays in a search)."""

    gemm_fwd: Num
    attn_fwd: Num
    elementwise_fwd: Num
    flops_fwd: Num  # GEMM + attention core FLOPs, forward

    @property
    def forward(self) -> Num:
        return self.gemm_fwd + self.attn_fwd + self.elementwise_fwd


def layer_times(shape: Shape, tokens: Num, tp: Num, gpu: GPU, eff: Efficiency,
                saved_bytes: Num, peak_scale: float = 1.0, moe_split: Num = 1) -> LayerTimes:
    """Forward times of one layer; `saved_bytes` is what the layer saves without recompute
    (memory.layer_activations with recompute='none'), the proxy for elementwise traffic."""
    gemms = layer_gemms(shape, tokens, tp, moe_split)
    g_time = sum(gemm_time(f, gpu, eff, peak_scale) for _, f in gemms)
    a_flops = attention_core_flops(shape, tokens, tp)
    # batched per-head GEMMs: efficiency of the whole batch's work
    a_time = gemm_time(a_flops, gpu, eff, peak_scale) / eff.attention_scale
    elt = eff.elementwise_passes * saved_bytes / gpu.hbm_bw + eff.op_seconds * eff.layer_ops / 3
    return LayerTimes(g_time, a_time, elt, sum(f for _, f in gemms) + a_flops)
