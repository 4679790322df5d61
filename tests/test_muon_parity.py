"""Muon under the layouts built for it (ranks holding whole matrices) against the
single-process reference Muon (plait/train/reference.py), in float64 with the
Newton-Schulz iteration in float64: every step's loss and grad norm on every rank, the
first step's gradients, every final parameter (plait/testing.py's fp64 class)."""

import re

import pytest
from helpers import ELEMENT_BYTES, config, reference, run_layout

from plait.launch.forked import run_ranks
from plait.plan.muon import muon_tp_payload
from plait.testing import assert_parity, merge_ranks

MUON = ("train.optimizer=muon", "train.muon_ns_dtype=fp64", "model.tie_embeddings=false")


def test_muon_data_and_pipeline_parallel_parity():
    sets = (*MUON, "model.n_layers=4")
    outs = run_layout(*sets, "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2")
    assert_parity(merge_ranks(outs), reference(*sets))
    assert "muon (moonlight scale" in outs[0]["summary"]["optimizer"]


def test_muon_moe_expert_parallel_parity_each_expert_its_own_matrix():
    sets = (*MUON, "model_name=tiny-moe", "train.muon_scale=original")
    outs = run_layout(*sets, "parallel.dp=2", "parallel.ep=2")
    assert_parity(merge_ranks(outs), reference(*sets))



def _zero_rank(rank: int, world: int, sets: list[str]) -> dict:
    """A ZeRO rank's run, with its pieces of each Muon momentum buffer (name -> (first
    element, elements)), its bytes sent by Muon's all-to-alls, the matrices' owners."""
    from helpers import batches_for, config

    from plait.mesh import ParallelMesh
    from plait.muon import is_muon_matrix
    from plait.plan.muon import muon_payload
    from plait.train.loop import full_state, train

    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    result = train(cfg, mesh, batches_for(cfg))
    opt = result.optimizer
    pieces = {}
    for u in opt.units:
        for name, p, off in zip(u.names, u.params, u.offsets, strict=True):
            for a, b, q in u.segments():
                if q is p and is_muon_matrix(name, p):
                    plain = re.sub(r"^stages\.\d+\.", "", name)  # a stage's prefix
                    # expert parallel: this rank's experts, a run of the whole stack
                    first = mesh.coord("ep") * p.numel() if ".experts." in name else 0
                    pieces[plain] = (first + u.lo + a - off,
                                     opt.muon.momentum[id(u)][a:b].clone())
    me = {d: mesh.coord(d) for d in opt.muon.groups}  # this rank in each shard group
    return {"losses": result.losses, "grad_norms": [m["grad_norm"] for m in result.metrics],
            "params": full_state(result.model, opt, mesh, result.placements),
            "momentum": pieces, "balance": opt.muon.balance(),
            # the optimizer's bytes against AdamW's three fp32 states (master and two
            # moments): Muon's momentum lives in the first moment's buffer
            "optimizer_bytes": sum(t.numel() * t.element_size()
                                   for t in opt.memory_sources()["optimizer"]),
            "adamw_bytes": sum(3 * u.master.numel() * u.master.element_size()
                               for u in opt.units),
            "cut": sum(0 < _len(m.piece(me[d])) < m.stop - m.start
                       for d, ms in opt.muon.groups.items() for m in ms),
            "muon_sent": sum(r["sent"] for r in mesh.ledger.to_dicts() if r["tag"] == "muon"),
            "muon_payload": sum(r["payload"] for r in mesh.ledger.to_dicts()
                                if r["tag"] == "muon") / cfg.train.steps,
            "planned": (None if cfg.model.n_experts else
                        muon_payload(cfg, mesh.coord("pp"), mesh.coord(opt.dim))),
            # what this rank sends a step: its pieces of others' matrices, there, and the
            # other ranks' pieces of its own, back
            "expected_sent": sum(
                (m.stop - m.start - _len(m.piece(me[d]))) if m.owner == me[d]
                else _len(m.piece(me[d])) for d, ms in opt.muon.groups.items() for m in ms)}


def _len(span: tuple[int, int]) -> int:
    return span[1] - span[0]


@pytest.mark.parametrize("layout", [
    # units of about 0.1 MB: ZeRO-1/2's shard boundaries fall inside matrices
    ("parallel.zero=1", "parallel.bucket_mb=0.1"), ("parallel.zero=2", "parallel.bucket_mb=0.1"),
    ("parallel.zero=3",),
    ("parallel.zero=1", "parallel.pp=2", "parallel.microbatches=2"),
    ("parallel.zero=3", "parallel.pp=2", "parallel.schedule=interleaved",
     "parallel.microbatches=4"),
    ("parallel.zero=2", "parallel.cp=2"),
    # experts sharded over their own group (edp), each expert's matrix alone
    ("model_name=tiny-moe", "parallel.dp=4", "parallel.ep=2", "parallel.zero=1",
     "parallel.bucket_mb=0.1"),
    ("model_name=tiny-moe", "parallel.ep=2", "parallel.zero=3"),
])
def test_muon_zero_parity_every_rank_and_the_momentum(layout):
    """dp 2 under ZeRO (with pp: each stage's shard group; with cp: dp x cp; with ep: the
    experts' own shard group): each
    matrix cut by the shard boundaries, orthogonalised whole on its owner; parameters,
    losses and norms in the fp64 class, every rank's pieces of every momentum buffer equal
    to the reference's, Muon's bytes as its pieces say, the work within 1.3x."""
    sets = (*MUON, "model.n_layers=4", *(s for s in layout if s.startswith("model")))
    run = ("parallel.dp=2", *(s for s in layout if not s.startswith("model")))
    cfg = config(*sets, *run)
    outs = run_ranks(_zero_rank, cfg.parallel.world_size, [*sets, *run])
    ref = reference(*sets)
    assert_parity(merge_ranks(outs), ref)
    covered = dict.fromkeys(ref.momentum, 0)
    for out in outs:
        for name, (start, piece) in out["momentum"].items():
            want = ref.momentum[name].reshape(-1)[start:start + piece.numel()]
            assert (piece - want).abs().max() <= 1e-12 * want.abs().max(), name
            covered[name] += piece.numel()
        steps = cfg.train.steps
        assert out["muon_sent"] == out["expected_sent"] * ELEMENT_BYTES * steps
        assert all(b <= 1.3 for b in out["balance"].values()), out["balance"]
        assert out["cut"] > 0  # some matrix really is in pieces on this rank
        assert out["optimizer_bytes"] == out["adamw_bytes"]
        if out["planned"] is not None:  # the planner's count of this rank's payload
            assert out["muon_payload"] == out["planned"]
    assert covered == {n: t.numel() for n, t in ref.momentum.items()}  # each element once


@pytest.mark.parametrize("layout,world,rank", [
    (("parallel.dp=2", "parallel.zero=1"), 2, 1),
    (("parallel.dp=2", "parallel.zero=3", "parallel.pp=2", "parallel.microbatches=2"), 4, 3),
    (("parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2"), 4, 1),
])
def test_muon_dry_run_bytes_equal_the_planner(layout, world, rank):
    """One rank on the fake process group: the ledger's bytes by dim, Muon's all-to-alls
    among them, equal to the planner's (plait/plan/muon.py beside the rank's own)."""
    from test_dry_run import _dry

    dry = _dry([*MUON, "model.n_layers=4", *layout], world, rank)
    assert dry["data_bytes_per_step"] == dry["predicted_bytes_per_step"]


@pytest.mark.parametrize("layout", [
    ("parallel.tp=2",),
    ("parallel.dp=2", "parallel.tp=2", "parallel.sp=true"),
    ("parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2"),
])
def test_muon_tensor_parallel_parity(layout):
    """Tensor parallel's row and column slices joined on each matrix's owner, the
    orthogonalised slices returned: the fp64 class against the reference; every tp rank
    sends Muon's all-to-alls over tp, and only there."""
    sets = (*MUON, "model.n_layers=4")
    outs = run_layout(*sets, *layout)
    assert_parity(merge_ranks(outs), reference(*sets))
    cfg = config(*sets, *layout)
    p = cfg.parallel
    for rank, out in enumerate(outs):
        dims = {r["dim"] for r in out["ledger"] if r["tag"] == "muon"}
        assert dims == {"tp"}, dims
        payload = sum(r["payload"] for r in out["ledger"] if r["tag"] == "muon")
        # ranks innermost tp, then cp, pp, dp (the default order)
        planned = muon_tp_payload(cfg, rank // (p.tp * p.cp) % p.pp, rank % p.tp)
        assert payload == planned * cfg.train.steps


@pytest.mark.parametrize("layout,world,rank", [
    (("parallel.dp=2",), 2, 1),
    (("parallel.tp=2",), 2, 1),
    (("parallel.pp=2", "parallel.microbatches=2"), 2, 1),
])
def test_muon_optimizer_memory_is_the_planners(layout, world, rank):
    """ZeRO 0: one fp32 momentum buffer a Muon matrix element where AdamW keeps two
    moments; the dry run's measured optimizer bytes at the peak equal the planner's,
    fp32."""
    from test_dry_run import _dry

    dry = _dry([*MUON, "model.n_layers=4", "train.precision=fp32", *layout], world, rank)
    assert dry["memory"]["peak"]["optimizer"] == dry["predicted_memory"]["optimizer states"]
