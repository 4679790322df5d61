"""Activation memory of plait's block under tensor and sequence parallelism (fp32).

Derived the way Korthikanti et al. 2022 (§4) derived 34·sbh + 5·as²b for GPT: list every
tensor autograd keeps for backward, per layer and micro-batch, and divide what TP/SP split.
Per rank, with b micro-batch, s sequence, h hidden, a query heads, f SwiGLU width, t = tp,
h_t = h/t, a_t = a/t, f_t = f/t, k_t = this rank's KV width (n_kv·d/t when t divides the KV
heads, one head d otherwise), in elements of 4 bytes (docs/tensor_parallel.md has the table):

    norms + residual (two sub-layers)   no SP: 6·bsh + 2·bs    SP: (4·bsh + 2·bs)/t + 2·bsh
    attention: q (RoPE'd), out, the     3·bs·h_t + 2·bs·k_t + b·a_t·s   (flash kernel: out and
      copy of out wo reads, k, v, lse   its log-sum-exp; "copy" is 0 when a_t = 1: a view)
    SwiGLU: w1 out, silu out, w3 out,   4·bs·f_t
      their product
Without SP each sub-layer keeps its input x, x·rsqrt and the norm output (the linears' input);
with SP the first two are sequence chunks, and the linears keep the all-gathered input.
Dropout does not exist in our block, so Korthikanti's mask terms (sbh per dropout) vanish.
"""

from __future__ import annotations

from plait.model.presets import ModelConfig

FP32 = 4


def kv_width_per_rank(cfg: ModelConfig, tp: int) -> int:
    """Columns of wk (and wv) on one rank: split when tp divides the KV heads, else one head."""
    if cfg.n_kv_heads % tp == 0:
        return cfg.n_kv_heads * cfg.head_dim // tp
    return cfg.head_dim


def layer_activation_bytes(cfg: ModelConfig, b: int, s: int, tp: int = 1, sp: bool = False
                           ) -> int:
    """Bytes one block keeps for backward on one rank (fp32, MHA on the flash path)."""
    h, t = cfg.dim, tp
    a_t, h_t, f_t = cfg.n_heads // t, h // t, cfg.ffn_dim // t
    k_t = kv_width_per_rank(cfg, t)
    if sp:
        norms = (4 * b * s * h + 2 * b * s) // t + 2 * b * s * h
    else:
        norms = 6 * b * s * h + 2 * b * s
    out_copy = b * s * h_t if a_t > 1 else 0  # (b,a,s,d)->(b,s,a·d) is a view for one head
    attention = 2 * b * s * h_t + out_copy + 2 * b * s * k_t + b * a_t * s
    mlp = 4 * b * s * f_t
    return FP32 * (norms + attention + mlp)


def model_activation_bytes(cfg: ModelConfig, b: int, s: int, tp: int = 1, sp: bool = False
                           ) -> int:
    """The whole forward's kept bytes per rank: layers + embedding, final norm, head, loss.

    Outside the blocks: the last block's output and the final norm (as one sub-layer's norm
    terms), the head's logits kept as the loss's softmax (b·s·V/t; with t = 1 torch's CE
    keeps log-softmax, the same size), and the vocab-parallel bookkeeping (int64 local ids
    and bool masks of b·s, in the embedding and the loss).
    """
    h, t = cfg.dim, tp
    v_t = -(-cfg.vocab_size // t)
    last_out = b * s * h // t if sp else b * s * h
    if sp:
        final_norm = (b * s * h + b * s) // t + b * s * h
    else:
        final_norm = 2 * b * s * h + b * s
    loss = b * s * v_t
    extra = FP32 * (last_out + final_norm + loss)
    if t > 1:
        extra += 2 * (8 * b * s + b * s)  # local ids (int64) + masks (bool): embedding, loss
    return cfg.n_layers * layer_activation_bytes(cfg, b, s, t, sp) + extra
