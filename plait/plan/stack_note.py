"""The kernel stack a GPU plan assumes, said in the plan's first lines.

The default stack (`--fused-kernels yes`, the GPU's usual fused attention kernel) is
Megatron-LM's or Transformer Engine's, and its MFUs are higher than what an eager PyTorch
stack reaches. So the plan names the stack it priced and prints beside it the best
layout under a torchtitan-like stack: PyTorch eager (one kernel per operator) with SDPA's
flash attention (FlashAttention-2), the stack of the torchtitan runs
benchmarks/plan_gpu_error.py compares against.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from plait.plan.estimate import Estimate, Training, evaluate
from plait.plan.gpu_data import ATTENTION_NAMES, published
from plait.plan.hardware import Cluster
from plait.plan.shape import Shape

TORCHTITAN_FLAGS = "--fused-kernels no --attention-kernel fa2"


def torchtitan_like(shape: Shape, cluster: Cluster, train: Training,
                    best: Estimate) -> Estimate | None:
    """`best`'s layout under the torchtitan-like stack; None where the GPU has no published
    numbers to price it with (no FlashAttention-2 sweep among them)."""
    try:
        pub = published(cluster.gpu, "fa2")
    except ValueError:
        return None
    if pub is None:
        return None
    eager = replace(train, stack=replace(train.stack, fused_kernels=False))
    return evaluate(shape, cluster, eager, best.layout, pub.eff, simulate=True)


def stack_lines(args: Any, shape: Shape, cluster: Cluster, train: Training,
                best: Estimate) -> list[str]:
    """The stack the plan priced, and the torchtitan-like stack's figure for the best
    layout; nothing for a measured profile or fitted constants (no kernel stack there)."""
    if getattr(args, "hardware", None) or getattr(args, "efficiency", "published") != "published":
        return []
    pub = published(cluster.gpu, getattr(args, "attention_kernel", "auto"))
    kernel = ATTENTION_NAMES[pub.attention_kernel] if pub else "-"
    if not train.stack.fused_kernels:
        return [f"kernel stack: PyTorch eager (--fused-kernels no), attention kernel "
                f"{kernel}: the figures below are an eager stack's."]
    head = (f"kernel stack: fused element-wise kernels and {kernel} attention, as "
            "Megatron-LM and Transformer Engine run them: the MFUs below are such a "
            f"stack's ({best.layout.label()}: {float(best.step_time):.3f} s a step, MFU "
            f"{float(best.mfu):.1%})")
    other = torchtitan_like(shape, cluster, train, best)
    if other is None:
        return [head + "."]
    return [head + f"; a torchtitan-like stack (PyTorch eager, SDPA flash attention: "
            f"{TORCHTITAN_FLAGS}) on the same layout: {float(other.step_time):.3f} s, MFU "
            f"{float(other.mfu):.1%}."]
