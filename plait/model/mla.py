"""Multi-head latent attention (MLA; DeepSeek-V2, section 2.1; DeepSeek-V3, section 2.1.1).

Keys and values come from one low-rank latent per token, queries (optionally) from
another, and position enters through a few extra RoPE features per head, the key's one
set shared by every head ("decoupled RoPE"):

    c_q  = RMSNorm(W_qa x)                 (q_lora_rank; without it q = W_q x)
    q    = W_qb c_q       -> per head [q_nope (qk_nope_head_dim) | q_rope (qk_rope_head_dim)]
    [c_kv | k_rope] = W_kva x              (kv_lora_rank + qk_rope_head_dim)
    [k_nope | v]    = W_kvb RMSNorm(c_kv)  -> per head qk_nope_head_dim + v_head_dim
    k    = [k_nope | RoPE(k_rope)]          (k_rope the same for every head)
    o    = W_o · softmax(q kᵀ / sqrt(qk_nope + qk_rope) + causal mask) v

The scores are ordinary multi-head attention over per-head q, k (width qk_nope + qk_rope)
and v (width v_head_dim), so the parameter-free `core` (plait/model/layers.py) and every
strategy that swaps it see the same contract as GQA's: tensor parallel splits the heads
(W_qb, W_kvb column-parallel, W_o row-parallel, the down-projections and latent norms
replicated: plait/parallel/tensor.py), context parallel moves the per-head k, v
(plait/parallel/context.py). The names are DeepSeek's own reference code's (wq_a, q_norm,
wq_b, wkv_a, kv_norm, wkv_b, wo); the output projection `wo` takes the depth-scaled init.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.model.layers import CausalAttentionCore, RMSNorm
from plait.model.presets import ModelConfig
from plait.model.rope import Positions, apply_rope


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.kv_rank = cfg.v_head_dim, cfg.kv_lora_rank
        heads, qk = cfg.n_heads, cfg.qk_head_dim
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, heads * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, cfg.dim, bias=False)
        self.core = CausalAttentionCore()

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s, heads this rank holds x qk_head_dim): from the query latent, or from x."""
        if hasattr(self, "wq_a"):
            return self.wq_b(self.q_norm(self.wq_a(x)))
        return self.wq(x)

    def forward(self, x: torch.Tensor, positions: Positions) -> torch.Tensor:
        b, s, _ = x.shape
        cos, sin = positions.cos, positions.sin
        # head counts come from the up-projections' widths, so a strategy that splits the
        # heads needs no edit here
        q = self.queries(x).view(b, s, -1, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], -1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], -1)
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin)  # (b, 1, s, rope): one for all
        kv = self.wkv_b(self.kv_norm(latent)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], -1)
        heads = k_nope.shape[1]
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], -1)
        k = torch.cat([k_nope, k_rope.expand(-1, heads, -1, -1)], -1)
        out = self.core(q, k, v, positions)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))
