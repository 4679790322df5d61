"""The memory-bound kernels of a training step on a GPU, priced from first principles:
each kernel's bytes read and written (from the model's shape) over the GPU's achievable
HBM bandwidth (the datasheet's times the fraction a STREAM-like copy reaches on that GPU:
plait/plan/data/gpu_efficiency.json), and the CPU's cost of issuing each kernel, which
bounds a pass whose kernels are shorter than their launches.

Priced here, per layer and micro-batch on one rank (`layer_kernels`): the two norms
(RMSNorm or LayerNorm), RoPE (llama), the MLP's activation (SwiGLU or GeLU), the two
residual adds (with dropout's mask in the GPT block), and with the math attention kernel
its softmax and dropout over the score matrix (flash keeps them on chip). Per micro-batch
on the last stage (`loss_kernels`): the final norm and the cross-entropy over the
vocabulary. Per step (`optimizer_bytes_per_param`): AdamW's reads and writes of the
master weights, moments and gradients, the bf16 copy of the weights, and gradient
clipping's norm. Recompute re-runs a layer's forward kernels through the planner's
recompute terms (plait/plan/compute.py recompute_seconds).

Byte counts are each kernel's inputs and outputs once for a fused stack (one kernel a
norm, activation, RoPE); an eager PyTorch stack (`--fused-kernels no`) runs one kernel per
operator, each reading its inputs and writing its output to HBM, so its bytes are
counted operator by operator (`Kernel.eager_bytes`: RMSNorm's fp32 upcast, square, mean,
scale, cast back and weight; SwiGLU's SiLU and product; RoPE's complex product in fp32;
math attention's scale, mask, softmax and dropout apart; the loss's fp32 log-softmax),
the backward as autograd runs each operator's backward. LayerNorm and GeLU are one
PyTorch kernel each and move the same bytes either way.
Only the published GPU path uses this (Efficiency.hbm_fraction > 0); a measured CPU
profile carries its own element-wise rate (Efficiency.elementwise_bw) and the fitted
constants their fitted passes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from plait.plan.compute import Efficiency, LayerTimes, layer_gemms
from plait.plan.hardware import GPU
from plait.plan.memory import state_bytes
from plait.plan.shape import Shape

Num = Any


@dataclass(frozen=True)
class Kernel:
    """One memory-bound kernel of a layer: bytes moved forward and backward, and the
    kernels a fused and an eager stack launch for it (forward, backward)."""

    name: str
    fwd_bytes: Num
    bwd_bytes: Num
    fused: tuple[int, int]
    eager: tuple[int, int]
    # (forward, backward) bytes of an eager stack's operators (None: the fused bytes)
    eager_bytes: tuple[Num, Num] | None = None

    def bytes(self, fused: bool) -> tuple[Num, Num]:
        """(forward, backward) bytes under a fused or an eager stack."""
        if fused or self.eager_bytes is None:
            return self.fwd_bytes, self.bwd_bytes
        return self.eager_bytes


def _f(x: Num) -> Num:
    return np.asarray(x, dtype=float)


def layer_kernels(shape: Shape, tokens: Num, tp: Num, sp: bool, e: int, attention: str,
                  moe_split: Num = 1) -> list[Kernel]:
    """The memory-bound kernels of one layer for `tokens` tokens of one rank (e bytes an
    activation element). Under sequence parallelism the norms and residual adds see
    tokens / tp; otherwise every tp rank runs them on all its tokens."""
    t, tp_ = _f(tokens), _f(tp)
    h = shape.hidden
    ts = t / tp_ if sp else t  # tokens of the norms, residual adds, dropout
    x = ts * h * e  # one hidden-state tensor
    gpt = shape.arch == "gpt"
    # norm: forward reads x, writes y; backward reads x and dy, writes dx (the weight's
    # gradient is a reduction over tokens, small)
    n = ts * h  # its elements
    # eager RMSNorm, per element: x.float() (e + 4), pow (8), mean (4), x * rsqrt (8),
    # type_as (4 + e), * weight (2e); backward: each operator's (6e + 52, counted the same)
    norm_eager = None if gpt else (2 * n * (28 + 4 * e), 2 * n * (52 + 6 * e))
    out = [Kernel("norms (2)", 2 * 2 * x, 2 * 3 * x, (2, 4), (2, 4) if gpt else (16, 24),
                  norm_eager)]
    # residual add (GPT: with the dropout before it): forward reads the branch's output
    # and the stream, writes their sum (and a 1-byte mask); backward adds the branch's
    # input gradient into the stream's (reads two, writes one; dropout reads its mask)
    mask = ts * h if gpt else 0.0
    out.append(Kernel("residual adds (2)", 2 * (3 * x + mask), 2 * (3 * x + mask), (2, 2),
                      (4, 4) if gpt else (2, 2)))
    if not gpt:  # RoPE on the rank's queries and keys: read and written, both passes
        if shape.mla:
            qk = t * shape.heads * shape.qk_rope * 2 / tp_
        else:
            qk = t * (h + shape.kv_dim) / tp_
        # eager: the complex product in fp32 (cast in, multiply, cast out), both passes
        rope_eager = (qk * (2 * e + 16), qk * (2 * e + 16))
        out.append(Kernel("rope", 2 * qk * e, 2 * qk * e, (1, 1), (8, 8), rope_eager))
    out.append(_mlp_kernel(shape, t, tp_, e, moe_split))
    if attention == "math":  # the masked softmax and dropout over the full score matrix
        p = t * shape.seq * shape.heads / tp_  # elements of the probabilities
        # eager: scale, mask, softmax and dropout each read and write the scores
        out.append(Kernel("softmax + dropout (math attention)", 2 * p * e + (2 * p * e + p),
                          3 * p * e + (3 * p * e + p), (2, 2), (4, 3),
                          (3 * 2 * p * e + (2 * p * e + p), 3 * 3 * p * e + (3 * p * e + p))))
    return out


def _mlp_kernel(shape: Shape, t: Num, tp: Num, e: int, moe_split: Num) -> Kernel:
    """The MLP's activation: GeLU reads and writes the ffn-wide tensor (backward: reads
    its input and dy, writes dx); SwiGLU reads gate and up, writes their product
    (backward: reads gate, up, dy, writes both gradients). An MoE layer's routed tokens
    (top_k a token) and its shared experts, plus the permute to and from expert order
    (a copy of the hidden states each way, both passes)."""
    if shape.arch == "gpt":
        a = t * shape.ffn / tp * e
        return Kernel("gelu", 2 * a, 3 * a, (1, 1), (2, 2))
    if not shape.moe:
        a = t * shape.ffn / tp * e
        # eager: silu(gate) (2 a), its product with up (3 a); backward: the product's two
        # gradients (6 a) and silu's (3 a)
        return Kernel("swiglu", 3 * a, 5 * a, (1, 1), (2, 4), (5 * a, 9 * a))
    ms = _f(moe_split)
    routed = t * shape.top_k / ms
    a = (routed + t / ms * shape.shared_experts) * shape.expert_ffn * e
    perm = 2 * 2 * routed * shape.hidden * e
    return Kernel("swiglu + expert permutes", 3 * a + perm, 5 * a + perm, (3, 3), (6, 8))


def loss_kernels(shape: Shape, tokens: Num, tp: Num, sp: bool, e: int) -> Kernel:
    """The final norm and the cross-entropy over the (vocab-parallel) logits of one
    micro-batch: forward casts the logits to fp32 (reads e, writes 4 bytes an element)
    and reduces them (reads 4: the log-sum-exp); backward reads the fp32 logits and
    writes the gradient (e), which the head's GEMMs read."""
    t, tp_ = _f(tokens), _f(tp)
    ts = t / tp_ if sp else t
    x = ts * shape.hidden * e
    v = t * shape.vocab / tp_
    # eager: log_softmax writes its fp32 output and its backward reads it and the
    # gradient (the fused loss keeps only the log-sum-exp)
    return Kernel("final norm + cross-entropy", 2 * x + v * (e + 4 + 4), 3 * x + v * (4 + e),
                  (3, 3), (8, 8), (2 * x + v * (e + 4 + 8), 3 * x + v * (4 + 12 + e)))


def optimizer_bytes_per_param(precision: str, optimizer: str) -> float:
    """Bytes an optimizer step moves per parameter it updates (its shard under ZeRO):
    reads and writes the fp32 states (master weights where kept, Adam's two moments:
    `state_bytes`), reads the gradient, writes the low-precision weights the next step's
    GEMMs read (mixed precision), and reads the gradient once more for clipping's norm
    (Loshchilov & Hutter 2019's AdamW; PyTorch's clip_grad_norm_)."""
    p, g, k = state_bytes(precision, optimizer)
    cast = p if precision != "fp32" else 0
    return 2 * k + g + cast + g


@dataclass(frozen=True)
class PassTimes:
    """Seconds of one layer's memory-bound kernels, forward and backward, with the
    launch-bound extra folded in, and the kernels each pass launches."""

    fwd: Num
    bwd: Num
    fwd_kernels: float
    bwd_kernels: float


def layer_pass_times(kernels: list[Kernel], bw: float, launch_s: float, fused: bool,
                     gemms: int, gemm_fwd: Num, attn_fwd: Num) -> PassTimes:
    """Memory-bound seconds of a layer's forward and backward: bytes over `bw`, plus
    where the CPU issues the pass's kernels (`launch_s` each: the GEMMs, attention's and
    these) slower than the GPU runs them, the difference (the GPU waits on launches)."""
    counts = [k.fused if fused else k.eager for k in kernels]
    fwd_b = sum(k.bytes(fused)[0] for k in kernels)
    bwd_b = sum(k.bytes(fused)[1] for k in kernels)
    # + attention's kernels: one forward, three backward (FlashAttention-2's
    # preprocessing, main and dq conversion kernels)
    n_f = float(sum(c[0] for c in counts) + gemms + 1)
    n_b = float(sum(c[1] for c in counts) + 2 * gemms + 3)
    t_f, t_b = fwd_b / bw, bwd_b / bw
    gpu_f = gemm_fwd + attn_fwd + t_f
    gpu_b = 2 * (gemm_fwd + attn_fwd) + t_b
    t_f = t_f + np.maximum(n_f * launch_s - gpu_f, 0.0)
    t_b = t_b + np.maximum(n_b * launch_s - gpu_b, 0.0)
    return PassTimes(t_f, t_b, n_f, n_b)


def achievable_bw(gpu: GPU, eff: Efficiency) -> float:
    """HBM bytes/s a streaming kernel reaches: the datasheet's times the measured
    fraction (Efficiency.hbm_fraction)."""
    return gpu.hbm_bw * eff.hbm_fraction


def priced(eff: Efficiency) -> bool:
    """Whether this module prices the memory-bound kernels (the published GPU numbers)."""
    return eff.hbm_fraction > 0


def with_memory_bound(lt: LayerTimes, shape: Shape, tokens: Num, tp: Num, sp: bool, e: int,
                      attention: str, moe_split: Num, gpu: GPU, eff: Efficiency,
                      fused: bool, extra: tuple[Kernel, ...] = ()) -> LayerTimes:
    """`lt` with its element-wise terms priced here (forward and backward apart); `extra`:
    more kernels of the layer (float8's casts, plait/plan/fp8.py)."""
    kernels = layer_kernels(shape, tokens, tp, sp, e, attention, moe_split) + list(extra)
    n_gemms = len(layer_gemms(shape, 1, 1))
    pt = layer_pass_times(kernels, achievable_bw(gpu, eff), eff.launch_seconds, fused,
                          n_gemms, lt.gemm_fwd, lt.attn_fwd)
    return replace(lt, elementwise_fwd=pt.fwd, elementwise_bwd=pt.bwd)


def loss_seconds(shape: Shape, tokens: Num, tp: Num, sp: bool, e: int, gpu: GPU,
                 eff: Efficiency, fused: bool = True) -> Num:
    """The final norm and the cross-entropy of one micro-batch, forward + backward."""
    return sum(loss_kernels(shape, tokens, tp, sp, e).bytes(fused)) / achievable_bw(gpu, eff)


def optimizer_seconds(params: Num, precision: str, optimizer: str, gpu: GPU,
                      eff: Efficiency) -> Num:
    """The optimizer step over `params` parameters (the rank's shard)."""
    return params * optimizer_bytes_per_param(precision, optimizer) / achievable_bw(gpu, eff)
