"""ZeRO-2/3 with pipeline parallel, DualPipe's two model copies under ZeRO, and ZeRO-3's
gather setting (`parallel.zero3_gather`): parity with the single-process run, both copies
kept equal and saved once, and the parameter all-gathers the ledger counts per step.

Each layout trains once (`_run`, cached per process); the tests read that one run."""

from __future__ import annotations

from functools import cache

import pytest
from helpers import batches_for, config, initial_params, reference, token_file

from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.parallel.pipeline.partition import partition_for
from plait.testing import assert_parity, merge_ranks
from plait.train.loop import TrainOptions, full_state, train

MODEL = ("model.n_layers=4", "model.tie_embeddings=false")
PIPE = (*MODEL, "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=4")
# every run clips (BASE's grad_clip 0.5 is below each step's norm). Post-validation: at a
# clip of 1 each stage's share of the squared norm passes alone, so the optimistic update
# is made and its check fails: rolled back, redone clipped, the step run again
ROLLBACK = ("parallel.optimizer_sync=post_validation", "train.grad_clip=1.0")
CASES = {
    "z2 1f1b post-validation": (*PIPE, "parallel.zero=2", "parallel.schedule=1f1b",
                                *ROLLBACK),
    "z3 1f1b recompute": (*PIPE, "parallel.zero=3", "parallel.schedule=1f1b",
                          "train.recompute=full"),
    # I/W split: rank 1 splits every backward, rank 0 runs its W whole
    "z3 zb-h1": (*PIPE, "parallel.zero=3", "parallel.schedule=zb-h1"),
    "z3 interleaved bf16 selective": (*PIPE, "parallel.zero=3",
                                      "parallel.schedule=interleaved",
                                      "train.precision=bf16", "train.recompute=selective"),
    # units kept gathered through the step, the update rolled back inside the next one
    "z3 zb-h2 step post-validation": (*PIPE, "parallel.zero=3", "parallel.schedule=zb-h2",
                                      "parallel.zero3_gather=step", *ROLLBACK),
    "z2 dualpipe": (*PIPE, "parallel.zero=2", "parallel.schedule=dualpipe"),
    "z3 dualpipe step recompute": (*PIPE, "parallel.zero=3", "parallel.schedule=dualpipe",
                                   "parallel.zero3_gather=step", "train.recompute=full"),
    "z3 step no pp": (*MODEL, "parallel.dp=2", "parallel.zero=3", "parallel.microbatches=2",
                      "parallel.zero3_gather=step"),
    "z3 no pp": (*MODEL, "parallel.dp=2", "parallel.zero=3", "parallel.microbatches=2"),
}


def _rank(rank: int, world: int, sets: list[str]) -> dict:
    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    result = train(cfg, mesh, batches_for(cfg), TrainOptions(capture_first_grads=True))
    held = [(h.name, h.start, h.stop, h.second_copy, h.tensor.clone())
            for h in result.optimizer.held_states() if h.state == "master"]
    return {"losses": result.losses, "grad_norms": [m["grad_norm"] for m in result.metrics],
            "first_grads": result.first_grads, "metrics": result.metrics,
            "params": full_state(result.model, result.optimizer, mesh, result.placements),
            "gathers": [r["step"] for r in mesh.ledger.to_dicts()
                        if r["op"] == "all_gather" and r["tag"].startswith("params")],
            "held": held, "dp": mesh.coord("dp"), "pp": mesh.coord("pp")}


@cache
def _run(case: str) -> list[dict]:
    sets = CASES[case]
    token_file()  # made once in the parent, before the ranks fork
    return run_ranks(_rank, config(*sets).parallel.world_size, list(sets))


@pytest.mark.parametrize("case", [c for c in CASES if c != "z3 no pp"])
def test_parity_with_the_single_process_run(case):
    """Every rank's loss and grad norm (the owned copy counted once), every first-step
    gradient and final parameter."""
    outs, sets = _run(case), CASES[case]
    bf16 = "train.precision=bf16" in sets
    train_sets = [s for s in sets if s.startswith("train.grad_clip")]
    assert_parity(merge_ranks(outs), reference(*MODEL, *train_sets), "bf16" if bf16 else "fp64",
                  init=initial_params(*MODEL) if bf16 else None)
    if "post-validation" in case:  # a restored update, redone, the step run again
        assert any(m.get("rolled_back") for m in outs[0]["metrics"]), outs[0]["metrics"]


@pytest.mark.parametrize("case", ["z2 dualpipe", "z3 dualpipe step recompute"])
def test_dualpipe_copies_stay_equal_and_are_saved_once(case):
    """Each rank holds a chain-1 copy of its mirror's stage: every master shard element
    is held twice in a dp coordinate's pipeline, once as the second copy (never written
    by a checkpoint), and both copies are equal after training (stepped with the sum of
    their gradients)."""
    held: dict[tuple, dict[bool, object]] = {}
    for out in _run(case):
        for name, start, stop, second, tensor in out["held"]:
            key = (out["dp"], name, start, stop)
            assert second not in held.get(key, {}), key
            held.setdefault(key, {})[second] = tensor
    assert held and all(set(copies) == {False, True} for copies in held.values())
    for key, copies in held.items():
        assert copies[False].equal(copies[True]), key


def _units(sets: tuple[str, ...]) -> list[tuple[int, int]]:
    """(ZeRO-3 units, of them the embedding) of each model stage: a unit per module, the
    embedding on the first stage, the final norm and the head on the last."""
    cfg = config(*sets)
    p = cfg.parallel
    stages = 2 * p.pp if p.schedule == "interleaved" else p.pp
    part = partition_for(cfg.model, cfg.train.seq_len, stages)
    last = part.num_stages - 1
    return [(b - a + (j == 0) + 2 * (j == last), int(j == 0))
            for j, (a, b) in enumerate(part.layers)]


def _gathers_per_step(outs: list[dict]) -> dict[int, set[int]]:
    """pp rank -> the parameter all-gathers its ranks issued in each step after the first."""
    by_pp: dict[int, set[int]] = {}
    for out in outs:
        steps = out["gathers"]
        by_pp.setdefault(out["pp"], set()).update(
            steps.count(s) for s in range(1, max(steps) + 1))
    return by_pp


def test_parameter_all_gathers_per_step():
    """ZeRO-3's all-gathers per step, from the ledger (tag "params:unit"), m micro-batches
    through each stage of U units (E of them the embedding):

    - zero3_gather=step: each unit once, U, whatever the schedule (DualPipe: both copies'
      units) - gathered at its first forward, kept to its stage's last backward;
    - microbatch, no pp: 2 m U, before each forward and each backward;
    - microbatch, pp: m U (forwards) + m (U - E) (backwards, which gather only units whose
      input takes a gradient: not the embedding), and m (U - E) more where a backward is
      split into I and W (W gathers too: some weight gradients view their weight).
    """
    (u0, e0), (u1, _) = _units(CASES["z3 1f1b recompute"])
    assert (u0, e0, u1) == (3, 1, 4)  # embedding + 2 blocks | 2 blocks + norm + head
    m, whole = 4, u0 + u1
    assert _gathers_per_step(_run("z3 step no pp")) == {0: {whole}}
    assert _gathers_per_step(_run("z3 no pp")) == {0: {2 * 2 * whole}}  # m = 2
    assert _gathers_per_step(_run("z3 dualpipe step recompute")) == {0: {whole}, 1: {whole}}
    # 1F1B (recomputation inside B keeps the unit gathered): forward + backward
    assert _gathers_per_step(_run("z3 1f1b recompute")) == {
        0: {m * u0 + m * (u0 - e0)}, 1: {2 * m * u1}}
    # zb-h1: rank 0's W follows its I at once and runs the backward whole; rank 1 splits
    assert _gathers_per_step(_run("z3 zb-h1")) == {
        0: {m * u0 + m * (u0 - e0)}, 1: {m * u1 + 2 * m * u1}}
