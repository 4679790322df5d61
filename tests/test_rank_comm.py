"""One pipeline rank's collectives (plait/plan/comm/rank.py): what `rank_part` reads from
the runtime's partition and schedule, summed over the ranks, is the whole model and every
boundary once; the bytes it prices are each rank's own (tests/test_matrix.py and
tests/test_dry_run.py compare them with the ledgers of real and dry runs)."""

import pytest
from helpers import config

from plait.plan import estimate_config, rank_collectives
from plait.plan.comm.rank import bytes_by_dim, rank_part
from plait.plan.comm.step import pp_sends_of_rank
from plait.schedule.lower import lower
from plait.schedule.registry import (
    SCHEDULE_NAMES,
    build_schedule,
    natural_virtual_stages,
    validate_schedule_request,
)

M = 8  # dualpipev at pp = 4 needs 2 pp - 1


def _cfg(schedule: str, pp: int, *sets: str):
    v = natural_virtual_stages(schedule, 2 if schedule == "interleaved" else None)
    layers = 4 * pp * v  # every schedule's stages get at least one layer
    return config(f"parallel.pp={pp}", f"parallel.schedule={schedule}",
                  f"parallel.microbatches={M}", f"model.n_layers={layers}",
                  "model.tie_embeddings=false", f"train.global_batch={M}", *sets)


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.parametrize("pp", [2, 4])
def test_ranks_together_hold_the_model_once_and_cross_each_boundary(schedule, pp):
    cfg = _cfg(schedule, pp)
    parts = [rank_part(cfg, r) for r in range(pp)]
    copies = 2 if schedule == "dualpipe" else 1  # DualPipe: each rank holds two copies
    layers = sorted(x for p in parts for x in p.layers)
    assert layers == sorted(list(range(cfg.model.n_layers)) * copies)
    # every micro-batch passes the embedding once and the head once
    assert sum(p.embedding_microbatches for p in parts) == M
    assert sum(p.head_microbatches for p in parts) == M
    # sends: forward and backward over every boundary between ranks, per micro-batch;
    # a micro-batch's chain crosses pp - 1 of them (V shapes: 2 (pp - 1), the turn local)
    crossings = {"interleaved": 2 * pp - 1, "zb-v": 2 * (pp - 1),
                 "dualpipev": 2 * (pp - 1)}.get(schedule, pp - 1)
    assert sum(p.sends for p in parts) == 2 * crossings * M


def test_pp1_rank_is_the_whole_model_and_the_busiest_rank():
    cfg = config("parallel.tp=2", "parallel.dp=2", "parallel.sp=true")
    part = rank_part(cfg, 0)
    assert part.layers == tuple(range(cfg.model.n_layers)) and part.sends == 0
    assert bytes_by_dim(rank_collectives(cfg, 0), 1) == bytes_by_dim(
        estimate_config(cfg).collectives, 1)


def test_end_ranks_run_only_their_end():
    """tp's embedding collectives on the first rank, the head's and the loss's on the
    last, none on a middle rank: the most loaded rank's list (`evaluate`) is the head's."""
    cfg = _cfg("1f1b", 4, "parallel.tp=2")
    ops = [{c.op: float(c.count) for c in rank_collectives(cfg, r)} for r in range(4)]
    loss = "all-reduce (vocab-parallel loss sums, fp64)"  # the float64 runs of helpers.BASE
    assert [o.get(loss, 0.0) for o in ops] == [0, 0, 0, M]
    ends = "all-reduce (embedding out, head grad)"
    assert [o.get(ends, 0.0) for o in ops] == [M, 0, 0, M]
    busiest = {c.op: float(c.count) for c in estimate_config(cfg).collectives}
    assert busiest[loss] == M and busiest[ends] == M


def test_a_rank_outside_the_pipeline_is_refused():
    with pytest.raises(ValueError, match="pp=2"):
        rank_part(_cfg("1f1b", 2), 2)


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_sends_closed_form_equals_the_lowered_schedule_on_every_rank(schedule):
    """The planner counts a rank's pipeline sends from the placement alone
    (`pp_sends_of_rank`); the runtime's lowering inserts them one by one. They agree for
    every schedule, pipeline size, micro-batch count and rank it can build."""
    checked = 0
    for pp in (2, 3, 4, 8):
        for m in (2, 4, 6, 8, 16):
            for v in ((2, 3) if schedule == "interleaved" else (None,)):
                v = natural_virtual_stages(schedule, v)
                if validate_schedule_request(schedule, pp, m, v):
                    continue
                lowered = lower(build_schedule(schedule, pp, m, v))
                for r in range(pp):
                    sends = sum(1 for a in lowered.actions[r] if a.kind.startswith("SEND"))
                    assert pp_sends_of_rank(schedule, pp, v, m, r) == sends, (pp, m, v, r)
                    checked += 1
    assert checked >= 20
