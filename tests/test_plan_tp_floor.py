"""The tp floor (plait/calibrate/tp.py): what a tp rank's CPU holds beyond the
planner's per-operation and per-collective prices where ranks share a host's cores, its
fit (plait/plan/profile.py's fit_tp_floor) and where the planner adds it
(plait/plan/compute.py's tp_floor_seconds, estimate's _chunk_times).

The fit is checked on synthetic measurements built from chosen extras (it must give them
back exactly); the planner through `plait plan --hardware` on a profile with chosen
numbers: the compute line grows by exactly micro-batches x (layers x the layer's extra +
the outside extra), and only for tp > 1 on shared cores. No wall time is asserted.
"""

from __future__ import annotations

import os

import pytest

from plait.calibrate.tp import SHARED_MAX_RANKS, TP, measure_tp_floor
from plait.plan.compute import Efficiency, tp_floor_seconds
from plait.plan.profile import fit_tp_floor
from tests.test_plan_profile import _plan_json, _profile

DISPATCH = {"op_seconds": 1e-5, "layer_ops": 100.0, "outside_ops": 50.0,
            "optimizer_layer_ops": 5.0, "optimizer_fixed_ops": 10.0,
            "policy_layer_seconds": 2e-3}
COMM_CPU = {"call_s": 1e-3, "byte_s": 1e-9}


def _rows(layer_extra: float, outside_extra: float, selective: bool) -> dict:
    """A floor measurement whose CPU is the planner's price plus the chosen extras."""
    d = DISPATCH
    layer = d["op_seconds"] * d["layer_ops"] * (4 / 3 if selective else 1.0) \
        + (d["policy_layer_seconds"] if selective else 0.0)
    fixed = d["op_seconds"] * (d["outside_ops"] + d["optimizer_fixed_ops"]
                               + d["optimizer_layer_ops"])
    rows = {}
    for layers in (1, 2):
        tp_calls, tp_bytes = 7 + 10 * layers, 5000.0 + 8000.0 * layers
        calls, payload = tp_calls + 3, tp_bytes + 60000.0
        rows[layers] = {"tp_calls": tp_calls, "tp_payload_bytes": tp_bytes, "calls": calls,
                        "payload_bytes": payload,
                        "cpu_seconds": layers * (layer + layer_extra) + fixed + outside_extra
                        + COMM_CPU["call_s"] * calls + COMM_CPU["byte_s"] * payload}
    return rows


def test_fit_gives_back_the_chosen_extras():
    none, sel = _rows(3e-3, 4e-3, False), _rows(5e-3, 1e-3, True)
    t = {"shared": {"none_1": none[1], "none_2": none[2],
                    "selective_1": sel[1], "selective_2": sel[2]}}
    fit = fit_tp_floor(t, DISPATCH, COMM_CPU)
    assert fit == pytest.approx({"tp_shared_layer_seconds": 3e-3,
                                 "tp_shared_outside_seconds": 4e-3,
                                 "tp_shared_layer_seconds_selective": 5e-3,
                                 "tp_shared_outside_seconds_selective": 1e-3}, rel=1e-9)
    # a measurement below the prices (noise) is no negative CPU
    low = _rows(-1e-3, -2e-3, False)
    t["shared"].update(none_1=low[1], none_2=low[2])
    fit = fit_tp_floor(t, DISPATCH, COMM_CPU)
    assert fit["tp_shared_layer_seconds"] == fit["tp_shared_outside_seconds"] == 0.0
    assert fit_tp_floor(None, DISPATCH, COMM_CPU) == fit_tp_floor({}, DISPATCH, COMM_CPU) == {}


def test_only_tp_ranks_on_shared_cores_pay_it():
    eff = Efficiency(0.8, 1e6, 1.0, 0.0, tp_shared_layer_seconds=1.0,
                     tp_shared_outside_seconds=2.0, tp_shared_layer_seconds_selective=3.0,
                     tp_shared_outside_seconds_selective=4.0)
    assert [float(x) for x in tp_floor_seconds(eff, 2, "none", True)] == [1.0, 2.0]
    assert [float(x) for x in tp_floor_seconds(eff, 4, "selective", True)] == [3.0, 4.0]
    assert [float(x) for x in tp_floor_seconds(eff, 2, "full", True)] == [1.0, 2.0]
    assert [float(x) for x in tp_floor_seconds(eff, 1, "none", True)] == [0.0, 0.0]
    assert [float(x) for x in tp_floor_seconds(eff, 2, "selective", False)] == [0.0, 0.0]


@pytest.mark.parametrize("recompute,suffix", [("none", ""), ("selective", "_selective")])
def test_planner_adds_it_to_the_compute_of_tp_ranks_on_shared_cores(tmp_path, recompute,
                                                                     suffix):
    path, prof = tmp_path / "p.json", _profile()
    prof["cores"] = 2  # four ranks on a host of two cores: shared
    flags = ("--gpus", "4", "--gpus-per-node", "2", "--ranks-per-host", "4", "--zero", "0",
             "--microbatch", "2", "--recompute", recompute, "--no-sp")
    layouts = ("tp=2,dp=2", "dp=4")
    base = {lay: _plan_json(path, prof, "--layout", lay, *flags) for lay in layouts}
    alone = _plan_json(path, prof, "--layout", "tp=2,dp=2", *flags[:4], "--ranks-per-host",
                       "1", *flags[6:])
    layer, outside = 1e-3, 3e-3
    prof["fit"]["tp_floor"] = {f"tp_shared_layer_seconds{suffix}": layer,
                               f"tp_shared_outside_seconds{suffix}": outside}
    more = {lay: _plan_json(path, prof, "--layout", lay, *flags) for lay in layouts}
    m, layers = 8 // (2 * 2), 2  # global batch 8 over dp 2 in micro-batches of 2; tiny
    grew = more["tp=2,dp=2"]["time_breakdown_s"]["compute"] \
        - base["tp=2,dp=2"]["time_breakdown_s"]["compute"]
    assert grew == pytest.approx(m * (layers * layer + outside), rel=1e-9)
    assert more["tp=2,dp=2"]["step_time_s"] > base["tp=2,dp=2"]["step_time_s"]
    assert more["dp=4"] == base["dp=4"]  # no tp: nothing added
    # a rank per host (no sharing): unchanged
    assert _plan_json(path, prof, "--layout", "tp=2,dp=2", *flags[:4], "--ranks-per-host",
                      "1", *flags[6:]) == alone


def test_calibrate_floor_measures_tp_calls_and_cpu():
    """The quick floor on this machine: two ranks a core (at least 2 ranks), each rank in
    a session of its own; SP's calls per layer counted by the ledger, the same every run;
    CPU measured."""
    cores = len(os.sched_getaffinity(0))
    out = measure_tp_floor(quick=True)
    if max(TP, 2 * cores) > SHARED_MAX_RANKS:
        assert out == {}
        return
    run = out["shared"]
    assert (run["world"], run["tp"], out["cores"]) == (max(TP, 2 * cores), TP, cores)
    # every rank in a session of its own, as torchrun starts a job's ranks (plait/calibrate/tp.py)
    assert run["own_sessions"] is True
    for mode in ("none", "selective"):
        one, two = run[f"{mode}_1"], run[f"{mode}_2"]
        assert two["tp_calls"] > one["tp_calls"] > 0  # a layer adds tp calls
        assert two["tp_payload_bytes"] > one["tp_payload_bytes"] > 0
        assert one["calls"] > one["tp_calls"]  # dp's all-reduces, the norm, the loss
        assert one["cpu_seconds"] > 0 and one["cpu_median_seconds"] > 0
    # selective replays the forward's exchanges (docs/recompute.md): more tp calls a layer
    assert run["selective_2"]["tp_calls"] - run["selective_1"]["tp_calls"] > \
        run["none_2"]["tp_calls"] - run["none_1"]["tp_calls"]
