"""Float8 matrix multiplies for a linear layer: dynamic per-tensor scaling by amax.

The recipe is torchao's default float8 training recipe ("tensorwise") and Transformer
Engine's delayed-free current scaling, written from the FP8 formats paper (Micikevicius et
al. 2022, "FP8 Formats for Deep Learning", sections 3 and 4): every tensor entering a
GEMM is cast to float8 with one fp32 scale, `scale = max_finite / amax(tensor)`, so its
largest magnitude lands on the format's largest finite value; the product is taken in
float8 with fp32 accumulation and multiplied by both inverse scales.

    forward    y  = x_e4m3 @ w_e4m3^T          (E4M3: 3 mantissa bits, max 448)
    backward   dx = g_e5m2 @ w_e4m3            (E5M2: 2 mantissa bits, max 57344; the
               dw = g_e5m2^T @ x_e4m3           gradients' wider range, section 3)

The output is in the input's dtype (bf16 in a run); everything else in the model stays as
it was. Backward casts x and w again with the forward's scales (the same float8 values,
bit for bit), so the activations kept for backward are the bf16 tensors any linear keeps:
no extra memory.

The GEMM is `torch._scaled_mm` on CUDA with compute capability >= 8.9 (H100 and later) for
shapes whose sides are multiples of 16. Elsewhere it is emulated with the same numerics:
the float8 values widened to fp32, an fp32 matmul, both inverse scales applied, the result
rounded once to the output dtype (`emulated_scaled_mm`). torch 2.13 has the kernel on CPU
too (E4M3 and E5M2 operands, per-tensor scales), but a reference one: ~250 ms for a
256 x 64 x 176 GEMM that the emulation does in 0.4 ms, so the CPU emulates;
tests/test_fp8.py holds the emulation to the CPU kernel.

Where a tensor's scaling domain is split over ranks (a tensor-parallel shard of a weight,
a row-parallel input split along its features, a context-parallel sequence chunk), the
linear's `Float8Settings.reduce_amax` makes the amaxes global (a max over those ranks), so
every rank casts with the scale of the whole tensor, as one process does. A weight whose
float8 copy is already at hand (ZeRO-3 gathers weights in float8) comes through
`Float8Settings.gathered`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import Function

from plait.model.precision import wide_dtype, widened

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# the scale's floor keeps an all-zero tensor finite (its scale is then huge, its values 0)
AMAX_FLOOR = 1e-12


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def scale_for(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 scale (float64 for a float64 `amax`) that maps `amax` onto `dtype`'s
    largest finite value."""
    return fp8_max(dtype) / widened(amax).clamp(min=AMAX_FLOOR)


def to_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t * scale rounded to `dtype` (round to nearest even), saturated at its max."""
    m = fp8_max(dtype)
    return (widened(t) * scale).clamp(-m, m).to(dtype)


def emulated_scaled_mm(a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor,
                       b_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(a * a_inv) @ (b * b_inv) for float8 `a` (M, K) and `b` (K, N): fp32 products and
    sums, rounded once to `out_dtype`, as the float8 kernel does; a float64 `out_dtype`
    (`train.fp8_compute = "fp64"`, the parity oracle) accumulates in float64, so that
    reordered sums of the same float8 products differ by float64's rounding only."""
    acc = wide_dtype(out_dtype)
    return ((a.to(acc) @ b.to(acc)) * (a_inv * b_inv).to(acc)).to(out_dtype)


def _kernel_runs(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device) < (8, 9):
        return False
    return all(n % 16 == 0 for n in (*a.shape, b.shape[1]))


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
              out_dtype: torch.dtype, kernel: bool = True) -> torch.Tensor:
    """The float8 GEMM (a (M, K) @ b (K, N), fp32 accumulation, per-tensor inverse scales):
    torch's kernel on a GPU that has it, else `emulated_scaled_mm` (`kernel` False: always)."""
    if not (kernel and out_dtype != torch.float64 and _kernel_runs(a, b)):
        return emulated_scaled_mm(a, b, a_inv, b_inv, out_dtype)
    # the kernel takes the first operand row-major and the second column-major
    return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_inv.reshape(()),
                            scale_b=b_inv.reshape(()), out_dtype=out_dtype)


@dataclass
class Float8Settings:
    """What one float8 linear needs beyond its weight. `reduce_amax`: a max over the ranks
    sharing the linear's tensors (None: one rank sees them whole), applied in place to a
    vector of amaxes; `gathered`: the weight's float8 value and scale when ZeRO-3 brought
    them (None: the linear casts its own weight; blockwise: the scales are the blocks'
    inverse ones). `recipe`: "tensorwise" (this module) or "blockwise"
    (plait/model/fp8_blockwise.py, tiles of `block` elements)."""

    reduce_amax: Callable[[torch.Tensor], None] | None = None
    gathered: tuple[torch.Tensor, torch.Tensor] | None = None
    recipe: str = "tensorwise"
    block: int = 128


def _amax(*ts: torch.Tensor) -> torch.Tensor:
    return torch.stack([widened(t.detach().abs().amax()) for t in ts])


class _Float8Linear(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, settings: Float8Settings
                ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        gathered = settings.gathered
        amax = _amax(x2) if gathered is not None else _amax(x2, w)
        if settings.reduce_amax is not None:
            settings.reduce_amax(amax)
        sx = scale_for(amax[0], E4M3)
        if gathered is not None:
            wq, sw = gathered
        else:
            sw = scale_for(amax[1], E4M3)
            wq = to_fp8(w, sw, E4M3)
        y = scaled_mm(to_fp8(x2, sx, E4M3), wq.t(), 1 / sx, 1 / sw, x.dtype)
        ctx.save_for_backward(x, w, sx, sw)
        ctx.settings = settings
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, w, sx, sw = ctx.saved_tensors
        settings: Float8Settings = ctx.settings
        g2 = gy.reshape(-1, gy.shape[-1])
        amax = _amax(g2)
        if settings.reduce_amax is not None:
            settings.reduce_amax(amax)
        sg = scale_for(amax[0], E5M2)
        gq = to_fp8(g2, sg, E5M2)
        # ZeRO-3 gathered the float8 weight again for this backward; else cast it again
        wq = settings.gathered[0] if settings.gathered is not None else to_fp8(w, sw, E4M3)
        xq = to_fp8(x.reshape(-1, x.shape[-1]), sx, E4M3)
        dx = scaled_mm(gq, wq, 1 / sg, 1 / sw, gy.dtype)
        dw = scaled_mm(gq.t(), xq, 1 / sg, 1 / sx, w.dtype)
        return dx.view(x.shape), dw, None


def float8_linear(x: torch.Tensor, weight: torch.Tensor,
                  settings: Float8Settings | None = None) -> torch.Tensor:
    """x @ weight^T with both GEMMs of backward, in float8 (the module docstring)."""
    return _Float8Linear.apply(x, weight, settings or Float8Settings())
