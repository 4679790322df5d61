"""Muon under the layouts built for it (ranks holding whole matrices) against the
single-process reference Muon (plait/train/reference.py), in float64 with the
Newton-Schulz iteration in float64: every step's loss and grad norm on every rank, the
first step's gradients, every final parameter (plait/testing.py's fp64 class)."""

from helpers import reference, run_layout

from plait.testing import assert_parity, merge_ranks

MUON = ("train.optimizer=muon", "train.muon_ns_dtype=fp64", "model.tie_embeddings=false")


def test_muon_data_and_pipeline_parallel_parity():
    sets = (*MUON, "model.n_layers=4")
    outs = run_layout(*sets, "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2")
    assert_parity(merge_ranks(outs), reference(*sets))
    assert "muon (moonlight scale" in outs[0]["summary"]["optimizer"]


def test_muon_moe_data_parallel_parity_each_expert_its_own_matrix():
    sets = (*MUON, "model_name=tiny-moe", "train.muon_scale=original")
    outs = run_layout(*sets, "parallel.dp=2")
    assert_parity(merge_ranks(outs), reference(*sets))
