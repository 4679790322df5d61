"""A plain Llama-style decoder. It knows nothing of parallelism.

Token embedding -> n x [RMSNorm -> GQA causal attention (RoPE) -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head.
Strategies are applied to it from outside (module swaps, layer splits, sharding).
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from plait.model.presets import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 for stability, return in the input dtype
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (seq_len, head_dim/2) (Su et al. 2021)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x: (batch, heads, seq, head_dim)."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # head counts come from the weights, so a strategy that shards heads needs no edit here
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.n_experts:
            raise ValueError("MoE blocks are not built yet: use a dense preset (n_experts=0)")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        # recomputation is a runtime choice made by the trainer, not a model property
        self.recompute = False

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final normalised hidden states (batch, seq, dim)."""
        s = tokens.shape[1]
        cos, sin = rope_tables(self.cfg.head_dim, s, self.cfg.rope_theta)
        x = self.embed(tokens)
        for layer in self.layers:
            if self.recompute and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab)."""
        return self.head(self.hidden(tokens))


def param_seed(base_seed: int, name: str) -> int:
    """A 63-bit seed from (base seed, parameter name): the same in every layout."""
    digest = hashlib.sha256(f"{base_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_full_param(name: str, shape: torch.Size, cfg: ModelConfig, base_seed: int) -> torch.Tensor:
    """The full fp32 initial value of parameter `name`, independent of any layout.

    Norm weights start at one; output projections (wo, w2) are scaled by 1/sqrt(2 n_layers)
    as in GPT-2 (Radford et al. 2019) so the residual stream's variance stays bounded.
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(param_seed(base_seed, name))
    std = cfg.init_std
    if name.endswith(("wo.weight", "w2.weight")):
        std = std / (2 * cfg.n_layers) ** 0.5
    return torch.randn(shape, generator=gen) * std


def build_model(cfg: ModelConfig, seed: int, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Build on the meta device, then materialise every parameter from its name-seeded init."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if device == "meta":
        return model
    model.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty gives each module its own tensor: tie them again
        model.head.weight = model.embed.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_full_param(name, p.shape, cfg, seed))
    return model.to(dtype)
