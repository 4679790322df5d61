"""Float8 layouts against the single-process float8 run (the "fp8" class of
plait/testing.py's PARITY_TOLERANCES, docs/parity.md).

The reference is plait's own one-process fp8 run with as many micro-batches as the layout
has in all, so that each GEMM's tokens, and so each dynamic scale, are the same (a scale
is the amax of what one GEMM multiplies: a micro-batch's tokens). Two launches, every
dimension a float8 linear meets: ZeRO-3 (its float8 weight all-gather), tp + SP (weight
shards and row-parallel inputs, whose amaxes are all-reduced), a pipeline, dp and ZeRO-2,
and ring context parallel (a sequence's tokens over two ranks).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import config, initial_params, run_layout

from plait.parallel.parallelize import DTYPES
from plait.testing import assert_parity, merge_ranks

MODEL = ("model.n_layers=4", "model.tie_embeddings=false", "train.steps=3",
         "train.precision=fp8")
ROWS = {
    "dp2 z3 tp2 sp pp2:1f1b": ("parallel.dp=2", "parallel.zero=3", "parallel.tp=2",
                               "parallel.sp=true", "parallel.pp=2",
                               "parallel.schedule=1f1b", "parallel.microbatches=4"),
    "dp2 z2 cp2:ring": ("parallel.dp=2", "parallel.zero=2", "parallel.cp=2",
                        "parallel.cp_mode=ring", "parallel.microbatches=2"),
}


def reference_of(sets: tuple[str, ...]) -> SimpleNamespace:
    """The one-process fp8 run with the layout's micro-batches in all (dp x its own)."""
    cfg = config(*MODEL, *sets)
    micro = cfg.parallel.dp * cfg.microbatches()
    run = run_layout(*MODEL, f"parallel.microbatches={micro}")[0]
    return SimpleNamespace(losses=run["losses"], grad_norms=run["grad_norms"],
                           params=run["params"], first_grads=run["first_grads"])


CASES = [("dp2 z3 tp2 sp pp2:1f1b", "fp32"), ("dp2 z2 cp2:ring", "fp32"),
         ("dp2 z2 cp2:ring", "bf16")]


@pytest.mark.parametrize("row, around", CASES, ids=[f"{r} {a}" for r, a in CASES])
def test_fp8_layout_equals_the_single_process_fp8_run(row, around, monkeypatch):
    """Every rank's loss and grad norm, the first gradients and the final parameters
    against the one-process fp8 run. `around` fp32: the float8 GEMMs in an fp32 model
    (the "fp8-fp32" class): sums reorder at fp32's ulp, so a float8 value rarely rounds
    the other way, and a scale not the whole tensor's (an amax not reduced over tp or cp)
    shows ~100x over the bound; bf16 is the run users make (the "fp8" class)."""
    if around == "fp32":  # inherited by the forked ranks and the reference
        monkeypatch.setitem(DTYPES, "fp8", torch.float32)
    outs = run_layout(*MODEL, *ROWS[row])
    ref = reference_of(ROWS[row])
    cls = "fp8-fp32" if around == "fp32" else "fp8"
    assert_parity(merge_ranks(outs), ref, cls, init=initial_params(*MODEL))
