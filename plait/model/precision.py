"""The compute dtype of a precision setting, and the widening that numerically delicate
steps (norms, softmax, RoPE, the loss, optimizer masters) take.

"fp64" exists for proof, not speed: every layout equals the single-process float64 run to
a few units of float64's epsilon (2.2e-16), so the parity bounds follow from the format
and hold on any CPU kernel path (docs/parity.md). Users debugging a divergence can run it
too. Widening never narrows: what is already float64 stays float64.
"""

from __future__ import annotations

import torch

# the dtype the model's parameters, activations and gradients are held in; fp8: the blocks'
# linears multiplied in float8 (plait/model/fp8.py), everything else in `fp8_compute`'s
COMPUTE_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
FP8_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def compute_dtype(precision: str, fp8_compute: str = "bf16") -> torch.dtype:
    """The model's dtype under `train.precision` (and, for fp8, `train.fp8_compute`)."""
    if precision == "fp8":
        return FP8_COMPUTE_DTYPES[fp8_compute]
    return COMPUTE_DTYPES[precision]


def widened(t: torch.Tensor) -> torch.Tensor:
    """`t` in fp32 or wider: bf16, fp16 and fp32 become fp32, float64 stays float64."""
    return t if t.dtype == torch.float64 else t.float()


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype `widened` gives a tensor of `dtype` (the optimizer's masters, sums)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
