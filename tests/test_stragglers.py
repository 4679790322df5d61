"""Stragglers named (plait/train/stragglers.py): the rule on made-up figures, then two
forked 4-rank runs on dp=2 x pp=2 with two ranks a node: one whose rank 3 sleeps in every
step (the test-only fault `slow`, plait/launch/elastic.py), named within a few steps on
every rank, in the rows, the progress line, the summary, `plait report` and the hang
watchdog's report; and a healthy one that names nobody."""

from __future__ import annotations

import json
import random
import statistics
import time

import pytest
from helpers import batches_for, config

from plait.cli.__main__ import main as plait_main
from plait.launch.elastic import FAULT_ENV, slowed
from plait.launch.forked import run_ranks
from plait.launch.watchdog import hang_report
from plait.mesh import ParallelMesh
from plait.train.loop import train
from plait.train.progress import print_summary, progress_reporter
from plait.train.stragglers import StragglerRule, Stragglers, peer_medians

RULE = StragglerRule()
LAYOUT = ("parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2",
          "parallel.gpus_per_node=2", "train.steps=8")
SLOW_RANK, SLOW_S = 3, 0.15


def _judge_all(compute_by_step: list[list[float]], groups=None) -> list[dict | None]:
    world = len(compute_by_step[0])
    s = Stragglers(groups or [list(range(world))], [r // 2 for r in range(world)], RULE)
    return [s.judge(i, c, [0.0] * world) for i, c in enumerate(compute_by_step)]


def test_named_after_k_steps_in_a_row_and_cleared_by_one_step_that_is_not_slow():
    slow = [0.10, 0.10, 0.11, 0.30]
    fine = [0.10, 0.10, 0.11, 0.105]
    k = RULE.steps
    verdicts = _judge_all([slow] * (k + 1) + [fine] + [slow] * (k - 1))
    assert verdicts[:k - 1] == [None] * (k - 1) and verdicts[k + 1:] == [None] * k
    assert verdicts[k - 1] == {"rank": 3, "node": 1, "slower_by": pytest.approx(3.0),
                               "steps": k}
    assert verdicts[k]["steps"] == k + 1
    # slow every other step, the noise a shared CPU makes: nobody, ever
    assert _judge_all([slow, fine] * k) == [None] * 2 * k


def test_both_margins_and_the_peers_median_without_the_rank_itself():
    assert RULE.slow(0.015, 0.010) is None  # 50 % slower but 5 ms: a small step's jitter
    assert RULE.slow(2.025, 2.0) is None  # 25 ms slower but 1 % of a long step
    assert RULE.slow(0.13, 0.10) == pytest.approx(1.3)  # 30 ms and 1.3x: slow
    assert RULE.slow(1.0, None) is None  # no peer: nothing to compare with
    # each rank's reference is the median of the others: with one peer, that peer (a mean
    # with itself included would put 0.13 at 1.13x of 0.115)
    assert peer_medians([0.13, 0.10]) == [0.10, 0.13]
    assert peer_medians([0.10, 0.10, 0.10, 0.13]) == pytest.approx([0.10] * 4)
    # a second slow peer moves a mean, not the median
    assert peer_medians([0.10, 0.10, 0.40, 0.15]) == pytest.approx([0.15, 0.15, 0.10, 0.10])
    assert peer_medians([0.3]) == [None]
    rng = random.Random(0)  # one sort a step, as statistics.median of each rank's others
    for n in range(2, 10):
        values = [rng.random() for _ in range(n)]
        assert peer_medians(values) == pytest.approx(
            [statistics.median(values[:i] + values[i + 1:]) for i in range(n)])


def test_peers_are_the_ranks_of_one_pipeline_stage():
    """Stage 1 (ranks 1, 3) computes twice what stage 0 does: different work, nobody named;
    rank 3 above rank 1, its only peer, is."""
    groups = [[0, 2], [1, 3]]
    assert _judge_all([[0.1, 0.2, 0.1, 0.2]] * 4, groups) == [None] * 4
    k = RULE.steps
    assert [v and v["rank"] for v in _judge_all([[0.1, 0.2, 0.1, 0.3]] * k, groups)] == \
        [None] * (k - 1) + [3]
    mesh = ParallelMesh.arithmetic(config(*LAYOUT).parallel, 0)
    assert Stragglers.for_mesh(mesh).groups == [[0, 2], [1, 3]]
    assert Stragglers.for_mesh(mesh).node_of == [0, 0, 1, 1]


def _rank(rank: int, world: int, sets: list[str]) -> dict:
    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    result = train(cfg, mesh, slowed(batches_for(cfg), rank))  # the fault where it is set
    return {"metrics": result.metrics, "summary": result.summary,
            "exchange": [r for r in mesh.ledger.to_dicts() if r["dim"] == "world"
                         and r["op"] == "all_gather"]}


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory) -> list[dict]:
    import os

    os.environ[FAULT_ENV] = f"slow:{SLOW_RANK}:{SLOW_S}"  # the forked ranks inherit it
    try:
        return run_ranks(_rank, 4, list(LAYOUT))
    finally:
        del os.environ[FAULT_ENV]


def test_the_slow_rank_is_named_within_a_few_steps_on_every_rank(slow_run):
    rows = slow_run[0]["metrics"]
    # the verdict on step s travels with row s + 1 (the exchange runs one step behind)
    named = [(r["step"], r.get("straggler")) for r in rows]
    first = next(step for step, v in named if v)
    # at RULE.steps (the verdict on step RULE.steps - 1), one spare: a first step, which
    # warms caches, can be slow on every rank
    assert first <= RULE.steps + 1, named
    for step, v in named[first:]:
        assert v is not None and (v["rank"], v["node"], v["step"]) == (3, 1, step - 1), named
        # named only above the rule's margin (150 ms of sleep against the step's compute:
        # the ratio itself depends on the machine's load, not asserted)
        assert v["slower_by"] > RULE.relative
    for other in slow_run[1:]:  # every rank reached the same verdicts
        assert [r.get("straggler") for r in other["metrics"]] == [v for _, v in named]
    # rank 3 computes most and waits least; its peers wait for it
    summary = slow_run[0]["summary"]["stragglers"]
    compute, wait = summary["compute_s_per_rank"], summary["wait_s_per_rank"]
    assert compute.index(max(compute)) == 3 and compute[3] > SLOW_S
    assert wait.index(min(wait)) == 3 and min(wait[:3]) > SLOW_S / 2
    assert [(v["rank"], v["node"]) for v in summary["named"]] == [(3, 1)]
    assert summary["rule"]["steps"] == RULE.steps
    # this rank's own figures in its rows; the exchange: one all-gather a step, 2 float64s
    # a rank, a control collective
    assert all(r["compute_s"] + r["wait_s"] == pytest.approx(r["step_time"]) for r in rows)
    assert slow_run[3]["metrics"][-1]["compute_s"] > SLOW_S
    exchange = slow_run[0]["exchange"]
    assert [(r["step"], r["payload"], r["tag"]) for r in exchange] == \
        [(s, 4 * 2 * 8, "metrics") for s in range(len(rows))]


def test_progress_summary_report_and_watchdog_name_it(slow_run, tmp_path, capsys):
    rows, summary = slow_run[0]["metrics"], slow_run[0]["summary"]
    with progress_reporter(len(rows), enabled=True) as show:
        for row in rows:
            show(row)
    print_summary(summary, rows)
    out = capsys.readouterr().out
    first = next(r for r in rows if r.get("straggler"))["straggler"]
    assert (f"plait: straggler at step {first['step']}: rank 3 (node 1) "
            f"{first['slower_by']:.2f}x its peers' compute, {first['steps']} steps in a row"
            in out), out
    assert f"step {rows[-1]['step']:>5}  loss" in out and "  straggler rank 3 (node 1) " in out
    assert f"steps in a row (from step {first['step']})" in out

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, summary]))
    assert plait_main(["report", "--metrics", str(path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)["stragglers"]
    assert [(v["rank"], v["node"]) for v in rep["named"]] == [(3, 1)]
    assert [r["node"] for r in rep["ranks"]] == [0, 0, 1, 1]
    assert plait_main(["report", "--metrics", str(path)]) == 0
    assert "rank 3 (node 1) " in capsys.readouterr().out

    # the hang report: each rank's last step's figures, the verdict of the newest step
    entry = {"seq": 1, "dim_seq": 1, "op": "all_reduce", "dim": "dp", "payload": 64,
             "step": 7, "tag": "grads", "entered": 0.0, "done": False}
    states = {r: {"entries": [entry], "at": time.time(),
                  "step": {k: o["metrics"][-1][k] for k in ("step", "compute_s", "wait_s",
                                                            "straggler")}}
              for r, o in enumerate(slow_run)}
    lines = hang_report(states, 4, 0, 8)
    c3 = slow_run[3]["metrics"][-1]["compute_s"] * 1e3
    assert lines[4].endswith(f"; step 7: compute {c3:.1f} ms, wait "
                             f"{slow_run[3]['metrics'][-1]['wait_s'] * 1e3:.1f} ms"), lines
    assert lines[5].startswith("  stragglers at step 6: rank 3 (node 1) "), lines


def test_a_healthy_run_names_nobody():
    outs = run_ranks(_rank, 4, list(LAYOUT))  # no fault set: nobody sleeps
    for o in outs:
        assert not [r for r in o["metrics"] if "straggler" in r], o["metrics"]
        assert o["summary"]["stragglers"]["named"] == []
        assert len(o["summary"]["stragglers"]["compute_s_per_rank"]) == 4
    assert all(r["compute_s"] > 0 and r["wait_s"] >= 0 for r in outs[0]["metrics"])
