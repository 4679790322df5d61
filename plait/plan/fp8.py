"""`--precision fp8`: what float8 changes in a plan (plait/model/fp8.py is the recipe).

Compute: every weight GEMM of a block (attention's projections, the MLP's), forward and
both backward GEMMs, at the GPU's dense float8 peak (`GPU.fp8_peak_ratio` x the bf16
peak, datasheet) and the float8 GEMM curve (the published numbers' `fp8_gemm_max` and
`fp8_gemm_half_flops`, plait/plan/data/gpu_efficiency.json; the bf16 curve where no
float8 measurement was found). The attention core, the LM head and the embedding stay at
the bf16 peak: the recipe keeps them in bf16.

Quantization (`cast_kernel`): dynamic per-tensor scaling reads each tensor once for its
amax and once more to cast it (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning", sec. 4: a scale per tensor from its amax). Per weight GEMM and micro-batch:
forward the input and the weight, backward the output gradient and, again, the input and
the weight (the backward casts from the bf16 tensors the forward saved, with the
forward's scales: no amax). Each amax reads e bytes an element, each cast reads e and
writes 1; priced as memory-bound bytes (plait/plan/memory_bound.py). Under ZeRO-3 the
weights come gathered in float8 (cast once a step on the shard, W / N elements: not
priced), so only the inputs and gradients are cast per micro-batch.

Memory and communication: the states are bf16's (bf16 weights and gradients, fp32
masters and moments), the activations bf16's (the saved tensors are the bf16 inputs);
ZeRO-3 all-gathers the block linears' weights at one byte an element
(memory.LINEAR_GATHER_BYTES) into buffers of that size (memory.comm_buffers).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from plait.plan.compute import Efficiency, Num, float8_gathered_weights
from plait.plan.hardware import GPU
from plait.plan.memory_bound import Kernel
from plait.plan.shape import Shape

FP8 = "fp8"


def is_fp8(precision: str) -> bool:
    """Float8 block GEMMs, around bf16 (`fp8`) or fp32 / float64 (`fp8-fp32`, `fp8-fp64`:
    train.fp8_compute, whose states and activations are that format's)."""
    return precision == FP8 or precision.startswith(FP8 + "-")


def weight_gemm_sides(shape: Shape, tp: Num) -> list[tuple[str, Num, Num]]:
    """(name, input width, output width) a token of each weight GEMM of one layer on one
    rank: a GEMM's weight has input x output elements, its FLOPs are 2 x that a token
    (compute.layer_gemms, whose sums these equal). Dense blocks only (MoE is refused)."""
    h, t = shape.hidden, np.asarray(tp, dtype=float)
    if shape.mla:  # down-projections whole on every tp rank, the rest split by heads
        a = shape.heads
        q_in = shape.q_lora or h
        out = [("wq_a", h, shape.q_lora)] if shape.q_lora else []
        out += [("wq", q_in, a * shape.qk_dim / t),
                ("wkv_a", h, shape.kv_lora + shape.qk_rope),
                ("wkv_b", shape.kv_lora, a * (shape.qk_nope + shape.v_head) / t),
                ("wo", a * shape.v_head / t, h)]
    else:
        out = [("qkv", h, (h + 2 * shape.kv_dim) / t), ("out", h / t, h)]
    mlp_out = shape.ffn / t * (1 if shape.arch == "gpt" else 2)  # SwiGLU: gate and up
    return out + [("mlp in", h, mlp_out), ("mlp out", shape.ffn / t, h)]


def weight_blocks(shape: Shape, tp: Num, block: int) -> Num:
    """The blockwise recipe's B x B blocks of one layer's weights on one rank (partial
    blocks at a width's end counted whole): each weight apart, as the runtime casts them
    (`weight_gemm_sides` fuses QKV and gate+up, whose blocks would differ)."""
    t = np.asarray(tp, dtype=float)
    h = shape.hidden
    if shape.mla:
        attn = [(k, o) for name, k, o in weight_gemm_sides(shape, tp) if name[0] == "w"]
    else:
        attn = [(h, h / t), (h, shape.kv_dim / t), (h, shape.kv_dim / t), (h / t, h)]

    def blocks(ffn: Num, split: Num) -> Num:
        mlp = [(h, ffn / split)] * (1 if shape.arch == "gpt" else 2) + [(ffn / split, h)]
        return sum(np.ceil(k / block) * np.ceil(o / block) for k, o in attn + mlp)

    if not shape.moe:
        return blocks(shape.ffn, t)
    # an MoE layer: the shared experts' linears (replicated over tp), the routed experts
    # gathered at the parameters' bytes; the dense first layers averaged in
    moe = blocks(shape.shared_experts * shape.expert_ffn, 1.0) if shape.shared_experts \
        else blocks(0.0, 1.0)
    dense = blocks(shape.ffn, t)
    return ((shape.layers - shape.dense_layers) * moe + shape.dense_layers * dense) / shape.layers


def gathered_linear(shape: Shape, tp: Num, precision: str) -> Num:
    """A layer's weights ZeRO-3 gathers in float8 under `precision` (0 but for fp8)."""
    return float8_gathered_weights(shape, tp) if is_fp8(precision) else 0.0


def scale_bytes(precision: str) -> int:
    """A block's amax as ZeRO-3 all-reduces it: fp32, float64 around float64."""
    return 8 if precision == FP8 + "-fp64" else 4


def cast_kernel(shape: Shape, tokens: Num, tp: Num, e: int, zero: int,
                blockwise: bool = False) -> Kernel:
    """The amax and cast kernels of one layer's weight GEMMs for `tokens` tokens of one
    rank (the module docstring); `e` bytes an element of a bf16 tensor. `blockwise`
    (train.fp8_recipe): backward tiles the output gradient twice (1 x B for the input
    gradient, B x 1 for the weight gradient) and the input again in B x 1 tiles, each a
    new amax and cast; the weight's blocks re-cast with their scales (the scales
    themselves, 4 bytes a tile, left out: 1/B of a cast's bytes)."""
    n = np.asarray(tokens, dtype=float)
    sides = weight_gemm_sides(shape, tp)
    x = n * sum(k for _, k, _ in sides)  # the inputs' elements
    g = n * sum(o for _, _, o in sides)  # the output gradients'
    w = 0.0 if zero >= 3 else sum(k * o for _, k, o in sides)  # ZeRO-3: gathered in fp8
    scaled, recast = 2 * e + 1, e + 1  # amax + cast; a cast with a known scale
    per_w = 0 if zero >= 3 else 1
    count = len(sides)
    # launches: fused, an amax and a cast kernel a tensor (a re-cast one); eager torch,
    # abs + amax, then float, mul, clamp, to (plait/model/fp8.py)
    if blockwise:  # g twice and x anew, each amax + cast; w's blocks re-cast
        return Kernel("float8 amax + casts", scaled * (x + w), scaled * (2 * g + x)
                      + recast * w, (count * 2 * (1 + per_w), count * (6 + per_w)),
                      (count * 6 * (1 + per_w), count * (18 + 4 * per_w)))
    return Kernel("float8 amax + casts", scaled * (x + w), scaled * g + recast * (x + w),
                  (count * 2 * (1 + per_w), count * (2 + 1 + per_w)),
                  (count * 6 * (1 + per_w), count * (6 + 4 + 4 * per_w)))


def weight_gemms(precision: str, gpu: GPU, eff: Efficiency, gemm_scale: float
                 ) -> tuple[Efficiency, float] | None:
    """The block weight GEMMs' (efficiency, peak scale) under `precision`: float8's curve
    at the float8 peak; None (the bf16 rate) for any other precision. A GPU without a
    float8 peak (the placeholder device of config_inputs: bytes only) keeps bf16's."""
    if not is_fp8(precision):
        return None
    curve = replace(eff, gemm_max=eff.fp8_gemm_max or eff.gemm_max,
                    gemm_half=eff.fp8_gemm_half or eff.gemm_half)
    return curve, gemm_scale * (gpu.fp8_peak_ratio or 1.0)


def plan_problems(shape: Shape, gpu: GPU, efficiency: str, profiled: bool) -> list[str]:
    """Why `plait plan --precision fp8` cannot price this input, each naming the fix."""
    out = []
    if shape.moe:
        out.append("--precision fp8 is not built for MoE models (the routed experts' "
                   "grouped GEMMs have no float8 path in plait train): use --precision bf16")
    if profiled:
        out.append("--precision fp8: a measured profile (--hardware) has no float8 GEMM "
                   "rate (plait's CPU runtime emulates float8); plan with a GPU preset "
                   "(--gpu) or use --precision bf16")
    elif gpu.fp8_peak_ratio <= 0:
        out.append(f"--precision fp8: the {gpu.name} has no float8 tensor cores (an A100 "
                   "runs bf16, TF32 and INT8 only); use --precision bf16, or a GPU that has "
                   "them (h100-sxm, h800, h200, b200)")
    elif efficiency != "published":
        out.append("--precision fp8 is priced with the published GPU numbers only (the "
                   "fitted constants come from bf16 A100 runs): drop --efficiency fitted, "
                   "or use --precision bf16")
    return out


def hardware_lines(gpu: GPU, eff: Efficiency, entry: dict[str, Any] | None) -> list[str]:
    """The float8 numbers a plan used and their sources (`entry`: the GPU's published
    numbers, plait/plan/gpu_data.py)."""
    peak = gpu.peak_flops * gpu.fp8_peak_ratio
    line = f"  Float8 (--precision fp8): the blocks' weight GEMMs at {peak / 1e12:,.0f} " \
           "TFLOP/s dense (datasheet: plait/plan/hardware.py)"
    if entry is not None:
        cap, half = entry["fp8_gemm_max"], entry["fp8_gemm_half_flops"]
        isolated = cap["value"] or entry["gemm_max"]["value"]
        ceiling = f"ceiling {isolated:.1%} of that peak (isolated)" + (
            "" if cap["value"] else ", the bf16 fraction (no float8 measurement found)")
        line += f", {ceiling}: {cap['source']}; half of it at " \
                f"{eff.fp8_gemm_half or eff.gemm_half:.3g} FLOPs: {half['source']}"
    return [line + "; attention, the head and the embedding at the bf16 peak; each "
            "linear's amax and casts (input, weight, output gradient) priced as "
            "memory-bound bytes; ZeRO-3 gathers the block linears' weights at 1 byte. MFU "
            "is against the bf16 peak, as for a bf16 run."]
