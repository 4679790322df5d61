"""The layers both attentions share: RMSNorm and the parameter-free causal attention core
(the seam context parallel swaps)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.model.precision import widened
from plait.model.rope import Positions


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 (or wider) for stability, return in the input dtype
        xf = widened(x)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * self.weight


class CausalAttentionCore(nn.Module):
    """softmax(q kᵀ / √d + causal mask) v (Vaswani et al. 2017), GQA by head groups
    (Ainslie et al. 2023). No parameters: a strategy replaces it by module swap (ring
    attention, Liu et al. 2023, brings the other ranks' k, v to it).

    The mask comes from the positions: query i sees key j when pos_j <= pos_i, right for
    load-balanced, out-of-order chunks of a sequence. Contiguous positions 0..s-1 take the
    fused causal kernel (`is_causal=True`), as the model always has.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: Positions) -> torch.Tensor:
        """q (b, heads, s, d), k and v (b, kv heads, s, d), after RoPE -> (b, heads, s, d)."""
        gqa = q.shape[1] != k.shape[1]
        if positions.docs is not None:  # packed documents: causal inside each one
            from plait.model.packed import document_mask

            ids = positions.index()
            docs = positions.docs[:, ids]
            mask = document_mask(docs, docs, ids, ids)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        if positions.contiguous:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        ids = positions.index()
        mask = ids.unsqueeze(-1) >= ids.unsqueeze(-2)  # (s, s) or (b, s, s): key <= query
        if mask.dim() == 3:
            mask = mask.unsqueeze(1)  # broadcast over the heads
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
