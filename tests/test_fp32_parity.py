"""The fp32 set: a few layouts held to bounds derived from fp32's epsilon (the "fp32" class
of plait/testing.py: 2^10 eps32), so the precision users train in is proven too, not only
the float64 oracle. Plain SGD with clipping active at every step: its update is linear in
the gradient, so a parameter's error is the learning rate times its gradient's, and the
bound on parameters means something (AdamW turns a rounding-level sign change of a
near-zero gradient into a whole step; docs/parity.md, "Tolerances")."""

from __future__ import annotations

import pytest
from helpers import reference, run_layout

from plait.testing import assert_parity, merge_ranks

FP32_SGD = ("train.precision=fp32", "train.optimizer=sgd", "train.weight_decay=0",
            "train.lr=1.0", "train.min_lr_ratio=1.0", "model.n_kv_heads=2")
LAYOUTS = {
    # sums reordered across replicas and micro-batches, ZeRO's reduce-scatter
    "dp2-zero2": ("parallel.dp=2", "parallel.zero=2", "parallel.microbatches=2"),
    # inside every layer: row-parallel partial products, the vocab-parallel softmax, a KV
    # head's gradient summed over two ranks' query heads
    "tp2-sp-gqa": ("parallel.tp=2", "parallel.sp=true"),
    # attention's softmax merged block by block around a ring
    "cp2-ring": ("parallel.cp=2", "parallel.cp_mode=ring"),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS)
def test_fp32_layout_within_fp32_epsilon_bounds(layout):
    outs = run_layout(*FP32_SGD, *layout)
    ref = reference(*FP32_SGD)
    assert_parity(merge_ranks(outs), ref, "fp32")
    assert min(ref.grad_norms) > 0.5  # clipping was active at every step
