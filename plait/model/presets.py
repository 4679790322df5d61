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

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of plait's model for this shape (dense or MoE)."""
        h, kv = self.dim, self.n_kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h
        dense = 3 * h * self.ffn_dim
        mlp = dense
        if self.n_experts:
            mlp = self.n_experts * 3 * h * self.expert_ffn_dim + h * self.n_experts
            mlp += self.n_shared_experts * 3 * h * self.expert_ffn_dim
        moe_layers = self.n_layers - self.n_dense_layers if self.n_experts else 0
        total = (self.n_layers * (attn + 2 * h) + moe_layers * mlp
                 + (self.n_layers - moe_layers) * dense + h)  # + final norm
        if include_embedding:
            total += self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return total

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
        h, kv = self.dim, self.n_kv_heads * self.head_dim
        matmul_params = (self.n_layers * (2 * h * h + 2 * h * kv) + moe_layers * mlp
                         + (self.n_layers - moe_layers) * dense + self.vocab_size * h)
        attention = self.n_layers * 2 * 2 * seq_len * h / 2
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
    # DeepSeek-V3-like shape (DeepSeek-AI 2024, sections 2.1.2 and 4.2): 256 routed
    # experts top-8 (sigmoid, at most 4 of 8 node groups) + 1 shared, expert width 2048,
    # aux-loss-free balancing (gamma 0.001) with a 0.0001 sequence-wise loss. Attention
    # approximated as MHA (MLA is not modelled); the real model's first 3 layers are dense
    # (model.n_dense_layers=3 builds that; `plait plan --dense-layers 3` plans it).
    "deepseek-v3": ModelConfig(vocab_size=129280, dim=7168, n_layers=61, n_heads=128,
                               n_kv_heads=128, ffn_dim=18432, max_seq_len=4096,
                               n_experts=256, top_k=8, expert_ffn_dim=2048,
                               n_shared_experts=1, router_score="sigmoid",
                               aux_loss_coef=0.0001, bias_update_rate=0.001,
                               route_groups=8, route_max_groups=4),
}
