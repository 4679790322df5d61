"""A measured profile's pipeline gap and the sync measurement's spread:
`plait calibrate` times the pipeline runtime's own work before each compute action
(measure_gap) and keeps each repeat of the sync extra; the planner prices the gap through
the shared simulator's `gap` and reports the spread without pricing it. No wall time is
asserted: the plans use chosen numbers."""

from __future__ import annotations

import pytest
from test_plan_profile import _plan_json, _profile, lay_step

from plait.plan import bubble
from plait.plan.profile import fit_profile, fit_sync, fit_sync_spread
from plait.schedule.simulate import Durations, simulate

BUBBLE = "pipeline bubble + p2p"


def test_runtime_gap_priced_in_the_pipeline(tmp_path):
    """pipeline_gap: a pipelined rank spends it before each compute action, idle (the
    simulator's `gap`): a pp = 2 step grows by it, all of the growth in the bubble line,
    at least one gap (the first forward waits for it) and at most one per compute action
    of every rank; a layout without a pipeline does not move."""
    path, prof = tmp_path / "p.json", _profile()
    flags = ("--gpus", "2", "--zero", "0", "--microbatch", "2")  # m = 4
    base = {lay: _plan_json(path, prof, "--layout", lay, *flags) for lay in ("pp=2", "dp=2")}
    prof["fit"]["pipeline_gap"] = 1e-3
    gapped = {lay: _plan_json(path, prof, "--layout", lay, *flags) for lay in ("pp=2", "dp=2")}
    assert gapped["dp=2"] == base["dp=2"]
    grew = lay_step(gapped["pp=2"]) - lay_step(base["pp=2"])
    assert grew == pytest.approx(gapped["pp=2"]["time_breakdown_s"][BUBBLE]
                                 - base["pp=2"]["time_breakdown_s"][BUBBLE], rel=1e-9)
    computes = 2 * 2 * 4  # F and B of 4 micro-batches on each of 2 ranks
    assert 1e-3 - 1e-12 <= grew <= computes * 1e-3 + 1e-12


def test_planner_gap_is_the_simulators():
    """The planner hands the gap to the shared simulator unchanged: its pipeline step is
    simulate()'s with Durations.gap, and 0 leaves it as before, bit for bit."""
    f, i, w = [2e-3, 3e-3], [2e-3, 3e-3], [1e-3, 2e-3]
    got = bubble.simulate_pipeline("1f1b", 2, 4, 1, f, i, w, 1e-4, gap=5e-4)["step"]
    sched = bubble._build("1f1b", 2, 4, 1, (1.2, 0.6, 0.04))
    want = simulate(sched, Durations(f[0], i[0], w[0], 1e-4, forward_per_stage=tuple(f),
                                     backward_input_per_stage=tuple(i),
                                     backward_weight_per_stage=tuple(w), gap=5e-4)).step_time
    assert got == pytest.approx(want, rel=1e-12)
    assert bubble.simulate_pipeline("1f1b", 2, 4, 1, f, i, w, 1e-4, gap=0.0) == \
        bubble.simulate_pipeline("1f1b", 2, 4, 1, f, i, w, 1e-4)


def test_ranking_closed_form_prices_the_gap_too():
    """The search's closed form (many layouts at once) adds the gap to each F and B: for
    1F1B, (m + p - 1) slots of F + B, so 2 (m + p - 1) gaps; the simulator, where a gap
    can overlap a wait for the input, adds more than nothing and no more than that."""
    from plait.plan.estimate import Layout, Training, evaluate
    from plait.plan.hardware import Cluster
    from plait.plan.profile import profile_hardware
    from plait.plan.shape import from_preset

    def steps(gap: float) -> tuple[float, float]:
        prof = _profile()
        prof["fit"]["pipeline_gap"] = gap
        gpu, eff = profile_hardware(prof)
        args = (from_preset("tiny", 32), Cluster(gpu, 2), Training(8, precision="fp32"),
                Layout(pp=2, zero=0, mbs=2), eff)  # m = 4
        return float(evaluate(*args).step_time), float(evaluate(*args, simulate=True).step_time)

    (r0, s0), (r1, s1) = steps(0.0), steps(2e-4)
    assert r1 - r0 == pytest.approx(2 * (4 + 2 - 1) * 2e-4, rel=1e-9)
    assert 0 < s1 - s0 <= r1 - r0 + 1e-12


def test_sync_spread_reports_each_repeat_and_the_fit_takes_the_mean_of_the_calls():
    """The spread: each repeat's mean extra, lowest / median / highest; the price: the
    mean over every call (measure_sync's `after_seconds`), a repeat whose calls hit the
    tail (a woken thread's wait for a core) counted as a step pays it."""
    link = {"alpha_s": 50e-6, "bandwidth_Bps": 1e9}
    price = 2 * 50e-6 + 1024 / 1e9
    rows = [{"compute_seconds": c, "wait_seconds": 1e-4,
             "after_seconds": price + sum(reps) / 3, "after_median_seconds": price + 1e-4,
             "after_repeats": [price + x for x in reps], "wait_repeats": [1e-4] * 3}
            for c, reps in ((5e-4, (5e-3, 3e-4, 2e-4)), (4e-3, (6e-4, 7e-4, 1e-4)))]
    raw = {"group": 2, "bytes": 1024, "segments": rows, "sizes": []}
    spread = fit_sync_spread(raw, link)
    assert [x for r in spread for x in (r["low"], r["median"], r["high"])] == pytest.approx(
        [2e-4, 3e-4, 5e-3, 1e-4, 6e-4, 7e-4], rel=1e-6)
    assert fit_sync(raw, link)["sync_after"] == pytest.approx((5.5e-3 / 3, 1.4e-3 / 3),
                                                              rel=1e-9)
    old = {**raw, "segments": [{k: v for k, v in r.items() if not k.endswith("repeats")}
                               for r in rows]}  # a profile from before the repeats
    assert fit_sync_spread(old, link) == [] and fit_sync_spread(None, link) == []


def test_a_profile_without_the_gap_plans_as_before():
    """An older profile (no pipeline_gap measured) fits to gap 0."""
    raw = {"gemm": [{"m": 64, "k": 64, "n": 64, "dtype": "float32", "seconds": 1e-4},
                    {"m": 256, "k": 256, "n": 256, "dtype": "float32", "seconds": 2e-3}],
           "attention": [], "collectives": {}, "memory": {"bytes": 1e9, "seconds": 0.1},
           "dispatch": None}
    fit = fit_profile(raw)
    assert fit["pipeline_gap"] == 0.0 and fit["sync_spread"] == []


def test_selective_policy_priced_per_layer(tmp_path):
    """policy_layer_seconds: plait's selective policy (a dispatch mode) costs that much per
    layer and micro-batch, in the recompute line; recompute none does not pay it."""
    path, prof = tmp_path / "p.json", _profile()
    flags = ("--gpus", "1", "--layout", "dp=1", "--zero", "0", "--microbatch", "4")
    base = {r: _plan_json(path, prof, *flags, "--recompute", r) for r in ("selective", "none")}
    prof["fit"]["dispatch"] = {**prof["fit"]["dispatch"], "policy_layer_seconds": 1e-3}
    got = {r: _plan_json(path, prof, *flags, "--recompute", r) for r in ("selective", "none")}
    assert got["none"] == base["none"]
    grew = got["selective"]["time_breakdown_s"]["recompute"] \
        - base["selective"]["time_breakdown_s"]["recompute"]
    assert grew == pytest.approx(2 * 2 * 1e-3, rel=1e-9)  # 2 micro-batches x 2 layers
    assert lay_step(got["selective"]) - lay_step(base["selective"]) == pytest.approx(grew,
                                                                                     rel=1e-9)


def test_comm_cpu_fit_is_a_line_in_the_payload():
    from plait.plan.profile import fit_comm_cpu

    rows = {f"{op}@2": [{"payload": b, "cpu_seconds": 1e-4 + 2e-10 * b} for b in (4096, 1 << 20)]
            for op in ("all_reduce", "all_gather")}
    got = fit_comm_cpu(rows, 2)
    assert got["call_s"] == pytest.approx(1e-4, rel=1e-6)
    assert got["byte_s"] == pytest.approx(2e-10, rel=1e-6)
    assert fit_comm_cpu({"all_reduce@2": [{"payload": 4096, "seconds": 1.0}]}, 2) == {
        "call_s": 0.0, "byte_s": 0.0}  # an older profile: not measured
