"""Model shapes: from `tiny` (8 CPU ranks in seconds) to real ones built on the meta device.

Real shapes are the published ones (cited per entry); they exist for counting parameters
and FLOPs and for the planner, not for training on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn_dim: int = 176  # SwiGLU hidden width
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    # Llama 3.1 RoPE frequency scaling (plait/model/rope.py, Llama3Scaling); factor 1: none
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # MoE (0 experts: dense); the block is plait/model/moe.py
    n_experts: int = 0
    top_k: int = 0
    expert_ffn_dim: int = 0
    n_shared_experts: int = 0
    n_dense_layers: int = 0  # the first layers keep a dense MLP (DeepSeek-V3: 3)
    router_score: str = "softmax"  # "softmax" (Mixtral) | "sigmoid" (DeepSeek-V3)
    norm_topk: bool = True  # gates normalised over the chosen experts
    aux_loss_coef: float = 0.0  # sequence-wise balance loss alpha (0: off)
    bias_update_rate: float = 0.0  # aux-loss-free balancing gamma (0: off)
    capacity_factor: float | None = None  # per-sequence expert capacity x k / n (None: dropless)
    route_groups: int = 0  # experts in this many groups (DeepSeek-V3: nodes), 0: none
    route_max_groups: int = 0  # a token's experts come from at most this many groups
    routed_scale: float = 1.0  # the routed experts' gates x this (DeepSeek-V3: 2.5)
    # attention: "gqa" (wq, wk, wv, wo; grouped KV heads by n_kv_heads) or "mla", multi-head
    # latent attention (plait/model/mla.py): queries and keys/values up-projected from
    # low-rank latents, a RoPE key shared by the heads (DeepSeek-V2, section 2.1)
    attention: str = "gqa"
    q_lora_rank: int = 0  # the query latent's width (0: queries straight from x)
    kv_lora_rank: int = 0  # the key/value latent's width (DeepSeek-V3: 512)
    qk_nope_head_dim: int = 0  # per head: the query/key features without position
    qk_rope_head_dim: int = 0  # per head: the RoPE features (the key's shared by heads)
    v_head_dim: int = 0  # per head: the value width
    # multi-token prediction modules (DeepSeek-V3, section 2.2): counted by num_params
    # (`mtp=True`) and the planner's FLOPs; plait's runtime does not build them
    mtp_depth: int = 0

    @property
    def mla(self) -> bool:
        return self.attention == "mla"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def qk_head_dim(self) -> int:
        """Per head, the width of a query or key: the scores' dot product."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """The features RoPE rotates per head (a table of rope_dim/2 frequencies)."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    def attention_params(self) -> int:
        """One layer's attention weights (its two block norms not included)."""
        h = self.dim
        if not self.mla:
            return 2 * h * h + 2 * h * self.n_kv_heads * self.head_dim
        heads, qk = self.n_heads, self.qk_head_dim
        q = h * heads * qk
        if self.q_lora_rank:  # down-projection, its RMSNorm, up-projection
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
        kv = (h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
              + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + heads * self.v_head_dim * h

    def attention_matmul_params(self) -> int:
        """attention_params without the latent norms: the weights a token multiplies."""
        norms = (self.q_lora_rank + self.kv_lora_rank) if self.mla else 0
        return self.attention_params() - norms

    def attention_core_flops(self, seq_len: int) -> float:
        """One layer's causal attention core, forward, per token: q·k over qk_head_dim
        and p·v over value_head_dim per head, 2 FLOPs a multiply-add, causal half."""
        return 2 * seq_len * self.n_heads * (self.qk_head_dim + self.value_head_dim) / 2

    def mtp_params(self) -> int:
        """One multi-token prediction module as DeepSeek-V3's checkpoint stores it
        (section 2.2): its two input RMSNorms, the projection M (h x 2h), one MoE block,
        and its own copies of the embedding, the final norm and the output head."""
        h = self.dim
        block = self.attention_params() + 2 * h + self._moe_mlp_params()
        return 2 * h + 2 * h * h + block + h + 2 * self.vocab_size * h

    def _moe_mlp_params(self) -> int:
        h = self.dim
        return (self.n_experts * 3 * h * self.expert_ffn_dim + h * self.n_experts
                + self.n_shared_experts * 3 * h * self.expert_ffn_dim)

    def num_params(self, include_embedding: bool = True, mtp: bool = False) -> int:
        """Exact parameter count of plait's model for this shape (dense or MoE; GQA or
        MLA). `mtp`: with the `mtp_depth` multi-token prediction modules as published
        (plait does not build them)."""
        h = self.dim
        attn = self.attention_params()
        dense = 3 * h * self.ffn_dim
        mlp = self._moe_mlp_params() if self.n_experts else dense
        moe_layers = self.n_layers - self.n_dense_layers if self.n_experts else 0
        total = (self.n_layers * (attn + 2 * h) + moe_layers * mlp
                 + (self.n_layers - moe_layers) * dense + h)  # + final norm
        if include_embedding:
            total += self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return total + (self.mtp_depth * self.mtp_params() if mtp else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x (matmul params) + causal attention (fwd+bwd).

        Attention score and value matmuls: 2 * 2 * s * h per layer forward for full
        attention; causal halves the useful work; x3 for forward + backward
        (Narayanan et al. 2021, eq. for model FLOPs, with the causal factor).
        """
        dense = 3 * self.dim * self.ffn_dim
        mlp, moe_layers = dense, 0
        if self.n_experts:
            active = self.top_k + self.n_shared_experts
            mlp = 3 * self.dim * self.expert_ffn_dim * active + self.dim * self.n_experts
            moe_layers = self.n_layers - self.n_dense_layers
        h = self.dim
        matmul_params = (self.n_layers * self.attention_matmul_params() + moe_layers * mlp
                         + (self.n_layers - moe_layers) * dense + self.vocab_size * h)
        attention = self.n_layers * self.attention_core_flops(seq_len)
        return 6 * matmul_params + 3 * attention


PRESETS: dict[str, ModelConfig] = {
    # Tiny shapes for CPU runs and tests.
    "tiny": ModelConfig(),
    "tiny-gqa": ModelConfig(n_heads=4, n_kv_heads=2),
    "small": ModelConfig(vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=4,
                         ffn_dim=352, max_seq_len=512),
    # GPT-3 family (Brown et al. 2020, Table 2.1): MHA, 4h MLP. Our block is SwiGLU, so
    # ffn_dim = 8h/3 keeps the MLP parameter count at the GPT value of 8h^2.
    "gpt3-1.3b": ModelConfig(vocab_size=50257, dim=2048, n_layers=24, n_heads=16,
                             n_kv_heads=16, ffn_dim=5461, max_seq_len=2048),
    "gpt3-6.7b": ModelConfig(vocab_size=50257, dim=4096, n_layers=32, n_heads=32,
                             n_kv_heads=32, ffn_dim=10923, max_seq_len=2048),
    "gpt3-13b": ModelConfig(vocab_size=50257, dim=5120, n_layers=40, n_heads=40,
                            n_kv_heads=40, ffn_dim=13653, max_seq_len=2048),
    "gpt3-175b": ModelConfig(vocab_size=50257, dim=12288, n_layers=96, n_heads=96,
                             n_kv_heads=96, ffn_dim=32768, max_seq_len=2048),
    # Llama 3 (Dubey et al. 2024, Table 3): GQA with 8 KV heads, vocab 128256.
    "llama3-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                             n_kv_heads=8, ffn_dim=14336, max_seq_len=8192,
                             rope_theta=500000.0),
    "llama3-70b": ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64,
                              n_kv_heads=8, ffn_dim=28672, max_seq_len=8192,
                              rope_theta=500000.0),
    "llama3-405b": ModelConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128,
                               n_kv_heads=8, ffn_dim=53248, max_seq_len=8192,
                               rope_theta=500000.0),
    # MoE for CPU runs and tests: 8 experts top-2 + 1 shared, a balance loss
    "tiny-moe": ModelConfig(n_experts=8, top_k=2, expert_ffn_dim=64, n_shared_experts=1,
                            aux_loss_coef=0.01),
    # Mixtral 8x7B (Jiang et al. 2024): 8 experts, top-2.
    "mixtral-8x7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32,
                                n_kv_heads=8, ffn_dim=14336, max_seq_len=32768,
                                rope_theta=1e6, n_experts=8, top_k=2, expert_ffn_dim=14336),
    # DeepSeek-shaped, for CPU runs and tests: multi-head latent attention (query latent
    # 32, key/value latent 16, 16 + 8 RoPE features a head, values 16), the first layer
    # dense, then 8 sigmoid-routed experts top-2 + 1 shared in 4 groups (at most 2)
    "tiny-mla": ModelConfig(attention="mla", q_lora_rank=32, kv_lora_rank=16,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                            n_experts=8, top_k=2, expert_ffn_dim=32, n_shared_experts=1,
                            n_dense_layers=1, router_score="sigmoid", routed_scale=2.5,
                            route_groups=4, route_max_groups=2, bias_update_rate=0.01),
    # DeepSeek-V3 as published (DeepSeek-AI 2024, sections 2.1 and 4.2; its config.json):
    # 61 layers of width 7168, MLA with 128 heads (query latent 1536, key/value latent
    # 512, 128 + 64 RoPE features a head, values 128), the first 3 layers dense (width
    # 18432), then 256 routed experts top-8 (sigmoid, at most 4 of 8 node groups, gates x
    # 2.5) + 1 shared, expert width 2048, aux-loss-free balancing (gamma 0.001) with a
    # 0.0001 sequence-wise loss; 671 B parameters, 14 B more with its one multi-token
    # prediction module (model.mtp_depth=1: counted, not built). Pre-trained at 4K tokens.
    "deepseek-v3": ModelConfig(vocab_size=129280, dim=7168, n_layers=61, n_heads=128,
                               n_kv_heads=128, ffn_dim=18432, max_seq_len=4096,
                               norm_eps=1e-6, init_std=0.006,
                               attention="mla", q_lora_rank=1536, kv_lora_rank=512,
                               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                               n_experts=256, top_k=8, expert_ffn_dim=2048,
                               n_shared_experts=1, n_dense_layers=3, router_score="sigmoid",
                               routed_scale=2.5, aux_loss_coef=0.0001, bias_update_rate=0.001,
                               route_groups=8, route_max_groups=4),
}
