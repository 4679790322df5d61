"""The planner's view of a model: shapes, parameter counts per layer, saved tensors.

Two block flavours are modelled:

* ``llama`` — plait's own block (plait/model/transformer.py): RMSNorm, GQA attention with
  RoPE, SwiGLU MLP (three matrices), no biases, no dropout; optionally MoE MLPs.
* ``gpt`` — the GPT block of Korthikanti et al. 2022 (LayerNorm, MHA, 4h GeLU MLP, biases,
  dropout, attention scores materialised), generalised to any MLP width (`ffn`) and to
  GQA (`kv_heads`). The calibration runs were measured with it. plait's runtime
  (plait/model/transformer.py) does not build this block: the planner describes it, and
  `plait plan` says so; `plait plan --emit-config` refuses it.

MoE (llama only): `experts` routed experts of width `expert_ffn`, `top_k` per token,
`shared_experts` always on; the first `dense_layers` layers keep a dense MLP of width
`ffn` (DeepSeek-V3: 3), the rest are MoE.

The activation memory of a layer is written as a list of saved tensors, each with its size
per token and how it shards, so every term is visible and the closed forms of Korthikanti
et al. fall out as sums (see `activation_terms`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.model.presets import PRESETS, ModelConfig
from plait.model.recompute_settings import DEFAULT_OPS, GROUPS

Num = Any


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    arch: str = "llama"  # "llama" (ours) | "gpt" (Korthikanti et al. 2022's block)
    tie_embeddings: bool = False
    name: str = "custom"
    dense_layers: int = 0  # MoE models: the first layers with a dense MLP (width ffn)
    # multi-head latent attention (llama block; plait/model/mla.py): the latents' widths
    # (q_lora 0: queries straight from x) and the per-head query/key and value widths
    attention: str = "gqa"  # "gqa" | "mla"
    q_lora: int = 0
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    mtp_depth: int = 0  # DeepSeek-V3's multi-token prediction modules: FLOPs counted

    # ---- derived sizes ---------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def mla(self) -> bool:
        return self.attention == "mla"

    @property
    def qk_dim(self) -> int:
        """Per head, the width of a query and of a key."""
        return self.qk_nope + self.qk_rope if self.mla else self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head if self.mla else self.head_dim

    @property
    def kv_exchange_dim(self) -> int:
        """Per token, the K and V features context parallel moves (over every head, before
        tp's split): GQA's KV heads, or MLA's per-head K and V after the up-projection."""
        return self.heads * (self.qk_dim + self.v_dim) if self.mla else 2 * self.kv_dim

    def mla_replicated_params(self) -> int:
        """MLA's down-projections and latent norms: whole on every tp rank."""
        if not self.mla:
            return 0
        q = self.hidden * self.q_lora + self.q_lora
        return q + self.hidden * (self.kv_lora + self.qk_rope) + self.kv_lora

    def mla_split_params(self) -> int:
        """MLA's up-projections and output projection: split over tp by heads."""
        a = self.heads
        q = (self.q_lora or self.hidden) * a * self.qk_dim
        return q + self.kv_lora * a * (self.qk_nope + self.v_head) + a * self.v_head * \
            self.hidden

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """Layers with an MoE MLP (0 for a dense model)."""
        return self.layers - self.dense_layers if self.moe else 0

    def attn_params(self) -> int:
        """Attention (and norm) parameters of one layer."""
        h, kv = self.hidden, self.kv_dim
        if self.arch == "gpt":  # q, k, v, out with biases; two LayerNorms (weight + bias)
            return 2 * h * h + 2 * h * kv + (2 * h + 2 * kv) + 4 * h
        if self.mla:
            return self.mla_replicated_params() + self.mla_split_params() + 2 * h
        return 2 * h * h + 2 * h * kv + 2 * h  # wq, wo, wk, wv, two RMSNorm weights

    def norm_params(self) -> int:
        """One layer's normalisation weights (in attn_params): whole on every tp rank."""
        return 4 * self.hidden if self.arch == "gpt" else 2 * self.hidden

    def tp_whole_params(self) -> int:
        """One layer's attention-side weights whole on every tp rank: the norms, and
        MLA's down-projections and latent norms."""
        return self.norm_params() + self.mla_replicated_params()

    def dense_mlp_params(self) -> int:
        """MLP parameters that every rank of a TP group shares out (dense MLP or shared
        experts and the router of an MoE layer)."""
        h = self.hidden
        if self.arch == "gpt":
            return 2 * h * self.ffn + self.ffn + h
        if self.moe:
            return 3 * h * self.expert_ffn * self.shared_experts + h * self.experts
        return 3 * h * self.ffn

    def expert_params(self) -> int:
        """Routed-expert parameters of one layer (sharded by expert parallelism)."""
        return 3 * self.hidden * self.expert_ffn * self.experts if self.moe else 0

    def layer_params(self) -> int:
        """Parameters of one layer (an MoE layer in an MoE model)."""
        return self.attn_params() + self.dense_mlp_params() + self.expert_params()

    def dense_layer_params(self) -> int:
        """Parameters of one of an MoE model's leading dense layers (MLP width ffn)."""
        return self.attn_params() + 3 * self.hidden * self.ffn

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        """Output layer (and final norm); 0 extra weights when tied to the embedding."""
        norm = 2 * self.hidden if self.arch == "gpt" else self.hidden  # LayerNorm: + bias
        return norm + (0 if self.tie_embeddings else self.vocab * self.hidden)

    def num_params(self) -> int:
        dense = self.dense_layers if self.moe else 0
        return ((self.layers - dense) * self.layer_params() + dense * self.dense_layer_params()
                + self.embedding_params() + self.head_params())

    def dense_version(self) -> Shape:
        """The shape of an MoE model's dense layers (MLP width ffn), for their FLOPs."""
        from dataclasses import replace

        return replace(self, experts=0, top_k=0, expert_ffn=0, shared_experts=0,
                       dense_layers=0)


def from_model_config(cfg: ModelConfig, seq: int | None = None, name: str = "custom") -> Shape:
    return Shape(
        layers=cfg.n_layers, hidden=cfg.dim, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads,
        ffn=cfg.ffn_dim, vocab=cfg.vocab_size, seq=seq or cfg.max_seq_len,
        experts=cfg.n_experts, top_k=cfg.top_k, expert_ffn=cfg.expert_ffn_dim,
        shared_experts=cfg.n_shared_experts, tie_embeddings=cfg.tie_embeddings, name=name,
        dense_layers=cfg.n_dense_layers if cfg.n_experts else 0,
        attention=cfg.attention, q_lora=cfg.q_lora_rank, kv_lora=cfg.kv_lora_rank,
        qk_nope=cfg.qk_nope_head_dim, qk_rope=cfg.qk_rope_head_dim, v_head=cfg.v_head_dim,
        mtp_depth=cfg.mtp_depth,
    )


def from_preset(name: str, seq: int | None = None) -> Shape:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return from_model_config(PRESETS[name], seq, name)


def gpt_shape(layers: int, hidden: int, heads: int, seq: int, vocab: int = 51200,
              name: str = "gpt") -> Shape:
    """Korthikanti et al.'s GPT block: 4h GeLU MLP; vocab 51200 (Megatron's padded GPT-2
    vocabulary; the calibration file notes it is not given for these runs)."""
    return Shape(layers, hidden, heads, heads, 4 * hidden, vocab, seq, arch="gpt", name=name)


# ---- saved tensors of one layer ------------------------------------------------------

# The attention kernel decides what attention keeps for backward and what it computes.
#   flash  FlashAttention (Dao et al. 2022, sec. 3.1) and the memory-efficient kernels:
#          the output and one fp32 log-sum-exp per head and query; causal masking skips the
#          blocks above the diagonal (half the s x s work). What SDPA runs on GPUs, and what
#          plait's CPU runtime runs (`_scaled_dot_product_flash_attention_for_cpu`, with GQA
#          too: plait/plan/activations.py, RUNTIME_ATTENTION).
#   math   the unfused maths: softmax(q k^T) materialised, a*s probabilities per token kept
#          (Korthikanti et al. 2022's GPT block, which also keeps its dropout mask and
#          output), the full masked s x s matrix computed.
ATTENTION = ("flash", "math")
ATTENTION_HELP = {"flash": "keeps the output + an fp32 log-sum-exp per head, computes half "
                           "the causal scores",
                  "math": "keeps the a*s softmax probabilities per token too, computes the "
                          "full masked score matrix"}


def check_attention(attention: str) -> None:
    if attention not in ATTENTION:
        raise ValueError(f"unknown attention kernel {attention!r}; use one of "
                         f"{', '.join(ATTENTION)}")


@dataclass(frozen=True)
class Saved:
    """One tensor a layer keeps for its backward, per token (of the local sequence).

    bytes_per_token: its size per token; `tp`: split by tensor parallelism (heads / FFN
    columns); `kv`: a KV-width tensor (with `tp`: one head per rank when tp exceeds the KV
    heads); `whole`: split by neither (a row-parallel matmul's output before its
    reduction: every tp rank holds all tokens' partial sums); otherwise it is a full-hidden
    tensor that only sequence parallelism splits. `scores`: an s-long tensor per head (the
    math kernel's probabilities), what Korthikanti et al.'s selective recompute drops.
    `keep_full`: the one tensor full recompute keeps (the layer input).
    """

    name: str
    bytes_per_token: float
    tp: bool = False
    scores: bool = False
    keep_full: bool = False
    kv: bool = False
    whole: bool = False


def per_rank_bytes(term: Saved, shape: Shape, tp: Num, sp: bool) -> Num:
    """Bytes per (local) token of `term` on one tensor-parallel rank."""
    tp = np.asarray(tp, dtype=float)
    if term.whole:
        return term.bytes_per_token + 0 * tp
    if term.tp and term.kv:  # tp > KV heads: each rank keeps one KV head
        one_head = term.bytes_per_token * shape.head_dim / shape.kv_dim
        return np.where(np.mod(shape.kv_heads, tp) == 0, term.bytes_per_token / tp, one_head)
    if term.tp or sp:
        return term.bytes_per_token / tp
    return term.bytes_per_token + 0 * tp


def _attention_kept(shape: Shape, e: int, s: float, attention: str) -> list[Saved]:
    """What the attention kernel itself keeps beyond its inputs q, k, v and its output."""
    a = shape.heads
    if attention == "flash":
        return [Saved("log-sum-exp (fp32)", 4 * a, tp=True)]
    if shape.arch == "gpt":  # Korthikanti's softmax, its dropout mask and output
        return [Saved("softmax output", e * a * s, tp=True, scores=True),
                Saved("attn dropout mask", a * s, tp=True, scores=True),
                Saved("dropout output", e * a * s, tp=True, scores=True)]
    return [Saved("softmax output", e * a * s, tp=True, scores=True)]


def activation_terms(shape: Shape, act_bytes: int = 2, seq: float | None = None,
                     attention: str = "flash") -> list[Saved]:
    """The tensors one layer saves for its backward pass with nothing recomputed, per token.

    `seq` is the key length each query attends to (the full sequence, also under context
    parallelism, whose rank holds its share of the queries against all s keys). `attention`: the
    kernel (ATTENTION): flash keeps a log-sum-exp, math the probabilities.
    gpt + math: Korthikanti et al. 2022, section 4.1 (attention 11sbh + 5as^2b, MLP 19sbh,
    LayerNorms 4sbh, with 2-byte activations and 1-byte dropout masks); with flash the
    dropout masks of the scores are regenerated from the RNG state, not kept.
    llama: counted from plait's block with fused RMSNorm/SwiGLU kernels and no dropout.
    """
    check_attention(attention)
    h, e, kv = shape.hidden, act_bytes, shape.kv_dim
    s = shape.seq if seq is None else seq
    kept = _attention_kept(shape, e, s, attention)
    if shape.arch == "gpt":  # Korthikanti's MHA, 4h terms written for any kv and ffn
        return [
            Saved("ln1 input", e * h, keep_full=True),
            Saved("qkv input", e * h),
            Saved("q, k", e * (h + kv), tp=True),
            *kept,
            Saved("v", e * kv, tp=True),
            Saved("out-proj input", e * h, tp=True),
            Saved("attn out dropout mask", h),
            Saved("ln2 input", e * h),
            Saved("fc1 input", e * h),
            Saved("gelu input", e * shape.ffn, tp=True),
            Saved("fc2 input", e * shape.ffn, tp=True),
            Saved("mlp dropout mask", h),
        ]
    terms = [
        Saved("attn norm input", e * h, keep_full=True),
        Saved("qkv input (norm out)", e * h),
        *(_mla_terms(shape, e) if shape.mla else [
            Saved("q, k after RoPE", e * (h + kv), tp=True),
            Saved("v", e * kv, tp=True)]),
        *kept,
        Saved("attention output", e * shape.heads * shape.v_dim, tp=True),
        Saved("mlp norm input", e * h),
        Saved("mlp input (norm out)", e * h),
    ]
    if shape.moe:
        k, fe = shape.top_k, shape.expert_ffn
        terms += [
            Saved("router logits", 4 * shape.experts, tp=True),
            Saved("dispatched tokens", e * k * h, tp=True),
            Saved("expert gate, up, product", 3 * e * k * fe, tp=True),
            Saved("combine input", e * k * h, tp=True),
        ]
        if shape.shared_experts:
            terms.append(Saved("shared expert gate, up, product",
                               3 * e * shape.shared_experts * fe, tp=True))
    else:
        terms.append(Saved("gate, up, product", 3 * e * shape.ffn, tp=True))
    return terms


def _mla_terms(shape: Shape, e: int) -> list[Saved]:
    """What multi-head latent attention keeps before its core (plait/model/mla.py): the
    latents, computed whole on every tp rank from the whole sequence (`whole`), and the
    per-head q, k (with the shared RoPE key broadcast) and v of this rank's heads."""
    a = shape.heads
    latents = [Saved("kv latent + RoPE key, its norm out", e * (2 * shape.kv_lora
                                                              + 2 * shape.qk_rope),
                     whole=True)]
    if shape.q_lora:
        latents.append(Saved("q latent, its norm out", 2 * e * shape.q_lora, whole=True))
    return latents + [Saved("q, k after RoPE", 2 * e * a * shape.qk_dim, tp=True),
                      Saved("v", e * a * shape.v_dim, tp=True)]


def _mla_matmul_outputs(shape: Shape, e: int) -> list[Saved]:
    """MLA's weight matmul outputs: the down-projections whole (replicated over tp), the
    up-projections by heads, the output projection before its reduction."""
    a = shape.heads
    out = [Saved("wkv_a output", e * (shape.kv_lora + shape.qk_rope), whole=True),
           Saved("wkv_b output", e * a * (shape.qk_nope + shape.v_head), tp=True),
           Saved("wq_b (or wq) output", e * a * shape.qk_dim, tp=True),
           Saved("wo output (before its reduction)", e * shape.hidden, whole=True)]
    if shape.q_lora:
        out.append(Saved("wq_a output", e * shape.q_lora, whole=True))
    return out


def _matmul_outputs(shape: Shape, e: int) -> list[Saved]:
    """The outputs of a layer's weight matmuls (plait/model/recompute.py's "matmul" group:
    aten.mm / addmm / _grouped_mm), per token; the row-parallel ones (attention's output
    projection, the MLP's down projection) before their reduction, hence `whole`."""
    h, kv = shape.hidden, shape.kv_dim
    attn = [Saved("wq output", e * h, tp=True), Saved("wk, wv outputs", 2 * e * kv, tp=True,
                                                      kv=True),
            Saved("wo output (before its reduction)", e * h, whole=True)]
    if shape.mla:
        attn = _mla_matmul_outputs(shape, e)
    if shape.arch == "gpt":
        return attn + [Saved("fc1 output", e * shape.ffn, tp=True),
                       Saved("fc2 output (before its reduction)", e * h, whole=True)]
    if not shape.moe:
        return attn + [Saved("w1, w3 outputs", 2 * e * shape.ffn, tp=True),
                       Saved("w2 output (before its reduction)", e * h, whole=True)]
    k, fe, ns = shape.top_k, shape.expert_ffn, shape.shared_experts
    out = attn + [Saved("router logits", 4 * shape.experts, tp=True),
                  Saved("expert w1, w3 outputs", 2 * e * k * fe, tp=True),
                  Saved("expert w2 outputs", e * k * h, tp=True)]
    if ns:
        out.append(Saved("shared expert outputs", e * ns * (2 * fe + h), tp=True))
    return out


def _attention_outputs(shape: Shape, e: int, s: float, attention: str) -> list[Saved]:
    """The outputs of the "attention" group: the fused kernel's (output, log-sum-exp), or
    the unfused maths' bmm outputs (the scores q k^T and the probabilities times v)."""
    h, a = shape.heads * shape.v_dim, shape.heads
    if attention == "flash":
        return [Saved("attention output", e * h, tp=True),
                Saved("log-sum-exp (fp32)", 4 * a, tp=True)]
    return [Saved("scores q k^T", e * a * s, tp=True, scores=True),
            Saved("attention output", e * h, tp=True)]


def selective_terms(shape: Shape, act_bytes: int = 2, seq: float | None = None,
                    attention: str = "flash", ops: tuple[str, ...] = DEFAULT_OPS
                    ) -> list[Saved]:
    """What a layer keeps under plait's selective recomputation: its input and the outputs
    of the operator groups (GROUPS) not recomputed, i.e. not in `ops` (the runtime's
    `train.recompute_ops`; default: recompute attention and element-wise ops, keep the
    matmul outputs). The one definition the runtime's policy (plait/model/recompute.py)
    applies and plait/plan/activations.py's `layer_saved_bytes` sums: measured to the byte
    (tests/test_recompute.py)."""
    check_attention(attention)
    s = shape.seq if seq is None else seq
    e = act_bytes
    groups = {"matmul": _matmul_outputs(shape, e),
              "attention": _attention_outputs(shape, e, s, attention),
              "elementwise": []}  # always recomputed (recompute_settings.ops_problems)
    block_input = next(t for t in activation_terms(shape, e, s, attention) if t.keep_full)
    return [block_input] + [t for g in GROUPS if g not in ops for t in groups[g]]
