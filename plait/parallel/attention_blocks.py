"""One block of attention and its gradient, in fp32, and the exact merge of partial
results: what blockwise (ring) attention is made of (Liu et al. 2023, "Ring Attention with
Blockwise Transformers"; the backward as in Dao 2023, FlashAttention-2, section 3.1).

Two implementations of the same maths. "fused": torch's CPU flash-attention kernel, which
returns the log-sum-exp the merge needs and whose backward takes the *merged* output and
lse (what ring implementations feed a flash backward); 5-6x faster than "eager" here.
"eager": the formulas in plain matmuls, one block's scores at a time, for any device
(CUDA runs it until a GPU run has checked the fused CUDA kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
                     None)


def fused_available(device: torch.device) -> bool:
    return device.type == "cpu" and _FLASH is not None and _FLASH_BWD is not None


def _expand(kv: torch.Tensor, g: int) -> torch.Tensor:
    """GQA: each KV head repeated for its g query heads (head i uses KV head i // g)."""
    return kv if g == 1 else kv.repeat_interleave(g, dim=1)


def _fold(grad: torch.Tensor, g: int) -> torch.Tensor:
    """The adjoint of `_expand`: sum each KV head's g query-head gradients."""
    return grad if g == 1 else grad.unflatten(1, (-1, g)).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """q (b, kv, g, m, d), k (b, kv, n, d) -> masked scores (b, kv, g, m, n). `mask`
    (b, m, n): packed documents' visible pairs (the causal triangle included)."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if mask is not None:
        return s.masked_fill(~mask[:, None, None], float("-inf"))
    if causal:  # the diagonal block: square, key j visible to query i when j <= i
        m, n = s.shape[-2:]
        keep = torch.ones(m, n, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _widen(t: torch.Tensor, d: int) -> torch.Tensor:
    """t zero-padded to width d on its last axis: the CPU flash kernel takes one head width
    for q, k and v, and MLA's values are narrower (or wider) than its queries and keys;
    zero features change neither q·k nor the output's first columns."""
    return t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1]))


def block_forward(q, k, v, causal: bool, scale: float, fused: bool, mask=None):
    """q (b, h, m, dk) against one key chunk k (b, kv, n, dk), v (b, kv, n, dv), fp32 ->
    partial output (b, h, m, dv) and its log-sum-exp (b, h, m). A row `mask` hides
    wholly (another document's keys) has output 0 and lse -inf."""
    g = q.shape[1] // k.shape[1]
    if fused and mask is None:
        d, dv = max(q.shape[-1], v.shape[-1]), v.shape[-1]
        out, lse = _FLASH(_widen(q, d), _expand(_widen(k, d), g), _expand(_widen(v, d), g),
                          0.0, causal, scale=scale)
        return out[..., :dv], lse
    s = _scores(q.unflatten(1, (-1, g)), k, causal, scale, mask)
    lse = torch.logsumexp(s, -1)
    finite = lse.masked_fill(torch.isinf(lse), 0.0)  # a hidden row: exp(-inf) = 0, not nan
    out = torch.matmul(torch.exp(s - finite.unsqueeze(-1)), v.unsqueeze(2))
    return out.flatten(1, 2), lse.flatten(1, 2)


def block_backward(q, k, v, out, lse, dout, causal: bool, scale: float, fused: bool,
                    mask=None):
    """(dq, dk, dv) of one block from the *merged* output and lse of q's rows (the flash
    backward: P = exp(S - lse), dS = P (dO Vᵀ - rowsum(dO O)))."""
    g = q.shape[1] // k.shape[1]
    if fused and mask is None:
        d, dqk, dvw = max(q.shape[-1], v.shape[-1]), q.shape[-1], v.shape[-1]
        dq, dk, dv = _FLASH_BWD(_widen(dout, d), _widen(q, d), _expand(_widen(k, d), g),
                                _expand(_widen(v, d), g), _widen(out, d), lse, 0.0, causal,
                                scale=scale)
        return dq[..., :dqk], _fold(dk[..., :dqk], g), _fold(dv[..., :dvw], g)
    q5, do5 = q.unflatten(1, (-1, g)), dout.unflatten(1, (-1, g))
    delta = (do5 * out.unflatten(1, (-1, g))).sum(-1, keepdim=True)
    p = torch.exp(_scores(q5, k, causal, scale, mask)
                  - lse.unflatten(1, (-1, g)).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do5).sum(2)
    ds = p * (torch.matmul(do5, v.unsqueeze(2).transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(2) * scale
    return dq.flatten(1, 2), dk, dv


def merge_partials(acc, out, lse):
    """Exact merge of two partial softmax results (log-sum-exp rescaling)."""
    if acc is None:
        return out, lse
    o, l0 = acc
    total = torch.logaddexp(l0, lse)
    finite = total.masked_fill(torch.isinf(total), 0.0)  # rows hidden so far stay 0
    return (o * torch.exp(l0 - finite).unsqueeze(-1)
            + out * torch.exp(lse - finite).unsqueeze(-1)), total
