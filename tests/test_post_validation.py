"""Post-validation: the optimizer step without a barrier equals the barrier's.

`parallel.optimizer_sync=post_validation` updates each stage optimistically and checks the
global grad norm later (plait/parallel/post_validation.py). Each layout is trained with
the barrier and with post-validation in the same ranks, and the second held to the first
at the parity tolerances of plait/testing.py (losses and grad norms every step, every
final parameter; the barrier runs meet the single-process oracle in
tests/test_pipeline_runtime.py). Both make the same updates; only the order of the norm's
and loss's float64 sums differs (an all-reduce over the world vs a sum over pp in rank
order), so the tolerance is ample: at pp=2 the runs measured bit for bit equal.

The clip is set just under step 0's global norm (from the single-process reference), so
every stage's own share passes the check and the global one fails: step 0 is updated,
rolled back and redone with the clip coefficient, and step 1's forward prefix is run again
(`restarts`); step 1 passes (its norm is lower). An inf injected into one stage's gradient
exercises the non-finite rollback: the other stage has already updated, undoes it, and the
step is skipped on every rank, as the barrier skips it. Several runs share one fork of the
ranks (the suite's time budget): 2 steps, pp=2, the tiny model.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from helpers import assert_memory_matches, batches_for, config, data_windows, reference, token_file

from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model.transformer import build_model
from plait.parallel.pipeline.measure import pipeline_report
from plait.parallel.pipeline.partition import build_pipeline
from plait.parallel.pipeline.runtime import PipelineRuntime
from plait.plan.runtime_memory import eager_memory_by_rank
from plait.schedule.check import check
from plait.schedule.lower import lower, speculative_prefix
from plait.schedule.registry import SCHEDULE_NAMES, build_schedule, natural_virtual_stages
from plait.testing import assert_parity, merge_ranks
from plait.train import loop
from plait.train.reference import Reference
from plait.train.stop import StopRequest

LAYERS, STEPS = "model.n_layers=4", "train.steps=2"
POST = "parallel.optimizer_sync=post_validation"
SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev", "dualpipe")
MSG_BYTES = 16  # per peer and step: the stage's squared norm and loss, float64


def _clip_under_first_norm() -> str:
    # 0.999 of step 0's global norm: above either stage's share unless one held > 99.8 %
    # of the squared norm; the rollback assertions below would say so. The reference is
    # test_pipeline_runtime's pp=2 one (cached: one run for both)
    return f"train.grad_clip={0.999 * reference(LAYERS, STEPS).grad_norms[0]!r}"


def _train(sets: list[str], world: int, inf_step: int | None = None,
           eager: bool = False) -> dict:
    """`eager`: a stop request armed (no signal comes), so each step is checked before
    the next starts, as with checkpoints being saved."""
    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    real = loop.parallelize

    def poisoned(model, mesh_, cfg_, **kwargs):
        par = real(model, mesh_, cfg_, **kwargs)
        if mesh.coord("pp") == 1:  # one stage's gradient of one tensor, at inf_step
            p = next(iter(par.model.parameters()))
            p.register_hook(lambda g: g * float("inf") if mesh.ledger.step == inf_step else g)
        return par

    loop.parallelize = poisoned
    try:
        result = loop.train(cfg, mesh, batches_for(cfg),
                            loop.TrainOptions(stop=StopRequest() if eager else None))
    finally:
        loop.parallelize = real
    return {"losses": result.losses, "grad_norms": [m["grad_norm"] for m in result.metrics],
            "params": loop.full_state(result.model, result.optimizer, mesh, result.placements),
            "rows": result.metrics, "summary": result.summary,
            "ledger": [r for r in mesh.ledger.to_dicts() if r["step"] >= 0]}


def _runs(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Each case, (sets, inf step[, eager]), trained on these ranks (one fork for all:
    the suite's time budget)."""
    return [_train(*case[:1], world, *case[1:]) for case in cases]


def _assert_same(ranks: list[dict], ref: Reference, where: str, precision: str = "fp64",
                 peers: int = 1) -> None:
    """One run's ranks (merged: a pipeline rank holds its stages) against `ref`; `peers`:
    the other pp ranks each sends its stage's partial to."""
    for post in ranks:  # the logged loss and norm are the global ones on every rank
        assert post["losses"] == ranks[0]["losses"], where
        assert post["grad_norms"] == pytest.approx(ranks[0]["grad_norms"], rel=1e-12,
                                                   nan_ok=True), where
    post = merge_ranks(ranks)
    # a skipped step's norm is not finite in both (parity compares finite numbers)
    finite = [math.isfinite(n) for n in ref.grad_norms]
    assert finite == [math.isfinite(n) for n in post["grad_norms"]], where
    ref = Reference(losses=ref.losses, params=ref.params, lr=ref.lr,
                    grad_norms=[n if f else 1.0 for n, f in zip(ref.grad_norms, finite)])
    norms = [n if f else 1.0 for n, f in zip(post["grad_norms"], finite, strict=True)]
    try:
        assert_parity({**post, "grad_norms": norms}, ref, precision)
    except AssertionError as e:
        raise AssertionError(f"{where}: {e}") from None
    for run in ranks:  # the ledger: the check's bytes (to each peer, 2 steps), no world
        sent = [r for r in run["ledger"] if r["tag"] == "post_validation" and r["op"] == "send"]
        assert sum(r["sent"] for r in sent) == 2 * peers * MSG_BYTES, where
        # but the exchange of step figures (plait/train/stragglers.py): async, completed a
        # step later, it holds no rank at a step's end
        assert not [r for r in run["ledger"] if r["dim"] == "world"
                    and (r["op"], r["tag"]) != ("all_gather", "metrics")], where


def _assert_memory_as_planned(ranks: list[dict], sets: list[str]) -> None:
    """Each rank's measured peak of step 1 (the previous update's copy of the optimizer
    states alive, with its gradients, through the forward prefix up to the check) against
    the planner's eager model, at test_predict_vs_measured's tolerance; the optimizer
    states, copy included (12 bytes a parameter), to the byte."""
    cfg = config(*sets)
    planned = eager_memory_by_rank(cfg, data_windows(cfg))
    for rank, run in enumerate(ranks):
        mem, pred = run["rows"][1]["memory"], planned[rank]
        assert not run["rows"][1].get("rolled_back")
        assert pred["moment"] in ("post-validation check (end of the prefix)",
                                  "loss forward (stage 1, mb 0)"), pred
        assert_memory_matches(mem["peak"], mem["peak_total"], pred, f"rank {rank}")
        assert mem["peak"]["optimizer"] == pred["optimizer states"], (mem, pred)


def _as_reference(ranks: list[dict]) -> Reference:
    run = merge_ranks(ranks)
    return Reference(losses=run["losses"], params=run["params"], grad_norms=run["grad_norms"],
                     lr=config().train.lr)


def _before_fork() -> None:
    """The token file, and building a model on meta once (it imports torch's compiler
    stack, ~20 s on a loaded machine) before the ranks fork, as the rest of the suite has."""
    token_file()
    build_model(config().model, seed=0, device="meta")


def test_post_validation_rolls_back_exactly_on_every_zero_bubble_schedule():
    """pp=2, every zero-bubble schedule and 1f1b, each against its barrier run, the clip
    inside step 0's window; zb-h2 with an inf in stage 1's gradient at step 1 too."""
    _before_fork()
    base = [LAYERS, STEPS, "parallel.pp=2", "parallel.microbatches=4", _clip_under_first_norm()]
    cases = []
    for s in SCHEDULES:
        sets, inf = [*base, f"parallel.schedule={s}"], 1 if s == "zb-h2" else None
        cases += [(sets, inf), ([*sets, POST], inf)]
    zbv = 2 * SCHEDULES.index("zb-v")
    # no clipping (every check passes), memory measured in step 1: the planner's bytes
    measured = [*base, "parallel.schedule=1f1b", POST, "train.grad_clip=0",
                "train.memory_step=1", "train.precision=fp32"]  # the eager model's
    cases.append((measured, None))
    cases.append(([*cases[zbv][0], POST], None, True))  # checked at once, no overlap
    outs = run_ranks(_runs, 2, cases, timeout=600)
    _assert_memory_as_planned([runs[-2] for runs in outs], measured)
    eager = [runs[-1] for runs in outs]
    _assert_same(eager, _as_reference([runs[zbv] for runs in outs]), "zb-v eager")
    for run in eager:
        assert [bool(r.get("rolled_back")) for r in run["rows"]] == [True, False]
        assert run["summary"]["post_validation"]["restarts"] == 0  # nothing ran ahead
    for i, s in enumerate(SCHEDULES):
        barrier, post = ([runs[2 * i + k] for runs in outs] for k in (0, 1))
        _assert_same(post, _as_reference(barrier), s)
        for rank, (b, run) in enumerate(zip(barrier, post, strict=True)):
            rolled = [bool(r.get("rolled_back")) for r in run["rows"]]
            skipped = [bool(r.get("skipped")) for r in run["rows"]]
            assert skipped == [bool(r.get("skipped")) for r in b["rows"]], s
            # step 0 updated, undone and redone; step 1's prefix run again
            assert rolled[0] and run["summary"]["post_validation"]["restarts"] == 1, s
            if s != "zb-h2":  # step 1 passes
                assert rolled == [True, False] and skipped == [False, False], (s, rolled)
            else:  # stage 0 updated before it learned of stage 1's inf; stage 1 never did
                assert skipped == [False, True] and rolled[1] == (rank == 0), (rank, rolled)


def test_post_validation_with_zero1_tp_cp_bf16_and_pp4():
    """On 4 ranks, each against its barrier run: pp=2 x dp=2 with ZeRO-1, pp=2 x tp=2,
    pp=2 x cp=2 in bf16 (the check's loss summed over cp and dp, its norm over dp x cp
    once per element), and pp=4 (a cut on every rank of a longer pipeline). Step 0
    rolled back in each (bf16's norm is 1.2e-5 under fp32's there, inside the clip's
    0.1 % window)."""
    _before_fork()
    clip = _clip_under_first_norm()
    base = [LAYERS, STEPS, "parallel.pp=2", "parallel.microbatches=4", clip]
    layouts = {
        "zero1": ([*base, "parallel.dp=2", "parallel.zero=1", "parallel.schedule=zb-v"],
                  "fp64"),
        "tp": ([*base, "parallel.tp=2", "parallel.schedule=zb-h2"], "fp64"),
        "cp bf16": ([*base, "parallel.cp=2", "train.precision=bf16",
                     "parallel.schedule=zb-h1"], "fp64"),
        "pp4": ([LAYERS, STEPS, "parallel.pp=4", "parallel.microbatches=4", clip,
                 "parallel.schedule=zb-h2"], "fp64"),
    }
    cases = [c for sets, _ in layouts.values() for c in ((sets, None), ([*sets, POST], None))]
    outs = run_ranks(_runs, 4, cases, timeout=600)
    for i, (where, (_, precision)) in enumerate(layouts.items()):
        barrier, run = ([runs[2 * i + k] for runs in outs] for k in (0, 1))
        _assert_same(run, _as_reference(barrier), where, precision,
                     peers=3 if where == "pp4" else 1)
        assert all(r["rows"][0].get("rolled_back") for r in run), where


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_speculative_prefix_is_forwards_only_and_closed(name):
    """The prefix a rank runs before the check: no gradient-writing action, and on every
    channel as many sends in the sender's prefix as receives in the receiver's."""
    for pp, m in ((2, 4), (4, 8)):
        sched = lower(build_schedule(name, pp, m, natural_virtual_stages(name, None)))
        assert not check(sched)
        cut = speculative_prefix(sched)
        for r in range(pp):
            prefix = sched.actions[r][:cut[r]]
            assert all(a.kind not in ("B", "I", "W") for a in prefix), (name, pp, r)
            assert any(a.kind == "F" for a in prefix) or r == pp - 1, (name, pp, r, cut)
        for a in range(pp):
            for b in range(pp):
                sends = sum(1 for x in sched.actions[a][:cut[a]]
                            if x.kind.startswith("SEND") and x.peer == b)
                recvs = sum(1 for x in sched.actions[b][:cut[b]]
                            if x.kind.startswith("RECV") and x.peer == a)
                assert sends == recvs, (name, pp, a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_post_validation_restores_optimizer_state_exactly(dtype):
    """snapshot / update / restore: masters, moments, the count and (bf16: from the fp32
    master) the parameter back bit for bit."""
    from plait.optim import MixedPrecisionAdamW

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3).to(dtype))
    opt = MixedPrecisionAdamW([("w", w)], (0.9, 0.95), 1e-8, 0.1)
    w.grad = torch.randn(4, 3).to(dtype)
    opt.step(1e-2)
    before = [t.detach().clone() for t in (w, opt.master[0], opt.exp_avg[0],
                                           opt.exp_avg_sq[0])]
    opt.snapshot()
    w.grad = torch.randn(4, 3).to(dtype)
    opt.step(1e-2)
    assert opt.steps == 2 and not torch.equal(w, before[0])
    opt.restore()
    assert opt.steps == 1 and opt.snapshot_tensors() == []
    now = (w.detach(), opt.master[0], opt.exp_avg[0], opt.exp_avg_sq[0])
    for a, b in zip(now, before, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_time_between_steps_as_measured():
    """measure.between_steps: from a rank's runtime step's end to its next step's start,
    over the steps after the first; with the barrier the rank that ended last (the others
    wait for it: the simulator lays that wait out), with post-validation every rank's."""
    from plait.parallel.pipeline.measure import between_steps, runtime_gap, step_periods
    from plait.parallel.pipeline.runtime_stats import between_per_rank

    def rank(t0, t1):  # one compute filling the step's window
        return (t0, t1, [("F", 0, 0, t0, t1)], [(t0, 0.0)], [], [])

    steps = [[rank(0, 9), rank(1, 10)], [rank(10, 19), rank(11, 20)],
             [rank(21, 31), rank(23, 32)]]
    assert between_steps(steps, "barrier") == 3.0  # rank 1: 20 -> 23
    assert between_steps(steps, "post_validation") == 2.5  # (2 + 3) / 2
    assert step_periods(steps) == [10.0, 12.0]
    assert between_steps(steps[:2], "barrier") == 0.0  # no step after the first's next
    # each rank's: from the last rank's last compute with the barrier, its own without
    assert between_per_rank(steps, "barrier") == (1.0, 3.0)  # 20 -> 21, 20 -> 23
    assert between_per_rank(steps, "post_validation") == (2.0, 3.0)
    # from the last compute's end, not the runtime step's (its sends' waits are in it)
    late = [rank(0, 9), (1, 12, [("F", 0, 0, 1, 10)], [(1, 0.0)], [], [])]
    assert between_steps([steps[0], late, steps[2]], "barrier") == 13.0  # 10 -> 23

    # measure.runtime_gap: a rank's own time before each compute that did not wait, less
    # the posts in between: 1 (step start -> F0) and 1.5 - 0.5 (F0 -> F1, a post) here;
    # F2 waited 3.5 for its input (over runtime_stats._WAITED) and is left out
    computes = [("F", 0, 0, 1.0, 4.0), ("F", 0, 1, 5.5, 8.0), ("F", 0, 2, 12.0, 13.0)]
    one = (0.0, 14.0, computes, [(1.0, 0.0), (5.5, 0.0), (8.5, 0.0)], [(4.2, 4.7, 0.1)], [])
    assert runtime_gap([[one]]) == 1.0 and runtime_gap([]) == 0.0


def test_the_check_window_in_the_records():
    """records: the post-validation check's window at the cut is the simulator's
    `check` (`check_per_rank`), not runtime work: `runtime_gap` leaves it out as it does
    the posts, and `idle_breakdown` counts it apart (out of `between`, or `lead` when it
    came before the first compute)."""
    from plait.parallel.pipeline.runtime_stats import check_per_rank, idle_breakdown, runtime_gap

    computes = [("F", 0, 0, 1.0, 4.0), ("F", 0, 1, 5.5, 8.0), ("F", 0, 2, 12.0, 13.0)]
    detail = [(1.0, 0.0), (5.5, 0.0), (8.5, 0.0)]
    posts = [(4.2, 4.4, 0.1)]
    # F0 -> F1: 1.5, less the post 0.2 and the check 0.8 (4.5 -> 5.3): 0.5; with 1 before
    # F0, the gap is 0.75 (it was 1.15 with the check counted as runtime work)
    checked = (0.0, 14.0, computes, detail, posts, [(4.5, 5.3)])
    unchecked = (0.0, 14.0, computes, detail, posts, [])
    assert runtime_gap([[checked]]) == pytest.approx(0.75)
    assert runtime_gap([[unchecked]]) == pytest.approx(1.15)
    # a check before the first compute (a cut at 0) comes out of the lead
    early = (0.0, 14.0, computes, detail, posts, [(0.2, 0.7)])
    assert runtime_gap([[early]]) == pytest.approx((0.5 + 1.3) / 2)
    idle = idle_breakdown([checked])
    assert idle["check"] == pytest.approx(0.8 / 13) and idle["between"] == pytest.approx(
        idle_breakdown([unchecked])["between"] - 0.8 / 13)
    assert sum(idle.values()) == pytest.approx(sum(idle_breakdown([unchecked]).values()))
    lead = idle_breakdown([early])
    assert lead["check"] == pytest.approx(0.5 / 13) and lead["lead"] == pytest.approx(0.5 / 13)
    # per rank, the mean over the steps that had one; 0 for a rank that never checked
    assert check_per_rank([[checked, unchecked], [early, unchecked]]) == pytest.approx(
        (0.65, 0.0))
    assert check_per_rank([]) == ()


def _check_windows(rank: int, world: int) -> dict:
    """zb-v at pp=2 run by the runtime alone for four steps: no check in the first, then
    a check that passes, one that fails (the step runs again), one that passes."""
    cfg = config(LAYERS, "parallel.pp=2", "parallel.schedule=zb-v",
                 "parallel.microbatches=4").check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    pipe = build_pipeline(cfg, mesh.coord("pp"), torch.float32)
    mbs, t = cfg.micro_batch_size(), cfg.train
    rt = PipelineRuntime(pipe.schedule, pipe.stages, mesh, (mbs, t.seq_len, cfg.model.dim),
                         torch.float32)
    tokens = batches_for(cfg).local_batch(0, 0, 1)
    micro = [tokens[i * mbs:(i + 1) * mbs] for i in range(cfg.microbatches())]
    called: list[float] = []

    def check(fails: bool):
        def at_cut() -> bool:
            called.append(time.perf_counter())  # inside the window the runtime records
            return fails
        return at_cut

    for verdict in (None, False, True, False):
        rt.step(micro, t.global_batch * t.seq_len, None if verdict is None else check(verdict))
    report = pipeline_report(rt, pipe.partition, mesh, "post_validation")["summary"]
    before = sum(not a.is_comm for a in rt.actions[:rt.cut])  # computes before the cut
    return {"checks": rt.steps_check, "events": rt.steps_events, "before": before,
            "restarts": rt.steps_restarts, "called": called, "report": report}


def test_the_runtime_records_the_check_window_at_the_cut():
    """`PipelineRuntime.steps_check`: each step's check, [(start, end)] around the
    validate call, between the computes before the rank's cut and those after it; a step
    whose check failed ran again after it; no window without a check. The pipeline
    report measures it per rank (`check_per_rank_ms`) and counts it as idle apart."""
    _before_fork()
    outs = run_ranks(_check_windows, 2)
    for rank, out in enumerate(outs):
        checks, events, n, called = out["checks"], out["events"], out["before"], out["called"]
        assert checks[0] == [] and [len(c) for c in checks[1:]] == [1, 1, 1]
        assert out["restarts"] == [0, 0, 1, 0]
        for step, at in zip((1, 2, 3), called, strict=True):
            (a, b), = checks[step]
            assert a <= at <= b
            if step == 2:  # failed: the step ran again from its first action
                assert events[step][0][3] >= b
            else:
                assert n > 0 and events[step][n - 1][4] <= a and b <= events[step][n][3]
        rep = out["report"]
        assert rep == outs[0]["report"]  # gathered: the same on every rank
        windows = [b - a for c in checks for a, b in c]
        assert rep["check_per_rank_ms"][rank] == pytest.approx(1e3 * sum(windows) / 3)
        assert rep["idle"]["check"] > 0
        assert abs(sum(rep["idle"].values()) - rep["measured_bubble"]) < 1e-9
