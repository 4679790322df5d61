"""Measured overlap: every ledger record holds how long the issuing rank was blocked by
its collective (exposed) beside issue-to-completion; the rest was hidden behind other work.
And the timeline of a step (plait/train/timeline.py), every rank's compute spans beside
those records, as `plait train --trace / --timeline` write it for any layout.

Structural facts, not timings: a synchronous call is exposed from issue to completion, so
its hidden time is exactly zero; an async one issued and waited for later was in flight
while the rank worked, so its hidden time is positive (at least the time until its wait).
Three 1-step runs serve every test here (cached): dp=2 x tp=2 with bucketed DP, naive
dp=2, and dp=2 ZeRO-3 with the timeline on."""

import json
from collections import Counter
from functools import cache

import pytest
import torch
from helpers import batches_for, config, token_file

from plait.comm import ops
from plait.config import ParallelConfig
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.observe.report import compare
from plait.observe.timeline import draw_step_timeline, write_chrome_trace
from plait.parallel.zero_units import zero_units
from plait.train.loop import TrainOptions, train

BUCKETED_TP = ("parallel.dp=2", "parallel.tp=2", "parallel.data_parallel=bucketed",
               "parallel.bucket_mb=0.02", "train.steps=1")  # several buckets per tp shard
NAIVE = ("parallel.dp=2", "parallel.data_parallel=naive", "train.steps=1")
ZERO3 = ("parallel.dp=2", "parallel.zero=3", "train.steps=1")


def _sync_and_async(rank, world):
    import time

    mesh = ParallelMesh.build(ParallelConfig(dp=world))
    ops.all_reduce(torch.ones(1000), mesh, "dp", tag="sync")
    handle = ops.all_reduce(torch.ones(1000), mesh, "dp", async_op=True, tag="async")
    time.sleep(0.05)  # the rank's "other work" while the collective is in flight
    handle.wait()
    return {r.tag: (r.seconds, r.blocked, r.hidden) for r in mesh.ledger.records}


def test_sync_call_is_all_exposed_async_call_hides_until_its_wait():
    for rec in run_ranks(_sync_and_async, 2):
        seconds, blocked, hidden = rec["sync"]
        assert blocked == seconds and hidden == 0.0
        seconds, blocked, hidden = rec["async"]
        assert hidden >= 0.05 and blocked < seconds
        assert hidden + blocked == pytest.approx(seconds)


def _train_rank(rank, world, sets, timeline):
    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    result = train(cfg, mesh, batches_for(cfg), TrainOptions(timeline=timeline))
    return {"rank": rank, "summary": result.summary, "metrics": result.metrics,
            "ledger": mesh.ledger.to_dicts(), "timeline": result.timeline,
            # ZeRO's units in order: tag params:i gathers the i-th
            "units": [prefix.rstrip(".") for prefix, _ in zero_units(result.model)]}


@cache
def _run(sets: tuple[str, ...], timeline: bool = False) -> list[dict]:
    token_file()  # made once in the parent, before the ranks fork
    return run_ranks(_train_rank, config(*sets).parallel.world_size, sets, timeline)


def _step(ledger, step):
    return [r for r in ledger if r["step"] == step]


def test_naive_dp_exposes_all_gradient_communication():
    for rank in _run(NAIVE):
        grads = [r for r in rank["ledger"] if r["tag"] == "grads" and r["step"] >= 0]
        assert grads and all(r["blocked"] == r["end"] - r["start"] for r in grads)
        overlap = rank["summary"]["ledger"]["overlap_per_step"]["dp"]
        assert overlap["hidden"] == 0.0 and overlap["exposed"] == overlap["seconds"] > 0


def test_report_puts_naive_dp_beside_the_planner_and_says_why():
    """plait report's overlap: the measured exposed share of naive DP's dp traffic is 1;
    the planner overlaps the all-reduce with backward, and the note says so."""
    rank = _run(NAIVE)[0]
    rep = compare(rank["metrics"], rank["summary"], config(*NAIVE))
    dp = next(d for d in rep["communication"] if d["dim"] == "dp")
    assert dp["measured_exposed_share"] == 1.0
    assert dp["measured_exposed_s"] == rank["summary"]["ledger"]["overlap_per_step"]["dp"][
        "exposed"] and dp["measured_hidden_s"] == 0.0
    assert dp["predicted_exposed_share"] < 1.0  # the gap the note explains
    assert any("naive data parallel" in n for n in rep["notes"])


def test_the_naive_dp_note_names_the_replica_group_under_context_parallel():
    """Under context parallel the gradients' all-reduce is the dp x cp group's ("dp_cp" on
    both sides of the report): its overlap gap gets the naive data-parallel note too."""
    from plait.observe.report import _explain_exposure

    out = {"notes": [], "communication": [
        {"dim": "cp", "measured_exposed_share": 0.3, "predicted_exposed_share": 0.2},
        {"dim": "dp_cp", "measured_exposed_share": 1.0, "predicted_exposed_share": 0.1}]}
    _explain_exposure(out, config("parallel.dp=2", "parallel.cp=2",
                                  "parallel.data_parallel=naive"))
    (note,) = out["notes"]
    assert "on dp_cp" in note and "naive data parallel" in note


def test_bucketed_dp_hides_buckets_behind_backward():
    for rank in _run(BUCKETED_TP):
        buckets = [r for r in _step(rank["ledger"], 0) if r["tag"] == "grads"]
        assert len(buckets) >= 3
        hidden = [r["end"] - r["start"] - r["blocked"] for r in buckets]
        # every bucket but the last is issued while backward still runs, waited at the end
        assert sum(h > 0 for h in hidden) >= len(buckets) - 1
        overlap = rank["summary"]["ledger"]["overlap_per_step"]["dp"]
        assert overlap["hidden"] > 0 and overlap["exposed"] > 0
        per_kind = rank["summary"]["ledger"]["per_step"]["all_reduce@dp"]
        assert per_kind["hidden"] > 0 and per_kind["exposed"] + per_kind["hidden"] == \
            pytest.approx(per_kind["seconds"])


def test_tensor_parallel_collectives_are_fully_exposed():
    """Beside bucketed DP's overlap in the same run: TP's collectives block the rank."""
    for rank in _run(BUCKETED_TP):
        recs = [r for r in rank["ledger"] if r["dim"] == "tp" and r["step"] >= 0]
        assert recs and all(r["blocked"] == r["end"] - r["start"] for r in recs)
        overlap = rank["summary"]["ledger"]["overlap_per_step"]["tp"]
        assert overlap["hidden"] == 0.0
        assert overlap["exposed"] == pytest.approx(overlap["seconds"])


def test_zero3_next_unit_gather_overlaps_current_unit_forward():
    """Through the measured timeline: each unit's forward lies inside the flight of the
    next unit's all-gather (issued before the forward began, completed after it ended),
    so that gather was hidden for at least the forward's length."""
    for rank in _run(ZERO3, True):
        rec = rank["timeline"]["ranks"][rank["rank"]]
        names = rank["units"]
        forwards = [(names.index(n), a, b) for k, n, _, a, b in rec["units"] if k == "F"]
        assert sorted({i for i, _, _ in forwards}) == list(range(len(names)))
        gathers = [c for c in rec["comm"] if c["op"] == "all_gather"
                   and c["tag"].startswith("params:")]
        for i, a, b in forwards:
            if i + 1 == len(names):
                continue
            over = [c for c in gathers if c["tag"] == f"params:{i + 1}"
                    and c["start"] <= a and c["end"] >= b]
            assert over, f"no gather of unit {i + 1} in flight over unit {i}'s forward"
            assert all(c["end"] - c["start"] - c["blocked"] >= b - a for c in over)
        overlap = rank["summary"]["ledger"]["overlap_per_step"]["dp"]
        assert overlap["hidden"] > 0


def test_timeline_of_a_non_pipeline_layout(tmp_path):
    """ZeRO-3's timeline: every rank has compute spans (its actions, each unit's forward
    and backward, the optimizer) and a communication span per ledger record of the step,
    with its dim and bytes; the Chrome trace carries the same, the blocked part of each
    collective a child slice inside it; the PNG draws."""
    ranks = _run(ZERO3, True)
    timeline = ranks[0]["timeline"]
    assert all(r["timeline"] == timeline for r in ranks)  # gathered: one, on every rank
    step = timeline["step"]
    assert step == 0 and [r["rank"] for r in timeline["ranks"]] == [0, 1]

    def key(c):
        return (c["op"], c["dim"], c["tag"], c["payload"], c["sent"])

    for rank, rec in zip(ranks, timeline["ranks"], strict=True):
        assert {a[0] for a in rec["actions"]} == {"F", "B"}
        assert {u[0] for u in rec["units"]} == {"F", "B"}
        assert {"gradient sync", "grad norm", "optimizer", "metrics"} <= {
            p[0] for p in rec["phases"]}
        ledger = _step(rank["ledger"], step)
        assert [key(c) for c in rec["comm"]] == [key(r) for r in ledger]
        for c, r in zip(rec["comm"], ledger, strict=True):
            assert c["blocked"] == r["blocked"]
            assert c["end"] - c["start"] == pytest.approx(r["end"] - r["start"], abs=1e-6)
    trace = json.loads(write_chrome_trace(timeline, tmp_path / "t.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in ranks:
        mine = [e for e in slices if e["pid"] == rank["rank"]]
        assert {"forward", "backward", "phase", "action.F", "action.B"} <= {e["cat"] for e in mine}
        comms = [e for e in mine if e["cat"] == "comm"]
        ledger = _step(rank["ledger"], step)
        assert Counter((e["args"]["op"], e["args"]["dim"], e["args"]["payload_bytes"])
                       for e in comms) == Counter((r["op"], r["dim"], r["payload"])
                                                  for r in ledger)
        for w in (e for e in mine if e["cat"] == "comm.blocked"):
            assert any(c["tid"] == w["tid"] and c["ts"] <= w["ts"] + 1e-3
                       and w["ts"] + w["dur"] <= c["ts"] + c["dur"] + 1e-3 for c in comms)
    png = draw_step_timeline(timeline, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_compares_pipeline_bytes_like_for_like():
    """plait report's pp row: the planner counts each activation/gradient transfer once, at
    its sender; the ledger records it on both ends. A rank whose sends move exactly the
    planned bytes (receiving as many) reads 1.0, not 0.5; its receives stay listed."""
    cfg = config("parallel.pp=2", "parallel.microbatches=4")
    sent = next(d for d in compare([], {}, cfg)["communication"] if d["dim"] == "pp")
    planned = sent["predicted_bytes"]
    ledger = {"per_step": {"send@pp": {"count": 4, "payload": planned},
                           "recv@pp": {"count": 4, "payload": planned}}}
    pp = next(d for d in compare([], {"ledger": ledger}, cfg)["communication"]
              if d["dim"] == "pp")
    assert planned > 0 and pp["measured_bytes"] == planned and pp["ratio"] == 1.0
    assert {x["op"] for x in pp["measured"]} == {"send", "recv"}
