"""Ranks sharing a host's cores (plait/plan/host_share.py): the model's limits, its
equation as the fixed point it was derived from, and that every planner output uses it
where (and only where) a host has fewer cores than runnable tasks. Pure Python."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_plan_profile import _profile, plan

from plait.plan import host_share
from plait.plan.calibration import EFFICIENCY
from plait.plan.estimate import Layout, Training, evaluate
from plait.plan.hardware import Cluster, get_gpu
from plait.plan.profile import profile_hardware
from plait.plan.shape import from_preset


def test_the_limits_it_must_reach():
    d, w = 0.1, 0.05
    # as many cores as ranks and nothing else runnable: each rank owns a core
    assert host_share.shared_step(d, w, cores=4, ranks=4) == pytest.approx(d + w)
    # no other work: a work-conserving scheduler's two bounds, the cores' capacity
    # R D / C and a rank's own chain D + W
    assert host_share.shared_step(d, w, cores=2, ranks=4) == pytest.approx(4 * d / 2)
    assert host_share.shared_step(d, 0.5, cores=2, ranks=4) == pytest.approx(d + 0.5)
    # one rank that never waits, B other runnable entities: a 1 / (B + 1) share of C cores
    assert host_share.shared_step(d, 0.0, cores=2, ranks=1, load=3) == pytest.approx(
        d * 4 / 2)
    # more waiting never makes a step shorter, more cores never longer
    steps = [float(host_share.shared_step(d, x, 2, 4, 1.5)) for x in (0.0, 0.1, 0.3, 1.0)]
    assert steps == sorted(steps)
    assert host_share.shared_step(d, w, 3, 4, 1.5) < host_share.shared_step(d, w, 2, 4, 1.5)


def test_drifting_ranks_share_their_node_link():
    """link_wait: one rank a node keeps the planner's wait; k ranks that never overlap
    (a long step) each send at the whole link, 1/k of the in-step wait; in between, the
    mean-field equation holds, and never more than the in-step wait."""
    assert host_share.link_wait(0.4, 1, 1.0) == pytest.approx(0.4)
    assert host_share.link_wait(0.4, 2, 1e9) == pytest.approx(0.2)
    w = float(host_share.link_wait(0.4, 2, 1.0))
    assert w == pytest.approx(0.2 * (1 + w / 1.0)) and 0.2 < w < 0.4
    assert host_share.link_wait(0.4, 4, 0.3) == pytest.approx(0.4)  # capped
    # solved with the cores: the same step from both equations at the fixed point
    t = float(host_share.shared_cores_step(0.15, 0.0, 0.5, 2, 4, 1.0, 2))
    w = float(host_share.link_wait(0.5, 2, t))
    assert t == pytest.approx(float(host_share.shared_step(0.15, w, 2, 4, 1.0)), rel=1e-6)


@pytest.mark.parametrize("d,w,cores,ranks,load", [(0.1, 0.05, 2, 4, 2.5),
                                                  (0.3, 0.6, 2, 4, 6.0), (0.02, 0.0, 8, 16, 1.0)])
def test_the_step_is_the_fixed_point_of_processor_sharing(d, w, cores, ranks, load):
    """With T the model's step: a rank is runnable (T - W) / T of it, so B + R (T - W) / T
    tasks share the cores; at that share its CPU work D takes exactly T - W."""
    t = float(host_share.shared_step(d, w, cores, ranks, load))
    runnable = load + ranks * (t - w) / t
    share = min(1.0, cores / runnable)
    assert share < 1.0  # oversubscribed in these cases
    assert share * (t - w) == pytest.approx(d, rel=1e-9)


def test_gpu_presets_are_untouched_and_a_profile_with_few_cores_is_shared():
    shape, train = from_preset("tiny", 128), Training(16, precision="fp32")
    lay = Layout(tp=2, dp=2, zero=0)
    gpu = get_gpu("h100-sxm", gpus_per_node=2)
    preset = evaluate(shape, Cluster(gpu, 4, ranks_per_host=4, host_load=3.0), train, lay,
                      EFFICIENCY)
    assert gpu.host_cores == 0 and host_share.TERM not in preset.time
    cpu, eff = profile_hardware({**_profile(), "cores": 2})
    cpu = replace(cpu, internode_bw=1e6)  # a slow link between nodes: dp's wait is exposed
    own = evaluate(shape, Cluster(cpu, 4, ranks_per_host=2), train, lay, eff)  # 2 on 2
    assert host_share.TERM not in own.time
    shared = evaluate(shape, Cluster(cpu, 4, ranks_per_host=4), train, lay, eff)
    # dp crosses the nodes (2 ranks each): its exposed all-reduce is the rank's wait; tp
    # inside keeps a node's 2 ranks in step, so they wait on the link together, no rank
    # of the host computing meanwhile
    bubble, link = (float(x) for x in host_share.waits(own.time, own.collectives))
    assert bubble == pytest.approx(0.0, abs=1e-12)  # no pipeline
    assert link == pytest.approx(float(own.time["dp comm (exposed)"])) and link > 0
    assert host_share.in_step(own.collectives, 2)
    assert float(shared.step_time) == pytest.approx(link + float(host_share.shared_cores_step(
        float(own.step_time) - bubble - link, bubble, 0.0, 2, 4, 0.0, 2)))
    # tp across the nodes, dp inside: a node's ranks are in different tp groups and drift
    # apart (the mean-field link share, `link_wait`)
    across = Layout(tp=2, dp=2, zero=0, order=("dp", "tp", "cp", "pp"))
    own_x = evaluate(shape, Cluster(cpu, 4, ranks_per_host=2), train, across, eff)
    shared_x = evaluate(shape, Cluster(cpu, 4, ranks_per_host=4), train, across, eff)
    bubble, link = (float(x) for x in host_share.waits(own_x.time, own_x.collectives))
    assert not host_share.in_step(own_x.collectives, 2) and link > 0
    assert float(shared_x.step_time) == pytest.approx(float(host_share.shared_cores_step(
        float(own_x.step_time) - bubble - link, bubble, link, 2, 4, 0.0, 2)))
    assert float(shared.time[host_share.TERM]) == pytest.approx(
        float(shared.step_time) - float(own.step_time))
    # a fast link (the profile's): the only wait is the last gradient all-reduce's (a
    # profile prices it exposed: it starts when the backward is done), so 4 ranks on 2
    # cores take about twice the CPU time, plus that wait, every rank's at once (in step)
    fast, _ = profile_hardware({**_profile(), "cores": 2})
    alone = evaluate(shape, Cluster(fast, 4, ranks_per_host=2), train, lay, eff)
    both = evaluate(shape, Cluster(fast, 4, ranks_per_host=4), train, lay, eff)
    bubble, link = (float(x) for x in host_share.waits(alone.time, alone.collectives))
    assert float(both.step_time) == pytest.approx(link + float(host_share.shared_cores_step(
        float(alone.step_time) - bubble - link, bubble, 0.0, 2, 4, 0.0, 2)))
    assert link < 0.05 * float(alone.step_time)
    assert float(both.step_time) == pytest.approx(2 * float(alone.step_time), rel=0.02)


def test_plan_says_when_the_cores_are_shared(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**_profile(), "cores": 2}))
    base = ("--hardware", str(path), "--model", "tiny", "--vocab", "256", "--seq", "32",
            "--gpus", "4", "--gpus-per-node", "2", "--global-batch", "8", "--precision",
            "fp32", "--layout", "tp=2,dp=2", "--zero", "0", "--json")
    rc, out = plan(*base, "--ranks-per-host", "4", "--host-load", "1")
    assert rc == 0, out
    doc = json.loads(out)
    assert any(n.startswith("Host cores shared: 4 ranks and 1 other runnable entities on 2 "
                            "cores per host") for n in doc["explanation"]), doc["explanation"]
    assert doc["layouts"][0]["time_breakdown_s"][host_share.TERM] > 0
    rc, out = plan(*base)  # a node's 2 ranks on its 2 cores: a core each
    assert not any(n.startswith("Host cores") for n in json.loads(out)["explanation"])
    rc, out = plan(*base, "--ranks-per-host", "0", "--host-load", "-1", "--host-cores", "-2")
    assert rc == 2
    for phrase in ("--ranks-per-host 0 must be >= 1", "--host-load -1.0: give a number",
                   "--host-cores -2.0: give a number of cores"):
        assert phrase in out, out


def test_measured_collective_cpu_is_work_and_the_rest_a_wait():
    """With a profile's comm_cpu, each collective's CPU (count x (per call + per byte x
    size), hidden calls too) needs a core and the rest of each dimension's exposed time is
    a wait (on the link where its groups cross nodes): the step is the sharing model's
    for exactly that split; without it, the default split (inside a node: work)."""
    shape, train = from_preset("tiny", 128), Training(16, precision="fp32")
    lay = Layout(tp=2, dp=2, zero=0)
    prof = {**_profile(), "cores": 2}
    prof["fit"]["comm_cpu"] = {"call_s": 1e-4, "byte_s": 1e-10}
    cpu, eff = profile_hardware(prof)
    cpu = replace(cpu, internode_bw=1e6)
    assert (eff.comm_cpu_call, eff.comm_cpu_byte) == (1e-4, 1e-10)
    own = evaluate(shape, Cluster(cpu, 4, ranks_per_host=2), train, lay, eff)
    shared = evaluate(shape, Cluster(cpu, 4, ranks_per_host=4), train, lay, eff)
    t, colls = own.time, own.collectives
    used = {d: sum(float(c.count) * (1e-4 + 1e-10 * float(c.size)) for c in colls
                   if c.dim == d and c.group > 1) for d in ("tp", "dp")}
    tp_wait = max(float(t["tp comm (exposed)"]) - used["tp"], 0.0)  # tp inside a node
    dp_link = max(float(t["dp comm (exposed)"]) - used["dp"], 0.0)  # dp crosses
    work = float(own.step_time) - float(t["tp comm (exposed)"]) - float(
        t["dp comm (exposed)"]) + used["tp"] + used["dp"]
    assert host_share.in_step(colls, 2)  # tp inside: the dp link wait is everyone's at once
    split = host_share.work_and_waits(t, colls, own.step_time, 1e-4, 1e-10)  # as benchmarked
    assert [float(x) for x in split] == pytest.approx([work, tp_wait, dp_link], rel=1e-9)
    assert float(shared.step_time) == pytest.approx(dp_link + float(
        host_share.shared_cores_step(work, tp_wait, 0.0, 2, 4, 0.0, 2)), rel=1e-9)
    old = evaluate(shape, Cluster(cpu, 4, ranks_per_host=4), train, lay,
                   replace(eff, comm_cpu_call=0.0, comm_cpu_byte=0.0))
    assert float(old.step_time) != pytest.approx(float(shared.step_time), rel=1e-6)


def test_node_ranks_in_step_only_as_one_group_of_a_per_layer_dimension():
    from plait.plan.comm.price import Collective

    def coll(dim: str, group: int, intra: bool) -> Collective:
        return Collective(dim, "all-gather", 1.0, 2.0, group, intra, 0.0, 0.0, "")

    assert host_share.in_step([coll("tp", 2, True), coll("dp", 2, False)], 2)
    assert not host_share.in_step([coll("tp", 2, True)], 4)  # two tp groups a node: drift
    assert host_share.in_step([coll("tp", 2, True), coll("cp", 2, True)], 4)
    assert not host_share.in_step([coll("tp", 2, False), coll("dp", 2, True)], 2)
    assert not host_share.in_step([coll("dp", 2, True)], 2)  # dp: once a step
    assert not host_share.in_step([coll("tp", 2, True)], 1)  # one rank a node: alone
    # with the measured CPU the in-step step is the link wait plus the rest shared
    got = float(host_share.step_on_shared_cores(0.046, 0.03, 0.044, 2, 4, 1.0, 2, True))
    assert got == pytest.approx(0.044 + float(host_share.shared_cores_step(
        0.046, 0.03, 0.0, 2, 4, 1.0, 2)), rel=1e-12)


def test_hidden_collectives_cpu_stretches_a_rank_that_has_no_free_core():
    """Ranks holding every core of their host (R = C, nothing else running): the CPU of
    the calls a rank does not wait on (ZeRO-3's prefetched gathers, its reduce-scatters
    behind the backward: count - blocking) is a line of the step, count x (per call + per
    byte x size); none where a core is free, without comm_cpu, or for a GPU preset; and
    none for calls all waited on (ZeRO-0's gradient all-reduce, tp's)."""
    shape, train = from_preset("tiny", 128), Training(16, precision="fp32")
    prof = {**_profile(), "cores": 2}
    prof["fit"]["comm_cpu"] = {"call_s": 1e-4, "byte_s": 1e-10}
    cpu, eff = profile_hardware(prof)
    z3 = Layout(dp=2, zero=3)
    est = evaluate(shape, Cluster(cpu, 2, ranks_per_host=2), train, z3, eff)
    hidden = [(float(c.count) - float(c.blocking)) * (1e-4 + 1e-10 * float(c.size))
              for c in est.collectives if c.blocking is not None and c.group > 1]
    assert sum(hidden) > 0
    assert float(est.time[host_share.HIDDEN_TERM]) == pytest.approx(sum(hidden), rel=1e-9)
    off = [evaluate(shape, Cluster(cpu, 2, ranks_per_host=2), train, z3,
                    replace(eff, comm_cpu_call=0.0, comm_cpu_byte=0.0)),
           evaluate(shape, Cluster(replace(cpu, host_cores=4.0), 2, ranks_per_host=2),
                    train, z3, eff),
           evaluate(shape, Cluster(get_gpu("h100-sxm", gpus_per_node=2), 2), train, z3,
                    EFFICIENCY)]
    for other in (Layout(dp=2, zero=0), Layout(tp=2, zero=0)):
        off.append(evaluate(shape, Cluster(cpu, 2, ranks_per_host=2), train, other, eff))
    assert all(host_share.HIDDEN_TERM not in e.time for e in off)
    assert float(est.step_time) == pytest.approx(float(off[0].step_time) + sum(hidden),
                                                 rel=1e-9)
