"""The planner's hybrid sharding (plait/dims/dp_replicate.py): a layout's shard groups,
ZeRO's collectives on the shard group's link and the shards' all-reduce on the copies'
link, states sharded over the shard group, the refusals, and the search's splits. The
ledger equals these bytes: tests/test_hybrid_sharding.py and tests/test_dry_run.py; the
eager memory model the measured peak: tests/test_predict_vs_measured.py."""

from __future__ import annotations

import importlib
import json
from dataclasses import replace

import numpy as np
import pytest
from test_plan_cli import plan

from plait.dims import REPLICA_AXES
from plait.plan.basis import Layout, Training, product
from plait.plan.calibration import EFFICIENCY
from plait.plan.estimate import evaluate
from plait.plan.hardware import Cluster, get_gpu
from plait.plan.search import layout_problems, node_replicas, numeric_candidates, search
from plait.plan.shape import from_preset

# llama3-8b on 32 nodes of 8 H100s with one NIC a node: ZeRO-3 over all 256 ranks crosses
# nodes at every layer; shard groups of one node's 8 keep those on NVLink (with a NIC a GPU,
# a DGX's, a node-spanning ring crosses on eight and hybrid sharding pays little:
# plait/plan/comm/price.py rails)
# the module: plait.plan's `search` is the function
SEARCH = importlib.import_module("plait.plan.search")
SHAPE, TRAIN = from_preset("llama3-8b"), Training(512)
CLUSTER = Cluster(replace(get_gpu("h100-sxm"), nics_per_node=1), 256)
ONE_NIC = ("--nics-per-node", "1")
BASE = ("--model", "llama3-8b", "--gpus", "256", "--global-batch", "512", "--zero", "3",
        "--recompute", "full", *ONE_NIC, "--json")


def test_sizes_and_label():
    lay = Layout(tp=2, dp=8, dp_replicate=2)
    assert lay.label() == "tp=2,pp=1,dp=8,dp_replicate=2"
    assert (lay.replicas, lay.shard_copies, lay.zero_split) == (8, 2, 4)
    assert Layout(dp=4, cp=2, dp_replicate=2).zero_split == 4  # the shard group spans cp
    assert Layout(dp=8).zero_split == 8


@pytest.mark.parametrize("sizes, zero, words", [
    ({"dp": 8, "dp_replicate": 2}, 0, "dp_replicate=2 with zero=0: nothing is sharded"),
    ({"dp": 8, "dp_replicate": 3}, 1, "dp_replicate=3 must divide dp=8; use one of 1, 2, 4, 8"),
    ({"dp": 8, "ep": 8, "dp_replicate": 2}, 1, "each shard group of 4 replica ranks, which "
     "the expert-parallel size 8 must divide"),
])
def test_refused_with_the_fix(sizes, zero, words):
    shape = from_preset("mixtral-8x7b", seq=4096) if "ep" in sizes else SHAPE
    cluster = Cluster(get_gpu("h100-sxm"), 8)
    problems = layout_problems(shape, cluster, Training(64), Layout(sizes, zero=zero))
    assert any(words in p for p in problems), problems


def _layout(replicate: int) -> dict:
    rc, out = plan(*BASE, "--layout", f"dp=256,dp_replicate={replicate}")
    assert rc == 0, out
    return json.loads(out)["layouts"][0]


def test_collectives_on_their_links_and_states_over_the_shard_group():
    hybrid, whole = _layout(32), _layout(1)
    assert hybrid["layout"]["dp_replicate"] == 32
    by_op = {(c["dim"], c["op"]): c for c in hybrid["collectives"]}
    assert {dim for dim, _ in by_op} == {"dp_shard", "dp_replicate"}
    gather = by_op["dp_shard", "all-gather (params, fwd+bwd)"]
    scatter = by_op["dp_shard", "reduce-scatter (grads)"]
    copies = by_op["dp_replicate", "all-reduce (grad shards)"]
    # ZeRO-3 inside a node's 8 ranks; the copies of a shard, one per node, across nodes
    assert (gather["group"], gather["link"]) == (8, "nvlink") == (scatter["group"],
                                                                  scatter["link"])
    assert (copies["group"], copies["link"]) == (32, "inter-node")
    # once a step: 1/8 of the gradients (the reduce-scatter's input, once per micro-batch)
    grads = scatter["bytes"] * scatter["count"] / hybrid["microbatches"]
    assert copies["bytes"] * copies["count"] == pytest.approx(grads / 8, rel=1e-12)
    assert copies["exposed_s"] == pytest.approx(copies["total_s"])  # after the backward
    # unsplit, ZeRO's collectives run over all 256 ranks, across nodes
    (ws,) = [c for c in whole["collectives"] if c["op"] == "reduce-scatter (grads)"]
    assert (ws["dim"], ws["group"], ws["link"]) == ("dp", 256, "inter-node")
    # the states: sharded over the 8 of a shard group, not all 256
    states = ("parameters", "gradients", "optimizer states")
    ratio = [hybrid["memory_bytes"][k] / whole["memory_bytes"][k] for k in states]
    assert ratio == pytest.approx([32, 32, 32], rel=1e-12)
    # the time model charges each on its link: the per-layer collectives on NVLink win
    dp_time = [lay["time_breakdown_s"]["dp comm (exposed)"] for lay in (hybrid, whole)]
    assert dp_time[0] < dp_time[1] and hybrid["step_time_s"] < whole["step_time_s"]


def test_search_offers_a_node_split_and_picks_the_faster(monkeypatch):
    c = numeric_candidates(SHAPE, CLUSTER, TRAIN)
    replicas = product(c, REPLICA_AXES)
    split = c["dp_replicate"] > 1
    assert split.any() and (c["dp_replicate"] == 1).any()
    for j in np.nonzero(split)[0][:50]:  # the shard group is a node's replica ranks
        axes = {name: int(c[name][j]) for name in ("tp", "cp", "pp", "dp")}
        assert replicas[j] // c["dp_replicate"][j] == node_replicas(axes, 8)
    scored = []
    real = SEARCH.evaluate

    def spy(shape, cluster, train, lay, eff, simulate=False):
        scored.append((lay.zero, np.max(lay.sizes["dp_replicate"])))
        return real(shape, cluster, train, lay, eff, simulate)

    monkeypatch.setattr(SEARCH, "evaluate", spy)
    res = search(SHAPE, CLUSTER, TRAIN, EFFICIENCY, top=3)
    assert all(m == 1 for zero, m in scored if zero == 0)  # ZeRO-0 shards nothing
    assert any(m > 1 for zero, m in scored if zero > 0)
    best = res.top[0]
    assert best.layout.sizes["dp_replicate"] > 1 and best.layout.zero > 0
    assert layout_problems(SHAPE, CLUSTER, TRAIN, best.layout) == []
    unsplit = Layout({**best.layout.sizes, "dp_replicate": 1}, mbs=best.layout.mbs,
                     schedule=best.layout.schedule, v=best.layout.v, zero=best.layout.zero,
                     recompute=best.layout.recompute, attention=best.layout.attention)
    assert float(evaluate(SHAPE, CLUSTER, TRAIN, unsplit, EFFICIENCY).step_time) > \
        float(best.step_time)


def test_the_search_says_hybrid_sharding_paid():
    # the fitted constants' slow links (0.296 x the datasheet's) and one NIC a node, where
    # it pays; the published bus bandwidths on a NIC a GPU make one group of 256 as fast
    rc, out = plan("--model", "llama3-8b", "--gpus", "256", "--global-batch", "512", "--top",
                   "1", "--json", "--efficiency", "fitted", *ONE_NIC)
    assert rc == 0, out
    doc = json.loads(out)
    assert doc["layouts"][0]["layout"]["dp_replicate"] == 32  # one node's 8 ranks a group
    words = " ".join(doc["explanation"])
    assert "over shard groups of 8 of the dp*cp=256 replicas (hybrid sharding: " \
        "dp_replicate=32 copies of each shard)" in words
    assert "Hybrid sharding pays: ZeRO's collectives stay inside shard groups of 8 ranks" in words
