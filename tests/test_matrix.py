"""One parity matrix over all five dimensions: every row of tests/matrix.py
against the single-process run, the ledger against the planner, the measured memory
against the planner's eager model, and checkpoint round trips between rows.

Each row trains once (`row_run`, cached per process); the checks read that one run.
docs/parity_matrix.md has the table; `python tests/parity_table.py` regenerates it.
"""

from __future__ import annotations

import shutil
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import (
    assert_ranks_memory_match,
    batches_for,
    config,
    initial_params,
    moe_biases,
    reference,
    run_layout,
    session_dir,
)
from matrix import (
    ALL_ROWS,
    ASYNC_TP_ROWS,
    LONG_CONTEXT_ROWS,
    MLA_ROWS,
    RECIPE_ROWS,
    ROUND_TRIP_STEP,
    ROWS,
    SCHEDULES,
    SLOW_ROWS,
    STEPS,
    coverable_pairs,
    parse,
    valid_rows,
    validity,
)

from plait.checkpoint import Checkpointing
from plait.launch.forked import run_ranks
from plait.ledger import control_bytes, data_bytes_by_dim
from plait.mesh import ParallelMesh
from plait.model.transformer import build_model
from plait.plan import estimate_config, rank_collectives
from plait.plan.comm.rank import bytes_by_dim
from plait.plan.runtime_memory import not_covered
from plait.testing import assert_parity, merge_ranks
from plait.train.loop import TrainOptions, full_state, train

ROOT = session_dir("matrix")
# (source row, destination row): save after step 1 in one layout, train step 2 in the
# other; sources and destinations of different worlds, meshes, ZeRO stages and schedules
ROUND_TRIPS = (
    ("dp4 z3 cp2:ring moe ep2", "tp2 sp pp2:dualpipev moe"),  # experts ZeRO-3 over edp=4
    ("tp2 sp pp2:dualpipev moe", "dp4 z3 moe ep4"),
    ("dp2 z3 tp2 rc", "pp2:zb-h1 rcs"),
    ("pp2:dualpipe", "dp4 rc"),  # DualPipe's two copies -> one
    ("z2 cp2:allgather", "tp2 pp2:dualpipe cp2:ring"),
    ("pp2:zb-h1 rcs", "z1 pp4:zb-h1 cp2:ring rc"),
    ("dp4 z1 tp2 moe ep4 rcs", "z1 tp2 sp pp2:zb-v cp2:ring moe ep2"),
    ("z3 cp2:ring moe ep2", "pp2:1f1b moe"),
    ("dp2 z1 pp2:zb-v moe ep2", "z2 tp2 cp2:allgather moe ep2"),
    ("moe", "dp4 z1 pp2:zb-v moe ep4"),  # 1 rank -> 8
    ("z1 pp2:dualpipev cp2:allgather bf16", "tp2 sp pp4:dualpipe bf16"),
    # hybrid sharding over dp x cp, experts unsharded in their shard groups: one copy of
    # each shard written -> 1 rank
    ("dp2x2 z3 cp2:ring moe ep4", "moe"),
    ("dp4 z3 moe ep4", "dp2x2 z3 tp2 moe ep2"),  # ZeRO-3 over 4 -> over 2, copied twice
    ("dp2 z3 pp2:dualpipe", "z2 cp2:allgather"),  # ZeRO-3's two copies -> ZeRO-2, no pp
)
SOURCES = {src for src, _ in ROUND_TRIPS}

# the first model built on meta imports torch's reference ops (~10 s a process on a busy
# machine): once here, so that the forked ranks inherit them instead of each paying
build_model(config(*parse("rc")["model"]).model, seed=0, device="meta")


def precision_of(row: str) -> str:
    """The row's tolerance class (plait/testing.py PARITY_TOLERANCES, docs/parity.md):
    bf16 compute is held to bf16's bounds whatever else it runs with (with MoE, routing
    flips excepted); every other row runs in float64, held to its epsilon-derived bounds."""
    lv = parse(row)["levels"]
    if lv["precision"] == "bf16":
        return "bf16-moe" if lv["ep"] != "dense" else "bf16"
    return "fp8-fp64" if "fp8" in row.split() else "fp64"


def row_sets(row: str) -> tuple[str, ...]:
    """The row's config (in float64 unless the row says bf16: tests/helpers.py BASE)."""
    return (*parse(row)["sets"], f"train.steps={STEPS}")


def memory_sets(row: str) -> tuple[str, ...]:
    """The row in fp32 (bf16 or fp8 where it says so) with memory measured on step 1: the planner's
    eager model (plait/plan/runtime_memory.py) prices fp32 and bf16 runs, not float64's, so
    the memory check is a run of its own where the model covers the row (`not_covered`)."""
    sets = row_sets(row)
    if "fp8" in row.split():  # float8 around bf16, the run users make
        sets = (*sets, "train.fp8_compute=bf16")
    elif "train.precision=bf16" not in sets:
        sets = (*sets, "train.precision=fp32")  # after BASE's fp64: the last setting wins
    return (*sets, "train.memory_step=1")


def _rank(rank: int, world: int, sets: list[str], ck: dict | None) -> dict:
    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    checkpoint = Checkpointing(**ck) if ck is not None else None
    resumed = ck is not None and "resume" in ck
    result = train(cfg, mesh, batches_for(cfg),
                   TrainOptions(capture_first_grads=not resumed, checkpoint=checkpoint))
    moe = cfg.model.n_experts > 0
    return {"losses": result.losses, "grad_norms": [m["grad_norm"] for m in result.metrics],
            **({"aux_losses": [m["moe"]["aux_loss"] for m in result.metrics],
                "biases": moe_biases(result.model)} if moe else {}),
            "params": full_state(result.model, result.optimizer, mesh, result.placements),
            "first_grads": result.first_grads, "metrics": result.metrics,
            "ledger": [r for r in mesh.ledger.to_dicts() if r["step"] == 1],
            "pp_rank": mesh.coord("pp")}


def run_row(sets: tuple[str, ...], ck: dict | None = None) -> list[dict]:
    batches_for(config(*sets))  # its token file made once, before the ranks fork
    return run_ranks(_rank, config(*sets).parallel.world_size, list(sets), ck)


def checkpoint_dir(row: str) -> Path:
    return ROOT / row.replace(" ", "_").replace(":", "-")


@cache
def row_run(row: str) -> list[dict]:
    """The row's run; a round trip's source saves a checkpoint after every step."""
    ck = None
    if row in SOURCES:
        shutil.rmtree(checkpoint_dir(row), ignore_errors=True)
        ck = {"dir": checkpoint_dir(row), "every": ROUND_TRIP_STEP}
    return run_row(row_sets(row), ck)


@cache
def row_reference(row: str):
    """The single-process run: torch's (plait/train/reference.py); for float8 plait's own
    one-process fp8 run with as many micro-batches as the row has in all, so that each
    GEMM, and so each dynamic scale, sees the same tokens (tests/test_fp8_parity.py)."""
    model = (*parse(row)["model"], f"train.steps={STEPS}")
    if "fp8" not in row.split():
        return reference(*model)
    cfg = config(*row_sets(row))
    micro = cfg.parallel.dp * cfg.microbatches()
    run = run_layout(*model, f"parallel.microbatches={micro}")[0]
    return SimpleNamespace(losses=run["losses"], grad_norms=run["grad_norms"],
                           params=run["params"], first_grads=run["first_grads"],
                           lr=cfg.train.lr)


def test_rows_cover_every_pair_and_schedule():
    """Every pair of levels some valid layout has is in a row, every schedule appears,
    every row is valid; the pairs no valid layout has are refused (listed in
    docs/parity_matrix.md with their reasons)."""
    valid = valid_rows()
    missing = coverable_pairs(valid) - coverable_pairs(ROWS)
    assert not missing, f"pairs no row covers (python tests/matrix.py): {sorted(missing)}"
    assert {parse(r)["schedule"] for r in ROWS} >= set(SCHEDULES)
    assert len(ROWS) >= 48 and len(set(ROWS)) == len(ROWS)
    assert set(ROWS) <= set(valid), set(ROWS) - set(valid)
    assert {r for pair in ROUND_TRIPS for r in pair} <= set(ROWS)
    assert all(not validity(r) and "mla" in r.split() for r in MLA_ROWS), MLA_ROWS
    assert all(not validity(r) for r in LONG_CONTEXT_ROWS), LONG_CONTEXT_ROWS
    assert all(not validity(r) and "atp" in r.split() for r in ASYNC_TP_ROWS), ASYNC_TP_ROWS
    assert {t for r in RECIPE_ROWS for t in r.split()} >= {"docs", "fp8", "cmp"}
    assert all(not validity(r) for r in RECIPE_ROWS), RECIPE_ROWS


def _rows() -> list:
    return [pytest.param(r, marks=[pytest.mark.slow] if r in SLOW_ROWS else [])
            for r in ALL_ROWS]


@pytest.mark.parametrize("row", _rows())
def test_row_equals_the_single_process_run(row):
    """Every rank's loss and grad norm at every step, every first-step gradient and final
    parameter (gathered: replicas and tp/cp ranks must agree exactly), and with MoE every
    rank's balance loss and the balancing biases, against the single-process run."""
    outs = row_run(row)
    init = initial_params(*parse(row)["model"], f"train.steps={STEPS}")
    assert_parity(merge_ranks(outs), row_reference(row), precision_of(row), init=init)


@pytest.mark.slow  # a run of its own per row (fp32); tests/test_predict_vs_measured.py's
# layouts hold the eager model in the fast tier
@pytest.mark.parametrize("row", [r for r in ALL_ROWS
                                 if not_covered(config(*memory_sets(r))) is None])
def test_row_memory_equals_the_eager_model(row):
    """Peak live bytes per rank and by category at the peak within 5 % of the planner's
    eager model (tests/helpers.py, assert_ranks_memory_match), on the row's fp32 (or
    bf16) run; the rows it does not cover are in docs/parity_matrix.md with its reason
    (plait.plan.runtime_memory.not_covered)."""
    sets = memory_sets(row)
    assert_ranks_memory_match(run_row(sets), config(*sets), row)


def _round_trip_param(src: str, dst: str):
    """A round trip: the slow tier (a launch of its own each; the fast tier reshards
    through tests/test_checkpoint.py's pairs)."""
    return pytest.param(src, dst, id=f"{src} -> {dst}", marks=[pytest.mark.slow])


@pytest.mark.parametrize("src, dst", [_round_trip_param(a, b) for a, b in ROUND_TRIPS])
def test_round_trip_continues_within_parity(src, dst):
    """Save after step 1 in one row's layout, resume in another's for step 2 (Adam's
    moments, the step count and the schedule's position all come from the checkpoint):
    the stitched run equals the single-process run at the looser of the two rows'
    bounds."""
    first = row_run(src)
    sets = row_sets(dst)
    resumed = run_row(sets, {"resume": str(checkpoint_dir(src) / f"step-{ROUND_TRIP_STEP:08d}")})
    head = first[0]
    run = {"losses": head["losses"][:ROUND_TRIP_STEP] + resumed[0]["losses"],
           "grad_norms": head["grad_norms"][:ROUND_TRIP_STEP] + resumed[0]["grad_norms"],
           "params": merge_ranks(resumed)["params"]}
    order = ["fp64", "fp8-fp64", "bf16", "bf16-moe"]
    precision = max(precision_of(src), precision_of(dst), key=order.index)
    init = initial_params(*parse(src)["model"], f"train.steps={STEPS}")
    assert_parity(run, row_reference(src), precision, init=init)


@pytest.mark.parametrize("row", _rows())
def test_row_ledger_equals_the_planner(row):
    """Every mesh dim's bytes in one step equal the planner's collectives (size x count),
    exactly: the busiest rank's (`evaluate` describes it), and every rank's its own pipeline
    rank's (`rank_collectives`: the runtime's partition, ends and sends); for ep the mean
    over ranks (routing decides who sends what; all-to-all conserves the total). The
    control collectives the planner leaves out (plait/ledger.py CONTROL_TAGS) stay
    under 2 % of a rank's data bytes."""
    outs = row_run(row)
    cfg = config(*row_sets(row))
    ep = cfg.parallel.ep
    planned = bytes_by_dim(estimate_config(cfg).collectives, ep)
    per_rank = [data_bytes_by_dim(o["ledger"]) for o in outs]
    for dim in sorted(set(planned) | {d for p in per_rank for d in p}):
        got = [p.get(dim, 0.0) for p in per_rank]
        measured = sum(got) / len(got) if dim == "ep" else max(got)
        assert planned.get(dim, 0.0) == pytest.approx(measured, rel=1e-12, abs=0.5), (
            f"{dim}: planner {planned.get(dim, 0.0):.0f} B, ledger {measured:.0f} B")
    for pp_rank in sorted({o["pp_rank"] for o in outs}):
        own = bytes_by_dim(rank_collectives(cfg, pp_rank), ep)
        ranks = [p for o, p in zip(outs, per_rank, strict=True) if o["pp_rank"] == pp_rank]
        for dim in sorted(set(own) | {d for p in ranks for d in p}):
            got = [p.get(dim, 0.0) for p in ranks]
            measured = sum(got) / len(got) if dim == "ep" else max(got)
            assert min(got) == max(got) or dim == "ep", f"pp rank {pp_rank} {dim}: {got}"
            assert own.get(dim, 0.0) == pytest.approx(measured, rel=1e-12, abs=0.5), (
                f"pp rank {pp_rank} {dim}: planner {own.get(dim, 0.0):.0f} B, "
                f"ledger {measured:.0f} B")
    for o, p in zip(outs, per_rank, strict=True):
        assert control_bytes(o["ledger"]) <= max(0.02 * sum(p.values()), 64)
