"""Parity where it was missing (issue 24): tied embeddings trained, bf16 with TP and PP,
recompute with TP and PP, the remaining schedules under TP, and the ledger's link and
times. Same oracle and tolerances as everywhere (plait/testing.py, docs/parity.md)."""

import pytest
from helpers import initial_params, reference, run_layout

from plait.testing import assert_parity, merge_ranks

PP_MODEL = ("model.n_layers=4", "model.tie_embeddings=false")


def test_tied_embeddings_trained_parity():
    # the embedding and the head are one tensor: its gradient is the sum of both uses, and
    # it is synced, counted in the norm and updated once
    tied = ("model.tie_embeddings=true",)
    outs = run_layout(*tied, "parallel.dp=2", "parallel.microbatches=2")
    ref = reference(*tied)
    assert "head.weight" not in ref.params  # really one tensor
    assert_parity(outs[0], ref)
    outs = run_layout(*tied, "parallel.dp=2", "parallel.tp=2", "parallel.sp=true")
    assert_parity(outs[0], ref, "fp32-tp")


@pytest.mark.parametrize("layout, model", [
    (("parallel.tp=2", "parallel.sp=true"), ()),
    (("parallel.dp=2", "parallel.tp=2", "parallel.zero=1"), ()),
    (("parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=4"), PP_MODEL),
])
def test_bf16_with_tp_and_pp(layout, model):
    outs = run_layout("train.precision=bf16", *model, *layout)
    run = merge_ranks(outs[:2]) if "parallel.pp=2" in layout else outs[0]
    assert_parity(run, reference(*model), "bf16", init=initial_params(*model))


@pytest.mark.parametrize("layout, model, precision", [
    (("parallel.tp=2", "parallel.sp=true"), (), "fp32-tp"),
    (("parallel.dp=2", "parallel.zero=1", "parallel.microbatches=2"), (), "fp32"),
    (("parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=4"), PP_MODEL, "fp32"),
    (("parallel.pp=2", "parallel.tp=2", "parallel.schedule=gpipe",
      "parallel.microbatches=2"), PP_MODEL, "fp32-tp"),
])
def test_recompute_parity(layout, model, precision):
    outs = run_layout("train.recompute=full", *model, *layout)
    pp = "parallel.pp=2" in layout
    run = merge_ranks(outs[::2] if "parallel.tp=2" in layout else outs[:2]) if pp else outs[0]
    assert_parity(run, reference(*model), precision)


@pytest.mark.parametrize("schedule, extra", [
    ("gpipe", ()), ("interleaved", ("parallel.virtual_stages=2",)), ("zb-h2", ()),
    ("dualpipev", ()),
])
def test_pp2_tp2_remaining_schedules_parity(schedule, extra):
    # tests/test_three_d.py covers 1f1b, zb-h1, zb-v and dualpipe; these are the other four
    outs = run_layout(*PP_MODEL, "parallel.pp=2", "parallel.tp=2", "parallel.sp=true",
                      f"parallel.schedule={schedule}", "parallel.microbatches=4", *extra)
    assert_parity(merge_ranks(outs), reference(*PP_MODEL), "fp32-tp")


@pytest.mark.parametrize("gpus_per_node, want", [(8, {"dp": "intra", "tp": "intra"}),
                                                 (2, {"dp": "inter", "tp": "intra"})])
def test_ledger_link_and_times(gpus_per_node, want):
    """Every record names the link its group uses (tp innermost: with 2 GPUs a node the tp
    pairs stay inside a node, the dp groups cross nodes) and spans a non-negative time."""
    outs = run_layout("parallel.dp=2", "parallel.tp=2", "train.steps=1",
                      f"parallel.gpus_per_node={gpus_per_node}")
    for o in outs:
        recs = [r for r in o["ledger"] if r["dim"] in want]
        assert {r["dim"] for r in recs} == set(want)
        for r in recs:
            assert r["link"] == want[r["dim"]], r
            assert 0 <= r["end"] - r["start"] < 60, r
        # async bucket all-reduces are recorded at their wait: their span covers the rest of
        # backward, so it is longer than that of the synchronous TP all-reduces on average
        grads = [r["end"] - r["start"] for r in recs if r["tag"] == "grads"]
        assert grads and min(grads) >= 0
