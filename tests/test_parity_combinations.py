"""Parity the parity matrix does not cover: tied embeddings trained, and the ledger's link
and times (the combinations of bf16, recompute, tp and the schedules are in the parity
matrix, tests/test_matrix.py). Same oracle and tolerances as everywhere (plait/testing.py,
docs/parity.md)."""

import pytest
from helpers import reference, run_layout

from plait.testing import assert_parity, merge_ranks

PP_MODEL = ("model.n_layers=4", "model.tie_embeddings=false")


def test_tied_embeddings_trained_parity():
    # the embedding and the head are one tensor: its gradient is the sum of both uses, and
    # it is synced, counted in the norm and updated once
    tied = ("model.tie_embeddings=true",)
    outs = run_layout(*tied, "parallel.dp=2", "parallel.microbatches=2")
    ref = reference(*tied)
    assert "head.weight" not in ref.params  # really one tensor
    assert_parity(merge_ranks(outs), ref)
    outs = run_layout(*tied, "parallel.dp=2", "parallel.tp=2", "parallel.sp=true")
    assert_parity(merge_ranks(outs), ref)


# bf16 with tp (+SP, ZeRO-1) and pp, recompute with tp + SP, ZeRO-1, pp and pp x tp, and
# every schedule under tp (+SP): the parity matrix (tests/test_matrix.py) pairs each of
# these levels with every other


@pytest.mark.parametrize("gpus_per_node, want", [(8, {"dp": "intra", "tp": "intra"}),
                                                 (2, {"dp": "inter", "tp": "intra"})])
def test_ledger_link_and_times(gpus_per_node, want):
    """Every record names the link its group uses (tp innermost: with 2 GPUs a node the tp
    pairs stay inside a node, the dp groups cross nodes), the gradients' all-reduces among
    them (their times are measurements, not asserted: benchmarks/)."""
    outs = run_layout("parallel.dp=2", "parallel.tp=2", "train.steps=1",
                      f"parallel.gpus_per_node={gpus_per_node}")
    for o in outs:
        recs = [r for r in o["ledger"] if r["dim"] in want]
        assert {r["dim"] for r in recs} == set(want)
        for r in recs:
            assert r["link"] == want[r["dim"]], r
        assert {r["dim"] for r in recs if r["tag"] == "grads"} == {"dp"}
