"""Activation memory of plait's block under tensor and sequence parallelism, as it runs.

Derived the way Korthikanti et al. 2022 (§4) derived 34·sbh + 5·as²b for GPT: list every
tensor autograd keeps for backward, per layer and micro-batch, and divide what TP/SP split.
Per rank, with b micro-batch, s sequence, h hidden, a query heads, f SwiGLU width, t = tp,
h_t = h/t, a_t = a/t, f_t = f/t, k_t = this rank's KV width (n_kv·d/t when t divides the KV
heads, one head d otherwise), e = bytes of the activation dtype (4 fp32, 2 bf16), in bytes
(docs/tensor_parallel.md has the table for fp32, docs/planner_memory.md the eager runtime model):

    one RMSNorm, no SP          4·bsh + 4·bs + 2e·bsh        (x in fp32, rsqrt, x·rsqrt or its
                                                               cast, the output)
    one RMSNorm, SP             (4·bsh + 4·bs + e·bsh)/t + e·bsh   (output all-gathered)
    attention: q (RoPE'd), out, the     e·(3·bs·h_t + 2·bs·k_t) + 4·b·a_t·s   (flash kernel: out
      copy of out wo reads, k, v, lse   and its fp32 log-sum-exp; "copy" is 0 when a_t = 1)
    SwiGLU: w1 out, silu out, w3 out,   4e·bs·f_t
      their product
RMSNorm normalises in fp32: it keeps the fp32 input (x itself in fp32, a copy in bf16), the
fp32 rsqrt, the normalised value (fp32) or its cast back to e bytes, and the output. With SP
the first three are sequence chunks, and the linears keep the all-gathered output.
Dropout does not exist in our block, so Korthikanti's mask terms (sbh per dropout) vanish.
For fp32 (e = 4) these are the TP engineer's element counts × 4, unchanged.
Under context parallel s is the rank's share of the sequence: ring attention keeps q, the
packed K/V, the output and its log-sum-exp, the same tensors (measured equal on 1, 2 and 4
context-parallel ranks, tests/test_context_parallel.py).

Recomputation (plait/model/recompute.py, `layer_saved_bytes`): full keeps the block's
input, e·b·s_l·h (s_l = s/t under SP: the residual stream is a sequence chunk); selective
keeps the input and the outputs of the operator groups it does not recompute:

    matmul      e·b·s·(h_t + 2·k_t + h + 2·f_t + h)   (wq, wk, wv, wo, w1, w3, w2: the
                                                        row-parallel outputs before their
                                                        reduction, whole sequence)
    attention   e·b·s·h_t + 4·b·a_t·s                 (the kernel's output and fp32 lse)

The default (recompute attention and element-wise ops) keeps input + matmul; measured to
the byte for tp 1, 2 and 2 + SP (tests/test_recompute.py).
"""

from __future__ import annotations

from plait.model.presets import ModelConfig
from plait.model.recompute_settings import DEFAULT_OPS
from plait.plan.shape import from_model_config, per_rank_bytes, selective_terms

FP32 = 4
# What plait's CPU runtime's attention keeps (plait/model/transformer.py calls
# scaled_dot_product_attention): torch 2.13 on CPU dispatches it, causal or masked, MHA or
# GQA (enable_gqa), fp32 or bf16, to `_scaled_dot_product_flash_attention_for_cpu`, which
# saves q, k, v, the output and an fp32 log-sum-exp (b, a, s): the flash kernel's tensors,
# no s x s probabilities (a bool mask, when given, is kept as an s x s fp32 tensor).
# tests/test_plan_memory.py checks it on this torch.
RUNTIME_ATTENTION = "flash"


def kv_width_per_rank(cfg: ModelConfig, tp: int) -> int:
    """Columns of wk (and wv) on one rank: split when tp divides the KV heads, else one head."""
    if cfg.n_kv_heads % tp == 0:
        return cfg.n_kv_heads * cfg.head_dim // tp
    return cfg.head_dim


def norm_bytes(cfg: ModelConfig, b: int, s: int, tp: int = 1, sp: bool = False,
               act_bytes: int = FP32) -> int:
    """Bytes one RMSNorm keeps for backward (its output included: the next linears' input)."""
    h, t, e = cfg.dim, tp, act_bytes
    if sp:
        return (FP32 * b * s * h + FP32 * b * s + e * b * s * h) // t + e * b * s * h
    return FP32 * b * s * h + FP32 * b * s + 2 * e * b * s * h


def layer_activation_bytes(cfg: ModelConfig, b: int, s: int, tp: int = 1, sp: bool = False,
                           act_bytes: int = FP32) -> int:
    """Bytes one block keeps for backward on one rank (MHA on the flash path)."""
    h, t, e = cfg.dim, tp, act_bytes
    a_t, h_t, f_t = cfg.n_heads // t, h // t, cfg.ffn_dim // t
    k_t = kv_width_per_rank(cfg, t)
    out_copy = b * s * h_t if a_t > 1 else 0  # (b,a,s,d)->(b,s,a·d) is a view for one head
    attention = e * (2 * b * s * h_t + out_copy + 2 * b * s * k_t) + FP32 * b * a_t * s
    mlp = 4 * e * b * s * f_t
    return 2 * norm_bytes(cfg, b, s, t, sp, e) + attention + mlp


def model_activation_bytes(cfg: ModelConfig, b: int, s: int, tp: int = 1, sp: bool = False
                           ) -> int:
    """The whole forward's kept bytes per rank (fp32): layers + embedding, final norm, head,
    loss.

    Outside the blocks: the final norm (whose fp32 input is the last block's output), the
    head's logits kept as the loss's softmax (b·s·V/t; with t = 1 torch's CE keeps
    log-softmax, the same size), and the vocab-parallel bookkeeping (int64 local ids and
    bool masks of b·s, in the embedding and the loss).
    """
    t = tp
    v_t = -(-cfg.vocab_size // t)
    extra = norm_bytes(cfg, b, s, t, sp) + FP32 * b * s * v_t
    if t > 1:
        extra += 2 * (8 * b * s + b * s)  # local ids (int64) + masks (bool): embedding, loss
    return cfg.n_layers * layer_activation_bytes(cfg, b, s, t, sp) + extra


def layer_saved_bytes(cfg: ModelConfig, b: int, s: int, tp: int = 1, sp: bool = False,
                      act_bytes: int = FP32, recompute: str = "none",
                      ops: tuple[str, ...] = DEFAULT_OPS) -> int:
    """Bytes one block keeps between its forward and backward on one rank under
    `recompute` ("none" | "selective" | "full"; selective recomputes the groups `ops`)."""
    if recompute == "none":
        return layer_activation_bytes(cfg, b, s, tp, sp, act_bytes)
    h, t, e = cfg.dim, tp, act_bytes
    block_input = e * b * (s // t if sp else s) * h
    if recompute == "full":
        return block_input
    if recompute != "selective":
        raise ValueError(f"recompute={recompute!r}; use none, selective or full")
    # the runtime's list (plait/plan/shape.py, selective_terms: the planner's too), per rank
    shape = from_model_config(cfg, s)
    kept = selective_terms(shape, e, attention=RUNTIME_ATTENTION, ops=ops)[1:]
    return block_input + int(sum(b * s * per_rank_bytes(term, shape, t, sp) for term in kept))
