"""How the training stack runs a layout, beyond the layout itself: whether the data-parallel
gradient reduction overlaps the backward, whether the pipeline's sends overlap compute,
and how many layers the first and last pipeline stages hold. `plait plan` asks for each
(`add_arguments`); the defaults are today's stacks':

  --dp-overlap yes    Megatron-LM's --overlap-grad-reduce, FSDP and DDP's bucketed
                      all-reduce overlap the gradient reduction with the backward (the
                      Megatron-LM of 2021 reduced after the backward: give no)
  --pp-overlap auto   Megatron-LM overlaps the interleaved schedule's sends with compute
                      (its --no-overlap-p2p-communication turns it off); the plain 1F1B
                      schedule waits on its sends. auto: overlapped for interleaved only
  --fused-kernels yes  the stack fuses its element-wise kernels (Megatron-LM, Transformer
                      Engine, torch.compile); no: PyTorch eager, one kernel per operator
                      (the launches the published GPU numbers price)
  --attention-kernel auto  the fused attention kernel, priced by its published forward
                      and backward sweeps (plait/plan/data/gpu_efficiency.json): cuDNN's on
                      Hopper (Transformer Engine), FlashAttention-2 on the A100; fa2 for
                      PyTorch SDPA's flash backend, fa3 for FlashAttention-3
  --first-stage-layers N, --last-stage-layers N
                      uneven pipeline stages (Megatron-LM's
                      --decoder-first/last-pipeline-num-layers): the first stage, which
                      holds the most micro-batches in flight, and the last, which holds the
                      LM head and loss, can hold fewer layers; the rest split evenly.
                      Default: an even split (the layers / stages, rounded up)

The LM head and the loss are in the last stage (plait's runtime, Megatron-LM).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.plan.gpu_data import ATTENTION_KERNELS

PP_OVERLAP = ("auto", "yes", "no")


@dataclass(frozen=True)
class Stack:
    dp_overlap: bool = True
    pp_overlap: str = "auto"  # PP_OVERLAP
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    # the stack fuses its element-wise kernels (a norm, an activation, RoPE: one kernel
    # each; Megatron-LM, Transformer Engine, torch.compile) or runs PyTorch eager (one
    # kernel per operator): the kernel launches plait/plan/memory_bound.py counts
    fused_kernels: bool = True

    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None


def add_arguments(group: Any) -> None:
    yes_no = ("yes", "no")
    group.add_argument("--dp-overlap", default="yes", choices=yes_no,
                       help="the data-parallel gradient reduction overlaps the backward "
                       "(default yes: Megatron-LM's --overlap-grad-reduce, FSDP, DDP; no: "
                       "reduced after the backward, as Megatron-LM did in 2021)")
    group.add_argument("--pp-overlap", default="auto", choices=PP_OVERLAP,
                       help="pipeline sends overlap compute (default auto: for the "
                       "interleaved schedule only, as Megatron-LM)")
    group.add_argument("--fused-kernels", default="yes", choices=yes_no,
                       help="the stack fuses its element-wise kernels (default yes: "
                       "Megatron-LM, Transformer Engine, torch.compile; no: PyTorch eager, "
                       "one kernel per operator): the kernel launches priced with the "
                       "published GPU numbers")
    group.add_argument("--attention-kernel", default="auto", choices=ATTENTION_KERNELS,
                       help="the fused attention kernel the stack runs, priced by its "
                       "published forward and backward sweep (default auto: the GPU's "
                       "usual one, cuDNN's on Hopper as Transformer Engine runs it, "
                       "FlashAttention-2 on the A100; fa2: PyTorch SDPA's flash backend or "
                       "flash-attn 2; fa3: FlashAttention-3)")
    group.add_argument("--first-stage-layers", type=int, metavar="N",
                       help="layers of the first pipeline stage (default: an even split; "
                       "Megatron-LM's --decoder-first-pipeline-num-layers)")
    group.add_argument("--last-stage-layers", type=int, metavar="N",
                       help="layers of the last pipeline stage, which holds the LM head "
                       "and loss (default: an even split)")


def stack_from_args(args: argparse.Namespace) -> Stack:
    return Stack(getattr(args, "dp_overlap", "yes") == "yes",
                 getattr(args, "pp_overlap", "auto"),
                 getattr(args, "first_stage_layers", None),
                 getattr(args, "last_stage_layers", None),
                 getattr(args, "fused_kernels", "yes") == "yes")


def pp_overlapped(stack: Stack, sched: str) -> bool:
    """Whether the pipeline's sends overlap compute under `sched`."""
    if stack.pp_overlap == "auto":
        return sched == "interleaved"
    return stack.pp_overlap == "yes"


def stage_problems(layers: int, pp: int, chunks_per_rank: int, stack: Stack) -> list[str]:
    """What is wrong with the uneven stages for a layout of `pp` ranks (empty: fine)."""
    if not stack.uneven():
        return []
    if pp < 2:
        return ["--first-stage-layers/--last-stage-layers need a pipeline (pp >= 2)"]
    if chunks_per_rank != 1:
        return ["--first-stage-layers/--last-stage-layers are modelled for schedules with "
                "one stage per rank (not interleaved or the V shapes)"]
    first, last = stack.first_stage_layers, stack.last_stage_layers
    given = [n for n in (first, last) if n is not None]
    if any(n < 1 for n in given):
        return ["--first-stage-layers/--last-stage-layers must be >= 1"]
    rest = layers - sum(given)
    middle = pp - len(given)
    if rest < middle or (middle == 0 and rest != 0):
        return [f"{layers} layers cannot be split as first {first}, last {last} over {pp} "
                "stages (every stage needs a layer, and two stages hold them all)"]
    return []


def stage_layers(layers: int, pp: Any, even: Any, stack: Stack) -> tuple[Any, Any, Any]:
    """(first stage's, the busiest middle stage's, last stage's) layers; `even` the even
    split's (layers / stages, rounded up), used where the stack gives none."""
    if not stack.uneven():
        return even, even, even
    first = even if stack.first_stage_layers is None else stack.first_stage_layers
    last = even if stack.last_stage_layers is None else stack.last_stage_layers
    given = [n for n in (stack.first_stage_layers, stack.last_stage_layers) if n is not None]
    middle_ranks = np.asarray(pp, dtype=float) - len(given)
    rest = layers - sum(given)
    middle = np.where(middle_ranks > 0, np.ceil(rest / np.maximum(middle_ranks, 1)), 0.0)
    if stack.first_stage_layers is None:
        first = middle
    if stack.last_stage_layers is None:
        last = middle
    return first, middle, last
