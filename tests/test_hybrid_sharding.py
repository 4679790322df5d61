"""Hybrid sharding (plait/dims/dp_replicate.py): ZeRO over dp_shard ranks, the reduced
shards all-reduced over dp_replicate. Parity with the single-process run, the groups, the
ledger's bytes on each group by formula, and the checks that refuse what is not built.
Checkpoints saved under one split and resumed under another: tests/test_checkpoint.py;
the matrix's rows with it: tests/matrix.py (`dpNxM`)."""

import pytest
from helpers import ELEMENT_BYTES, config, reference, shared_run

from plait.config import load_config
from plait.ledger import data_bytes_by_dim
from plait.mesh import ParallelMesh
from plait.plan import estimate_config
from plait.plan.comm.rank import bytes_by_dim, rank_bytes_by_dim
from plait.testing import assert_parity, merge_ranks

HYBRID = ("parallel.dp_shard=2", "parallel.dp_replicate=2", "parallel.microbatches=2")


def _run(stage: int) -> list[dict]:
    """dp = 2 x 2, two micro-batches a replica: one run per stage."""
    return shared_run(*HYBRID, f"parallel.zero={stage}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parity_and_replicas_hold_the_same_shards(stage):
    outs = _run(stage)
    assert all(m["grad_norm"] > 0.5 for m in outs[0]["metrics"])  # clipping is active
    # merge_ranks asserts every rank's gathered parameters equal exactly: a shard and its
    # copy in the other shard group step with the same summed gradient
    assert_parity(merge_ranks(outs), reference())


def test_pipeline_with_post_validation_and_the_i_w_split():
    """Each stage updates optimistically and checks the norm afterwards: the norm's shards
    are counted once over the shard groups' copies (an over-count would fail the check's
    parity, an under-count the clipping)."""
    from helpers import run_layout

    model = ("model.n_layers=4", "model.tie_embeddings=false")
    outs = run_layout(*model, "parallel.dp_shard=2", "parallel.dp_replicate=2",
                      "parallel.zero=1", "parallel.pp=2", "parallel.schedule=zb-h2",
                      "parallel.microbatches=2", "parallel.optimizer_sync=post_validation")
    assert_parity(merge_ranks(outs), reference(*model))


def _unit_bytes(n: int, stage: int) -> list[int]:
    """Each unit's fp32 bytes, padded to a multiple of n (zero_units.py's units)."""
    from plait.model.transformer import build_model
    from plait.parallel.zero_units import zero_unit_groups

    cfg = config()
    model = build_model(cfg.model, seed=0, device="meta")
    cap = None if stage == 3 else cfg.parallel.bucket_mb * 2**20
    return [-(-sum(p.numel() for _, m in group for p in m.parameters()) // n) * n * ELEMENT_BYTES
            for _, group in zero_unit_groups(model, cap)]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ledger_bytes_on_each_group(stage):
    """Inside dp_shard (n = 2): ZeRO's own bytes (tests/test_zero.py's formula over n);
    over dp_replicate (m = 2): one all-reduce of each unit's shard a step, 2(m-1)/m of it
    a rank. With dp = 4 unsplit, ZeRO's per-rank bytes would be 3/4 of everything per
    collective instead of 1/2: the split moves fewer bytes over the wide group."""
    n, m, micro = 2, 2, 2
    outs = _run(stage)
    total = sum(_unit_bytes(n, stage))
    half = (n - 1) / n * total  # one reduce-scatter or all-gather of everything over n
    inside = {1: {"reduce_scatter": half, "all_gather": half},
              2: {"reduce_scatter": micro * half, "all_gather": half},
              3: {"reduce_scatter": micro * half, "all_gather": 2 * micro * half}}[stage]
    across = 2 * (m - 1) / m * total / n
    for rank in (0, 3):
        for step in range(2):
            recs = [r for r in outs[rank]["ledger"] if r["step"] == step
                    and r["tag"] not in ("metrics", "grad_norm", "state")]
            got = {op: sum(r["sent"] for r in recs if r["dim"] == "dp_shard" and r["op"] == op)
                   for op in inside}
            assert got == pytest.approx(inside, rel=1e-12), (rank, step, got)
            over = [r for r in recs if r["dim"] == "dp_replicate"]
            assert {r["op"] for r in over} == {"all_reduce"}
            assert sum(r["sent"] for r in over) == pytest.approx(across, rel=1e-12)
            assert {r["dim"] for r in recs} == {"dp_shard", "dp_replicate"}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ledger_equals_the_planner(stage):
    """Every rank's data bytes per group in each step equal the planner's collectives
    (size x count), exactly: the busiest rank's (`evaluate`) and the pipeline rank's own
    (`rank_collectives`); ZeRO's inside "dp_shard", the shards' all-reduce over
    "dp_replicate" (tests/test_matrix.py makes the same comparison for the other rows)."""
    cfg = config(*HYBRID, f"parallel.zero={stage}")
    planned = bytes_by_dim(estimate_config(cfg).collectives, cfg.parallel.ep)
    assert set(planned) == {"dp_shard", "dp_replicate"}
    assert rank_bytes_by_dim(cfg, 0) == planned
    for out in _run(stage):
        for step in range(2):
            got = data_bytes_by_dim([r for r in out["ledger"] if r["step"] == step])
            assert got == pytest.approx(planned, rel=1e-12), (step, got, planned)


def test_groups_cut_the_replica_ranks_into_shard_blocks_and_their_copies():
    # dp 2 x 2 with cp 2: the replica ranks are dp x cp = 8 (ranks 0..7, cp innermost);
    # a shard group is 4 consecutive ones (2 dp x 2 cp), its copies 4 apart
    cfg = load_config(sets=["parallel.dp_shard=2", "parallel.dp_replicate=2", "parallel.cp=2",
                            "parallel.zero=3", "model.n_experts=8", "model.top_k=2",
                            "parallel.ep=2"])
    assert cfg.parallel.dp == 4 and cfg.parallel.world_size == 8
    mesh = ParallelMesh.arithmetic(cfg.parallel, 5)
    assert mesh.group_ranks["dp_shard"] == [4, 5, 6, 7]
    assert mesh.group_ranks["dp_replicate"] == [1, 5]
    assert mesh.group_ranks["ep"] == [4, 5]
    assert mesh.group_ranks["edp"] == [1, 3, 5, 7]
    assert mesh.group_ranks["edp_shard"] == [5, 7]  # the expert copies in the shard group
    assert mesh.shard_groups() == ({"dp_cp": "dp_shard", "edp": "edp_shard"}, "dp_replicate")
    # without replica groups ZeRO shards over the replica group itself, as before
    plain = ParallelMesh.arithmetic(load_config(sets=["parallel.dp=4"]).parallel, 1)
    assert plain.shard_groups() == ({}, None)
    assert plain.group_ranks["dp_shard"] == [0, 1, 2, 3]


@pytest.mark.parametrize("sets, fix", [
    (["parallel.dp=4", "parallel.dp_replicate=3", "parallel.zero=1"],
     "dp_replicate=3 does not divide dp=4; use one of 1, 2, 4"),
    (["parallel.dp=4", "parallel.dp_shard=4", "parallel.dp_replicate=2", "parallel.zero=1"],
     "dp_shard=4 x dp_replicate=2 = 8 but dp=4"),
    (["parallel.dp_shard=2", "parallel.dp_replicate=2"], "with zero=0: nothing is sharded"),
    (["parallel.dp_shard=2", "parallel.dp_replicate=2", "parallel.zero=2",
      "model.n_experts=8", "model.top_k=2", "parallel.ep=4"],
     "ep=4 with dp_replicate=2: ZeRO shards the experts inside each shard group of "
     "dp*cp/dp_replicate=2 ranks"),
])
def test_refused_with_the_fix_named(sets, fix):
    problems = load_config(sets=sets).validate()
    assert any(fix in p for p in problems), problems


@pytest.mark.parametrize("sets", [
    ["parallel.dp_replicate=2", "parallel.zero=0"],  # a replica of one rank each
    ["parallel.dp_shard=2", "parallel.dp_replicate=2", "parallel.zero=0"],
])
def test_plain_replicas_are_a_fault_tolerant_layout(sets):
    """With --fault-tolerance each replica is a unit of failure: plain data-parallel
    copies (zero=0) are accepted there, and only there."""
    assert load_config(sets=[*sets, "parallel.fault_tolerance=true"]).validate() == []
    assert any("--fault-tolerance to make each replica a unit of failure" in p
               for p in load_config(sets=sets).validate())
