"""Float8 layouts against the single-process float8 run (the "fp8" class of
plait/testing.py's PARITY_TOLERANCES, docs/parity.md).

The reference is plait's own one-process fp8 run with as many micro-batches as the layout
has in all, so that each GEMM's tokens, and so each dynamic scale, are the same (a scale
is the amax of what one GEMM multiplies: a micro-batch's tokens). Two launches, every
dimension a float8 linear meets: ZeRO-3 (its float8 weight all-gather), tp + SP (weight
shards and row-parallel inputs, whose amaxes are all-reduced), a pipeline, dp and ZeRO-2,
and ring context parallel (a sequence's tokens over two ranks). The blockwise recipe
(`train.fp8_recipe`) against the one-process blockwise run: ZeRO-3 with tp + SP (its
block-scaled all-gather) and ring context parallel.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import config, initial_params, run_layout

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
# the blockwise recipe in tiles of 8 (whole on every rank of these splits: a tp rank's
# 32 and 88 features, a cp rank's chunks of 16 tokens); ZeRO-3's shards cut its blocks
BLOCKWISE = ("train.fp8_recipe=blockwise", "train.fp8_block=8")
ROWS.update({
    "dp2 z3 tp2 sp blockwise": ("parallel.dp=2", "parallel.zero=3", "parallel.tp=2",
                                "parallel.sp=true", "parallel.microbatches=2", *BLOCKWISE),
    "dp2 z2 cp2:ring blockwise": (*ROWS["dp2 z2 cp2:ring"], *BLOCKWISE),
    # MoE: the routed and the shared experts in float8, replicated over tp
    "dp2 z3 tp2 moe blockwise": ("model_name=tiny-moe", "parallel.dp=2", "parallel.zero=3",
                                 "parallel.tp=2", "parallel.microbatches=2", *BLOCKWISE),
})
RECIPE_SETTINGS = ("train.fp8_compute=", "train.fp8_recipe=", "train.fp8_block=",
                   "model_name=")


def reference_of(sets: tuple[str, ...]) -> SimpleNamespace:
    """The one-process fp8 run with the layout's micro-batches in all (dp x its own)."""
    cfg = config(*MODEL, *sets)
    micro = cfg.parallel.dp * cfg.microbatches()
    recipe = [s for s in sets if s.startswith(RECIPE_SETTINGS)]
    run = run_layout(*MODEL, *recipe, f"parallel.microbatches={micro}")[0]
    return SimpleNamespace(losses=run["losses"], grad_norms=run["grad_norms"],
                           params=run["params"], first_grads=run["first_grads"],
                           lr=cfg.train.lr)


CASES = [("dp2 z3 tp2 sp pp2:1f1b", "fp64"), ("dp2 z2 cp2:ring", "fp64"),
         ("dp2 z2 cp2:ring", "bf16"), ("dp2 z3 tp2 sp blockwise", "fp64"),
         ("dp2 z2 cp2:ring blockwise", "fp64"), ("dp2 z3 tp2 moe blockwise", "fp64")]


# the 8-rank row and the MoE one in the slow tier; ring context parallel (its amaxes
# reduced over cp) and ZeRO-3's block-scaled gather (4 ranks) stay
SLOW_ROWS = ("dp2 z3 tp2 sp pp2:1f1b", "dp2 z3 tp2 moe blockwise")


@pytest.mark.parametrize("row, around", [
    pytest.param(r, a, id=f"{r} {a}", marks=[pytest.mark.slow] * (r in SLOW_ROWS))
    for r, a in CASES])
def test_fp8_layout_equals_the_single_process_fp8_run(row, around):
    """Every rank's loss and grad norm, the first gradients and the final parameters
    against the one-process fp8 run. `around` fp64 (`train.fp8_compute=fp64`): the float8
    GEMMs in a float64 model, accumulating in float64 (the "fp8-fp64" class): equal inputs
    quantise equally, so the layout is held to float64's bounds, and a scale not the whole
    tensor's (an amax not reduced over tp or cp) is far outside them; bf16 is the run
    users make (the "fp8" class)."""
    sets = (*ROWS[row], "train.fp8_compute=fp64") if around == "fp64" else ROWS[row]
    outs = run_layout(*MODEL, *sets)
    ref = reference_of(sets)
    cls = "fp8-fp64" if around == "fp64" else "fp8"
    model = [s for s in sets if s.startswith("model_name=")]
    assert_parity(merge_ranks(outs), ref, cls, init=initial_params(*MODEL, *model))
