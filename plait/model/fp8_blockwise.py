"""Block-wise float8 matrix multiplies (`train.fp8_recipe = "blockwise"`): DeepSeek-V3's
fine-grained quantization (DeepSeek-V3 technical report, section 3.3).

Every GEMM input is E4M3 (the activations, the weights and the output gradients alike:
fine-grained scales leave no need for E5M2's range), each scale covering a small tile of
B elements (`train.fp8_block`, 128 by default) from that tile's own amax,
`scale = 448 / amax(tile)`:

    activations     1 x B tiles along the features (one token, B features)
    weights         B x B blocks (B output rows x B input features)
    forward         y  = x @ w^T     x in 1 x B tiles, w in B x B blocks
    input grad      dx = g @ w       g in 1 x B tiles (along the output features), w's blocks
    weight grad     dw = g^T @ x     x and g in B x 1 tiles: B positions of one sequence,
                                     one feature (the inner dimension here is the tokens)

A tile at the end of a width (or of a sequence) that is not a multiple of B is partial:
it is scaled by the amax of the elements it has, as if padded with zeros.

The accumulation is promoted every B elements of the inner dimension (the report's
N_C = 128): the GEMM's inner dimension is cut into chunks of B, the chunks of the tiles
above, so that each chunk has one scale per row of the left operand and one per column of
the right one. A chunk's float8 products are summed, that sum is rounded once to fp32
(the promotion into an fp32 register), multiplied by the two inverse scales' product and
added to an fp32 accumulator, chunk after chunk in order; the result is rounded once to
the output dtype. The emulation computes each chunk's sum in float64, where it is exact
(a product of two E4M3 values is a multiple of 2^-18 below 2^18, so up to 2^17 of them
sum exactly in float64's 53 bits), so the tiles, the scales and the promotion are
reproduced exactly and no matmul kernel's summation order enters. With a float64 output
(`train.fp8_compute = "fp64"`, the parity oracle) the accumulator is float64 too.

The activations kept for backward are the model's own (bf16) tensors, as tensorwise keeps
them; backward tiles them again (the weight gradient's B x 1 tiles are not the forward's).
The emulation runs on every device: no float8 kernel is called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import Function

from plait.model.fp8 import E4M3, Float8Settings, scale_for, to_fp8
from plait.model.precision import wide_dtype, widened

# float8 values held exactly in a wide float for the chunked sums (see the docstring)
EXACT = torch.float64


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def _pad_to(t: torch.Tensor, dim: int, block: int) -> torch.Tensor:
    """`t` padded with zeros along `dim` to a multiple of `block`."""
    extra = _blocks(t.shape[dim], block) * block - t.shape[dim]
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return F.pad(t, pad)


def quantize_rows(t: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) in 1 x B tiles along K: the E4M3 values as (M, C, B) (C = ceil(K / B),
    zero-padded) and the inverse scales (M, C)."""
    padded = _pad_to(widened(t), 1, block).view(t.shape[0], _blocks(t.shape[1], block), block)
    scale = scale_for(padded.abs().amax(-1), E4M3)
    return to_fp8(padded, scale[..., None], E4M3), 1 / scale


def quantize_columns(t: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., S, D) in B x 1 tiles along each sequence's S positions: the E4M3 values as
    (C, B, D) (C = sequences x ceil(S / B), each sequence zero-padded) and the inverse
    scales (C, D). A 2-D (T, D) is one run of T tokens (the experts' routed tokens)."""
    seqs = t.reshape(-1, t.shape[-2], t.shape[-1]) if t.dim() > 2 else t[None]
    padded = _pad_to(widened(seqs), 1, block)
    tiles = padded.view(padded.shape[0] * padded.shape[1] // block, block, t.shape[-1])
    scale = scale_for(tiles.abs().amax(1), E4M3)
    return to_fp8(tiles, scale[:, None, :], E4M3), 1 / scale


def quantize_weight(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) in B x B blocks: the E4M3 values (N, K) and the inverse scales
    (ceil(N / B), ceil(K / B))."""
    n, k = w.shape
    padded = _pad_to(_pad_to(widened(w), 0, block), 1, block)
    rows, cols = padded.shape[0] // block, padded.shape[1] // block
    blocks = padded.view(rows, block, cols, block)
    scale = scale_for(blocks.abs().amax(dim=(1, 3)), E4M3)
    q = to_fp8(blocks, scale[:, None, :, None], E4M3).view(padded.shape)
    return q[:n, :k], 1 / scale


def promoted_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """sum over chunks c of (a[:, c] @ b[c]) x a_inv[:, c] x b_inv[c]: `a` (M, C, B) and
    `b` (C, B, N) float8 values in chunks of the inner dimension, `a_inv` (M, C) and
    `b_inv` (C, N) their inverse scales. Each chunk's exact sum rounded once to the
    accumulator (fp32; float64 for a float64 `out_dtype`), scaled, added in chunk order;
    the total rounded once to `out_dtype` (the module docstring)."""
    acc_dtype = wide_dtype(out_dtype)
    acc = torch.zeros(a.shape[0], b.shape[-1], dtype=acc_dtype, device=a.device)
    for c in range(a.shape[1]):
        part = (a[:, c].to(EXACT) @ b[c].to(EXACT)).to(acc_dtype)
        acc = acc + part * (a_inv[:, c, None].to(acc_dtype) * b_inv[None, c].to(acc_dtype))
    return acc.to(out_dtype)


def _weight_chunks(wq: torch.Tensor, w_inv: torch.Tensor, block: int, inner: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight as the right operand, chunked along its dim `inner` (1: forward's K,
    0: the input gradient's N): (C, B, other) values and (C, other) inverse scales."""
    w = _pad_to(wq.to(EXACT), inner, block)
    other = wq.shape[1 - inner]
    values = (w.t() if inner == 1 else w).reshape(-1, block, other)
    inv = (w_inv.t() if inner == 1 else w_inv).repeat_interleave(block, dim=1)[:, :other]
    return values, inv


def _weight(w: torch.Tensor, settings: Float8Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's float8 blocks: ZeRO-3's gathered ones, else cast here."""
    if settings.gathered is not None:
        return settings.gathered
    return quantize_weight(w, settings.block)


class _BlockwiseLinear(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, settings: Float8Settings
                ) -> torch.Tensor:
        block = settings.block
        xq, x_inv = quantize_rows(x.reshape(-1, x.shape[-1]), block)
        wb, wb_inv = _weight_chunks(*_weight(w, settings), block, inner=1)
        y = promoted_mm(xq, x_inv, wb, wb_inv, x.dtype)
        ctx.save_for_backward(x, w)
        ctx.settings = settings
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, w = ctx.saved_tensors
        settings: Float8Settings = ctx.settings
        block = settings.block
        gq, g_inv = quantize_rows(gy.reshape(-1, gy.shape[-1]), block)
        wb, wb_inv = _weight_chunks(*_weight(w, settings), block, inner=0)
        dx = promoted_mm(gq, g_inv, wb, wb_inv, gy.dtype)
        gc, gc_inv = quantize_columns(gy, block)
        xc, xc_inv = quantize_columns(x, block)
        dw = promoted_mm(gc.permute(2, 0, 1), gc_inv.t(), xc, xc_inv, w.dtype)
        return dx.view(x.shape), dw, None


def blockwise_experts(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor,
                      w2: torch.Tensor, w3: torch.Tensor, settings: Float8Settings
                      ) -> torch.Tensor:
    """The routed experts' SwiGLU (plait/model/moe.py `Experts`: `x` (T, dim) sorted by
    expert, `counts` per expert, stacked weights), each expert's three GEMMs in block-wise
    float8; an expert's weight-gradient tiles run along its own tokens, in their order."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:  # an expert with no tokens adds nothing (its weights' gradient stays zero)
            xe = x[start:start + n]
            hidden = F.silu(blockwise_linear(xe, w1[e], settings)) * \
                blockwise_linear(xe, w3[e], settings)
            out.append(blockwise_linear(hidden, w2[e], settings))
        start += n
    return torch.cat(out)


def blockwise_linear(x: torch.Tensor, weight: torch.Tensor,
                     settings: Float8Settings | None = None) -> torch.Tensor:
    """x @ weight^T with both GEMMs of backward in block-wise float8 (the module
    docstring); `settings.block` is B."""
    return _BlockwiseLinear.apply(x, weight, settings or Float8Settings(recipe="blockwise"))
