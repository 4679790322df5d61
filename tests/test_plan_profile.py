"""Hardware profiles: `plait calibrate` measures, plait/plan/profile.py fits, `plait plan
--hardware` plans with the fitted numbers (CPU profiles).

No wall time is asserted: the measurement's structure and the deterministic parts (the
ledger's algorithmic bytes, the fits on synthetic data) are; that the plan uses the
profile is checked on a profile with chosen numbers, through quantities the planner
computes from them alone.
"""

from __future__ import annotations

import json
import math

import pytest
from helpers import plan_cli as plan

from plait.calibrate.machine import ELEMENTWISE_MODELS, QUICK_BYTES, QUICK_GEMMS, calibrate
from plait.calibrate.steps import (
    POST_BYTES,
    SYNC_LARGE_BYTES,
    SYNC_SEGMENTS,
    SYNC_STATISTIC,
)
from plait.plan.profile import (
    PROFILE_VERSION,
    curve,
    fit_alpha_beta,
    fit_concurrent,
    fit_elementwise,
    fit_gemm_curve,
    fit_overlap,
    fit_sync,
    profile_hardware,
)


def test_gemm_curve_fit_recovers_a_known_curve():
    peak_true, e_max, half = 50e9, 0.9, 3e6
    work = [2 * m * k * n for m, k, n in [(32, 32, 32), (64, 64, 64), (128, 64, 192),
                                          (256, 256, 256), (512, 512, 512), (1024, 1024, 1024)]]
    seconds = [w / (peak_true * e_max * w / (w + half)) for w in work]
    fit = fit_gemm_curve(work, seconds)
    for w, s in zip(work, seconds):  # the fitted curve reproduces every point
        assert curve(w, fit) == pytest.approx(w / s, rel=0.02)
    assert fit["rms_log_error"] < 0.01
    assert curve(work[0], fit) < curve(work[-1], fit)  # monotone by construction


def test_alpha_beta_fit_recovers_the_terms():
    n, alpha, bw = 4, 20e-6, 3e9
    sent = [2 * (n - 1) / n * s for s in (1e3, 1e5, 1e6, 1e7)]
    t = [2 * (n - 1) * alpha + x / bw for x in sent]
    got = fit_alpha_beta("all_reduce", n, sent, t)
    assert got["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert got["bandwidth_Bps"] == pytest.approx(bw, rel=1e-6)


@pytest.mark.slow  # measures this machine: GEMMs, collectives, dispatch
def test_calibrate_measures_every_term():
    prof = calibrate(ranks=2, quick=True)
    assert prof["version"] == PROFILE_VERSION and prof["ranks"] == 2
    raw = prof["raw"]
    f32 = [(r["m"], r["k"], r["n"]) for r in raw["gemm"] if r["dtype"] == "float32"]
    assert f32 == QUICK_GEMMS and any(r["dtype"] == "bfloat16" for r in raw["gemm"])
    assert all(r["seconds"] > 0 for r in raw["gemm"] + raw["attention"])
    assert raw["memory"]["bytes"] > 0 and raw["memory"]["seconds"] > 0
    assert set(raw["collectives"]) == {"all_reduce@2", "all_gather@2", "reduce_scatter@2"}
    for key, rows in raw["collectives"].items():
        assert [r["payload"] for r in rows] == QUICK_BYTES, key
        # the ledger's algorithmic bytes (deterministic): ring all-reduce 2(n-1)/n S, the
        # gathers (n-1)/n S of the full tensor, n = 2
        share = 1.0 if key.startswith("all_reduce") else 0.5
        assert [r["sent"] for r in rows] == [share * b for b in QUICK_BYTES], key
        assert all(r["seconds"] > 0 and r["cpu_seconds"] >= 0 for r in rows)
    assert set(prof["fit"]["comm_cpu"]) == {"call_s", "byte_s"}
    assert min(prof["fit"]["comm_cpu"].values()) >= 0
    d = raw["dispatch"]  # operation counts: a second layer adds operations, never removes
    assert d["step_ops_2"] > d["step_ops_1"] > 0 and d["optimizer_ops_2"] > d["optimizer_ops_1"]
    assert d["elementwise_bytes_2"] > d["elementwise_bytes_1"] > 0
    assert d["runtime_step_ops"] == d["step_ops_2"] + d["optimizer_ops_2"]
    assert d["step_seconds"] > 0 and d["layer_saved_bytes"] > 0
    assert d["step_seconds_selective"] > 0 and prof["fit"]["dispatch"]["policy_layer_seconds"] >= 0
    small, large = raw["elementwise"]  # the same operations, on larger tensors
    assert [r["hidden"] for r in raw["elementwise"]] == [m[0] for m in ELEMENTWISE_MODELS]
    assert small["ops"] == large["ops"] > 0 and large["bytes"] > small["bytes"] > 0
    assert all(raw["overlap"][k] > 0 for k in ("comm_seconds", "compute_seconds",
                                               "both_seconds"))
    sync = raw["sync"]  # after compute on both ranks, and back to back
    assert sync["group"] == 2 and sync["back_to_back_seconds"] > 0
    assert [r["compute_seconds"] for r in sync["segments"]] == list(SYNC_SEGMENTS)
    assert [(r["bytes"], r["compute_seconds"]) for r in sync["sizes"]] == [
        (SYNC_LARGE_BYTES, SYNC_SEGMENTS[0])] and sync["sizes"][0]["after_seconds"] > 0
    assert all(r["wait_seconds"] >= 0 and r["after_seconds"] > 0 for r in sync["segments"])
    assert [(r["m"], r["k"], r["n"]) for r in raw["gemm_concurrent"]] == QUICK_GEMMS
    assert all(r["seconds"] > 0 for r in raw["gemm_concurrent"])
    assert sync["statistic"] == SYNC_STATISTIC and len(sync["back_to_back_repeats"]) == 3
    assert sync["calls"] == 8 * 3  # every call of the repeats: their mean, each repeat's kept
    for r in sync["segments"] + sync["sizes"]:
        assert len(r["after_repeats"]) == len(r["wait_repeats"]) == 3
        assert r["after_seconds"] == pytest.approx(sum(r["after_repeats"]) / 3, rel=1e-9)
        assert r["wait_seconds"] == pytest.approx(sum(r["wait_repeats"]) / 3, rel=1e-9)
        assert r["after_median_seconds"] > 0 and r["wait_median_seconds"] >= 0
    gap = raw["pipeline_gap"]  # plait's runtime trained at pp = 2: its gap per compute
    assert (gap["pp"], gap["schedule"], len(gap["gap_repeats"])) == (2, "1f1b", 2)
    assert gap["gap_seconds"] > 0 and prof["fit"]["pipeline_gap"] == gap["gap_seconds"]
    assert eff_of(prof).pipeline_gap == gap["gap_seconds"]
    spread = prof["fit"]["sync_spread"]
    assert [r["compute_seconds"] for r in spread] == list(SYNC_SEGMENTS)
    assert all(r["low"] <= r["median"] <= r["high"] for r in spread)
    post = raw["post"]  # a batch of pipeline transfers posted after compute
    assert post["group"] == 2 and post["bytes"] == POST_BYTES
    assert post["post_seconds"] > 0 and post["post_cpu_seconds"] >= 0
    assert post["complete_seconds"] >= 0
    fit = prof["fit"]
    assert fit["p2p_post"] == post["post_seconds"] and eff_of(prof).p2p_post == fit["p2p_post"]
    assert 0 < fit["concurrent_gemm"] <= 1  # the fit is a function of the raw numbers
    assert fit["dispatch"]["layer_ops"] + fit["dispatch"]["outside_ops"] == d["step_ops_1"]
    for v in (fit["gemm"]["peak_flops"], fit["gemm"]["gemm_half"], fit["bf16_peak_flops"],
              fit["memory_bw_Bps"], fit["attention_scale"], fit["link"]["bandwidth_Bps"]):
        assert math.isfinite(v) and v > 0
    assert fit["link"]["alpha_s"] >= 0 and fit["link_group"] == 2
    assert 0 <= fit["comm_overlap"] <= 1 and fit["elementwise_passes"] > 0
    gpu, eff = profile_hardware(prof)
    assert gpu.hbm_bw == fit["memory_bw_Bps"] and eff.link_efficiency == 1.0
    # the tp floor (tests/test_plan_tp_floor.py): measured on this host's shared cores
    assert "tp_floor" in raw and eff.tp_shared_layer_seconds == fit["tp_floor"].get(
        "tp_shared_layer_seconds", 0.0) >= 0


def test_alpha_beta_fit_bounds_noise():
    """A loaded machine's times can fall with size; then each term gets its bound."""
    got = fit_alpha_beta("all_reduce", 2, [1e3, 1e5, 1e6], [3e-3, 1e-3, 2e-3])
    assert got["bounds"] and got["alpha_s"] == pytest.approx(3e-3 / 2)
    assert got["bandwidth_Bps"] == pytest.approx(1e6 / 2e-3)


DISPATCH = {"op_seconds": 10e-6, "layer_ops": 200.0, "outside_ops": 60.0,
            "optimizer_layer_ops": 30.0, "optimizer_fixed_ops": 20.0}


def _profile() -> dict:
    """A profile with chosen numbers (no measurement): what plan must use."""
    fit = {"gemm": {"peak_flops": 40e9, "gemm_max": 0.8, "gemm_half": 2e6,
                    "rms_log_error": 0.0}, "dispatch": DISPATCH,
           "bf16_peak_flops": 4e9, "fp32_peak_ratio": 10.0, "attention_scale": 0.25,
           "memory_bw_Bps": 8e9, "link": {"alpha_s": 50e-6, "bandwidth_Bps": 1e9},
           "link_group": 2, "links": {}}
    return {"version": PROFILE_VERSION, "name": "cpu-test", "memory_bytes": 64e9,
            "ranks_per_node": 2, "fit": fit, "raw": {}}


def test_plan_uses_the_profile(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile()))
    rc, out = plan("--hardware", str(path), "--model", "tiny", "--vocab", "256", "--seq", "32",
                   "--gpus", "2", "--global-batch", "8", "--precision", "fp32", "--layout",
                   "dp=2", "--zero", "0", "--json")
    assert rc == 0, out
    doc = json.loads(out)
    lay = doc["layouts"][0]
    assert doc["gpu"] == "cpu-test"
    # MFU's denominator: bf16 peak x fp32 ratio = the fp32 peak measured
    assert lay["mfu"] == pytest.approx(lay["flops_per_step"]["model"] / lay["step_time_s"] / 2
                                       / 40e9, rel=1e-12)
    # the gradient all-reduce over dp = 2: 2(n-1) alpha + 2(n-1)/n S / B, achieved bandwidth
    (ar,) = [c for c in lay["collectives"] if c["op"] == "all-reduce (grads)"]
    assert ar["link"] == "nvlink"  # both ranks on the profiled machine
    assert ar["time_each_s"] == pytest.approx(2 * 50e-6 + ar["bytes"] / 1e9, rel=1e-12)
    # the runtime's logged-loss all-reduce over dp (8 bytes) is priced too: a profile
    # prices plait's own collectives; the gradients fit one 25 MiB bucket, all-reduced
    # when the backward is done: exposed, whatever the overlap
    (loss,) = [c for c in lay["collectives"] if c["op"].startswith("all-reduce (logged")]
    assert loss["bytes"] * loss["count"] == 8
    assert lay["time_breakdown_s"]["dp comm (exposed)"] == pytest.approx(
        ar["time_each_s"] + 2 * 50e-6 + 8 / 1e9, rel=1e-12)
    # the optimizer step: fp32 Adam reads and writes (2 x 8 + 4 + 4) bytes per parameter;
    # the operations of its 2 layers and the fixed ones at 10 us each
    assert lay["time_breakdown_s"]["optimizer step"] == pytest.approx(
        doc["params"] * 24 / 8e9 + 10e-6 * (30 * 2 + 20), rel=1e-12)
    # the operations: per micro-batch (4 of 1 sequence per replica) 2 layers' 200 and the 60
    # outside them, 10 us each, on top of the same profile without a dispatch cost
    none = _profile()
    none["fit"]["dispatch"] = {k: 0.0 for k in DISPATCH}
    path.write_text(json.dumps(none))
    rc, out0 = plan("--hardware", str(path), "--model", "tiny", "--vocab", "256", "--seq",
                    "32", "--gpus", "2", "--global-batch", "8", "--precision", "fp32",
                    "--layout", "dp=2", "--zero", "0", "--json")
    lay0 = json.loads(out0)["layouts"][0]
    assert lay["time_breakdown_s"]["compute"] - lay0["time_breakdown_s"]["compute"] == \
        pytest.approx(4 * (2 * 200 + 60) * 10e-6, rel=1e-9)
    path.write_text(json.dumps({**_profile(), "name": "cpu-x"}))
    assert json.loads(plan("--hardware", str(path), "--model", "tiny", "--gpus", "2",
                           "--global-batch", "8", "--json")[1])["gpu"] == "cpu-x"


@pytest.mark.parametrize("content,phrase", [
    ("not json", "is not a profile plait calibrate wrote"),
    ('{"version": 1}', "lacks name"),
    ('{"version": 99, "name": "x", "memory_bytes": 1, "ranks_per_node": 1, "fit": {}, '
     '"raw": {}}', "is profile version 99"),
])
def test_bad_profiles_refused(tmp_path, content, phrase):
    path = tmp_path / "p.json"
    path.write_text(content)
    rc, out = plan("--hardware", str(path), "--model", "tiny", "--gpus", "2",
                   "--global-batch", "8")
    assert rc == 2 and phrase in out, out


def _plan_json(path, prof: dict, *flags: str) -> dict:
    path.write_text(json.dumps(prof))
    rc, out = plan("--hardware", str(path), "--model", "tiny", "--vocab", "256", "--seq", "32",
                   "--global-batch", "8", "--precision", "fp32", "--json", *flags)
    assert rc == 0, out
    return json.loads(out)["layouts"][0]


def test_measured_overlap_exposes_the_collectives(tmp_path):
    """comm_overlap 0 (a CPU's gloo threads share the core with the compute): every dp
    collective on the critical path, and ZeRO-3's as the runtime issues them, one per unit
    (embedding, 2 blocks, final norm, head) each micro-batch."""
    path, prof = tmp_path / "p.json", _profile()
    prof["fit"]["comm_overlap"] = 0.0
    lay = _plan_json(path, prof, "--gpus", "2", "--layout", "dp=2", "--zero", "0")
    exposed = sum(c["count"] * c["time_each_s"] for c in lay["collectives"])
    assert lay["time_breakdown_s"]["dp comm (exposed)"] == pytest.approx(exposed, rel=1e-12)
    lay3 = _plan_json(path, prof, "--gpus", "2", "--layout", "dp=2", "--zero", "3",
                      "--microbatch", "2")
    units, m = 2 + 3, 2
    ag, rs = (next(c for c in lay3["collectives"] if c["op"].startswith(op))
              for op in ("all-gather (params", "reduce-scatter (grads"))
    assert (ag["count"], rs["count"]) == (2 * units * m, units * m)
    assert ag["bytes"] * units == rs["bytes"] * units == pytest.approx(
        lay3["memory_bytes"]["parameters"] * 2, rel=1e-12)  # fp32 params, dp = 2 shards
    # each call (n - 1) alpha + (n - 1)/n S / B at n = 2
    assert ag["time_each_s"] == pytest.approx(50e-6 + ag["bytes"] / 2 / 1e9, rel=1e-12)
    world = [c for c in lay3["collectives"] if c["dim"] == "world"]  # the grad norm's
    assert [c["op"] for c in world] == ["all-reduce (grad norm, float64)"]
    assert lay3["time_breakdown_s"]["dp comm (exposed)"] == pytest.approx(
        sum(c["count"] * c["time_each_s"] for c in lay3["collectives"]), rel=1e-12)


def test_tp_priced_as_the_runtime_issues_it(tmp_path):
    """Under a profile the tp time is the runtime's list (SP's gathers and scatters, the
    norm gains' and the loss's all-reduces), not Megatron's 4 all-reduces per layer."""
    lay = _plan_json(tmp_path / "p.json", _profile(), "--gpus", "2", "--layout", "tp=2",
                     "--zero", "0")
    tp = [c for c in lay["collectives"] if c["dim"] == "tp"]
    assert len(tp) >= 5
    assert lay["time_breakdown_s"]["tp comm (exposed)"] == pytest.approx(
        sum(c["count"] * c["time_each_s"] for c in tp), rel=1e-9)


def test_elementwise_traffic_priced_per_pass(tmp_path):
    """elementwise_passes x the bytes a layer saves, three times a micro-batch (forward,
    backward), at the measured element-wise bandwidth."""
    from plait.model.presets import PRESETS
    from plait.plan.memory import layer_activations
    from plait.plan.shape import from_model_config

    path, prof = tmp_path / "p.json", _profile()
    base = _plan_json(path, prof, "--gpus", "1", "--layout", "dp=1", "--zero", "0",
                      "--microbatch", "4")
    prof["fit"].update(elementwise_passes=4.0, elementwise_bw_Bps=20e9)
    lay = _plan_json(path, prof, "--gpus", "1", "--layout", "dp=1", "--zero", "0",
                     "--microbatch", "4")
    cfg = PRESETS["tiny"]
    saved = float(layer_activations(from_model_config(cfg, seq=32), 4, 1, 1, False, "none", 4,
                                    "flash"))
    assert lay["time_breakdown_s"]["compute"] - base["time_breakdown_s"]["compute"] == \
        pytest.approx(2 * cfg.n_layers * 3 * 4.0 * saved / 20e9, rel=1e-9)  # 2 micro-batches


def test_overlap_and_elementwise_fits():
    assert fit_overlap(None) == 1.0  # nothing measured: the presets' full overlap
    # 3 ms alone, 2 ms alone, 4 ms together: 1 ms of the shorter (2 ms) hidden
    assert fit_overlap({"comm_seconds": 3e-3, "compute_seconds": 2e-3,
                        "both_seconds": 4e-3}) == pytest.approx(0.5)
    assert fit_overlap({"comm_seconds": 3e-3, "compute_seconds": 2e-3,
                        "both_seconds": 6e-3}) == 0.0  # slower together: none
    rows = [{"bytes": b, "seconds": 2e-6 + b / 40e9} for b in (1e4, 3e6)]
    d = {"elementwise_bytes_1": 1000, "elementwise_bytes_2": 1600, "layer_saved_bytes": 50.0}
    got = fit_elementwise(rows, d)
    assert got["elementwise_bw_Bps"] == pytest.approx(40e9, rel=1e-9)
    assert got["elementwise_passes"] == pytest.approx(600 / (3 * 50))
    assert fit_elementwise(None, d) == {"elementwise_passes": 0.0, "elementwise_bw_Bps": 0.0}


def test_sync_fit_and_the_wait_for_the_last_rank():
    """sync_extra: the measured mean after the last arrival less the alpha-beta price of
    that call; the wait for the last rank: a power law through the two measured points."""
    link = {"alpha_s": 50e-6, "bandwidth_Bps": 1e9}
    priced = 2 * 50e-6 + 1024 / 1e9  # a 1 KiB ring all-reduce on 2 ranks
    raw = {"group": 2, "bytes": 1024, "back_to_back_seconds": 1e-4, "segments": [
        {"compute_seconds": 1e-3, "wait_seconds": 1e-4, "after_seconds": priced + 3e-4},
        {"compute_seconds": 4e-3, "wait_seconds": 2e-4, "after_seconds": priced + 5e-4}],
        # 64 KiB after 1 ms: its own alpha-beta price, plus 2e-4 s more than 1 KiB's extra
        "sizes": [{"bytes": 65536, "compute_seconds": 1e-3, "wait_seconds": 1e-4,
                   "after_seconds": 2 * 50e-6 + 65536 / 1e9 + 3e-4 + 2e-4}]}
    got = fit_sync(raw, link)
    assert got["sync_extra"] == pytest.approx(4e-4, rel=1e-9)
    assert got["sync_after"] == pytest.approx((3e-4, 5e-4), rel=1e-9)  # per segment
    assert got["sync_per_byte"] == pytest.approx(2e-4 / (65536 - 1024), rel=1e-9)
    assert got["sync_bytes_measured"] == 65536  # the growth is held beyond it
    # with the calls' medians measured, the growth per byte is theirs (the tail of a
    # call's distribution is in the small call's mean, not per byte), the rest the mean's
    medians = {**raw, "segments": [{**r, "after_median_seconds": priced + 1e-4}
                                   for r in raw["segments"]],
               "sizes": [{**raw["sizes"][0], "after_median_seconds":
                          2 * 50e-6 + 65536 / 1e9 + 1e-4 + 1e-4}]}
    got_m = fit_sync(medians, link)
    assert got_m["sync_per_byte"] == pytest.approx(1e-4 / (65536 - 1024), rel=1e-6)
    assert got_m["sync_after"] == got["sync_after"]
    assert fit_sync(None, link) == fit_sync(raw, None) == {
        "sync_extra": 0.0, "desync_compute": (), "desync_wait": (), "sync_after": (),
        "sync_per_byte": 0.0}
    from plait.plan.comm.sync import desync_wait
    from plait.plan.compute import Efficiency

    eff = Efficiency(1.0, 1.0, 1.0, 0.0, desync_compute=got["desync_compute"],
                     desync_wait=got["desync_wait"])
    # doubling per 4 x: w = 1e-4 (L / 1e-3)^0.5
    assert desync_wait(16e-3, eff) == pytest.approx(4e-4, rel=1e-9)
    assert desync_wait(1e-3, Efficiency(1.0, 1.0, 1.0, 0.0)) == 0.0  # not measured
    falling = Efficiency(1.0, 1.0, 1.0, 0.0, desync_compute=(1e-3, 4e-3),
                         desync_wait=(2e-4, 1e-4))  # noise: held to a constant skew
    assert desync_wait(16e-3, falling) == pytest.approx(2 ** 0.5 * 1e-4, rel=1e-9)
    # three points on one law: that law; a noisy middle point: the least-squares law
    three = Efficiency(1.0, 1.0, 1.0, 0.0, desync_compute=(1e-3, 4e-3, 16e-3),
                       desync_wait=(1e-4, 2e-4, 4e-4))
    assert [desync_wait(x, three) for x in (0.5e-3, 8e-3, 64e-3)] == \
        pytest.approx([2 ** -0.5 * 1e-4, 8 ** 0.5 * 1e-4, 8e-4], rel=1e-9)
    bent = Efficiency(1.0, 1.0, 1.0, 0.0, desync_compute=(1e-3, 4e-3, 16e-3),
                      desync_wait=(1e-4, 8e-4, 4e-4))
    p = 0.5  # the least-squares slope through (0, 0), (1, 1.5), (2, 1) in log base 4
    y1 = math.exp((math.log(1e-4) + math.log(8e-4) + math.log(4e-4)) / 3
                  - p * (math.log(1e-3) + math.log(4e-3) + math.log(16e-3)) / 3)
    assert desync_wait(2e-3, bent) == pytest.approx(y1 * 2e-3 ** p, rel=1e-9)


def test_sync_priced_for_blocking_calls_by_segment(tmp_path):
    """Only the calls a rank waits on at once pay the sync line: ZeRO-3 at dp 2 with two
    micro-batches waits on 2 of its 10 all-gathers a micro-batch (each forward's and
    backward's first unit; the rest were prefetched), 1 of its 5 reduce-scatters (the
    last, after the backward) and the step's grad-norm all-reduce, which carries the
    logged loss where dp is the whole mesh: K = 2m + m + 1 = 7 of its 31 calls. Each
    pays the extra after the last arrival measured at its segment of compute
    (sync_after) and the wait, both power laws in L = C/K,
    and the extra's growth per byte up to the largest call measured (128 KiB in a profile
    without `sync_bytes_measured`), held there beyond it."""
    from plait.plan.comm.sync import SYNC_TERM

    path, prof = tmp_path / "p.json", _profile()
    prof["fit"]["sync"] = {"sync_extra": 1.5e-3, "desync_compute": [1e-3, 4e-3],
                           "desync_wait": [1e-4, 4e-4], "sync_after": [1e-3, 2e-3],
                           "sync_per_byte": 1e-9}
    lay = _plan_json(path, prof, "--gpus", "2", "--layout", "dp=2", "--zero", "3",
                     "--microbatch", "2")
    t, m = lay["time_breakdown_s"], 2
    assert sum(c["count"] for c in lay["collectives"]) == 2 * 5 * m + 5 * m + 1
    norm = next(c for c in lay["collectives"] if c["op"].startswith("all-reduce (grad norm"))
    assert norm["bytes"] == 16 and not any("logged loss" in c["op"] for c in lay["collectives"])
    k = 2 * m + m + 1
    seg = (t["compute"] + t["recompute"]) / k
    extra, wait = 1e-3 * (seg / 1e-3) ** 0.5, 1e-4 * seg / 1e-3
    ag, rs = (next(c for c in lay["collectives"] if c["op"].startswith(op))
              for op in ("all-gather (params", "reduce-scatter (grads"))
    assert ag["bytes"] > 4096 and rs["bytes"] > 4096
    for cap in (128 * 1024, 4096):
        if cap == 4096:
            prof["fit"]["sync"]["sync_bytes_measured"] = cap
            t = _plan_json(path, prof, "--gpus", "2", "--layout", "dp=2", "--zero", "3",
                           "--microbatch", "2")["time_breakdown_s"]
        blocking_bytes = 2 * m * min(ag["bytes"], cap) + m * min(rs["bytes"], cap) + 16
        assert t[SYNC_TERM] == pytest.approx(k * (extra + wait) + 1e-9 * blocking_bytes,
                                             rel=1e-9)


def test_sync_priced_per_collective_call(tmp_path):
    """Under a profile with sync numbers, every call over a group > 1 (not the pipeline's
    sends) pays sync_extra plus the wait for the last rank after compute / calls; the
    step grows by exactly that line. Without them (the presets) there is no such line."""
    from plait.plan.comm.sync import SYNC_TERM

    path, prof = tmp_path / "p.json", _profile()
    base = _plan_json(path, prof, "--gpus", "2", "--layout", "tp=2", "--zero", "0")
    assert SYNC_TERM not in base["time_breakdown_s"]
    prof["fit"]["sync"] = {"sync_extra": 1e-3, "desync_compute": [1e-3, 4e-3],
                           "desync_wait": [1e-4, 4e-4]}  # proportional to L
    for layout in ("tp=2", "pp=2"):
        lay = _plan_json(path, prof, "--gpus", "2", "--layout", layout, "--zero", "0")
        t = lay["time_breakdown_s"]
        calls = sum(c["count"] for c in lay["collectives"] if c["group"] > 1
                    and not (c["dim"] == "pp" and c["op"].startswith("send")))
        seg = (t["compute"] + t["recompute"]) / calls
        assert calls > 0 and t[SYNC_TERM] == pytest.approx(
            calls * (1e-3 + 1e-4 * seg / 1e-3), rel=1e-9)
    rc, out = plan("--gpu", "h100-sxm", "--model", "tiny", "--gpus", "2", "--layout", "tp=2",
                   "--global-batch", "8", "--json")  # a preset: no measured sync, no line
    assert rc == 0 and SYNC_TERM not in json.loads(out)["layouts"][0]["time_breakdown_s"]
    off = _plan_json(path, _profile(), "--gpus", "2", "--layout", "tp=2", "--zero", "0")
    assert lay_step(base) == lay_step(off)
    on = _plan_json(path, prof, "--gpus", "2", "--layout", "tp=2", "--zero", "0")
    assert lay_step(on) == pytest.approx(lay_step(base) + on["time_breakdown_s"][SYNC_TERM],
                                         rel=1e-9)


def lay_step(lay: dict) -> float:
    return lay["step_time_s"]


def eff_of(prof: dict):  # noqa: ANN201
    return profile_hardware(prof)[1]


def test_posting_transfers_priced_in_the_pipeline(tmp_path):
    """p2p_post: each batch of transfers a pipeline rank posts holds it that long, idle
    (the shared simulator's `post`): a pipelined step grows by it, inside "pipeline
    bubble + p2p", by at most every rank's posts; a layout without a pipeline does not
    change."""
    from plait.schedule.lower import lower
    from plait.schedule.registry import build_schedule

    path, prof = tmp_path / "p.json", _profile()
    flags = ("--gpus", "2", "--zero", "0", "--microbatch", "2")
    base = {lay: _plan_json(path, prof, "--layout", lay, *flags) for lay in ("pp=2", "dp=2")}
    prof["fit"]["p2p_post"] = 1e-3
    posted = {lay: _plan_json(path, prof, "--layout", lay, *flags) for lay in ("pp=2", "dp=2")}
    assert posted["dp=2"] == base["dp=2"]
    grew = lay_step(posted["pp=2"]) - lay_step(base["pp=2"])
    bubble = "pipeline bubble + p2p"
    assert grew == pytest.approx(posted["pp=2"]["time_breakdown_s"][bubble]
                                 - base["pp=2"]["time_breakdown_s"][bubble], rel=1e-9)
    # each post delays a path through the timeline by at most its own time: no more than
    # every rank's posts (runs of transfers in the lowered 1F1B lists, m = 4) together
    lists = lower(build_schedule("1f1b", 2, 4, 1)).actions
    runs = sum(1 for acts in lists for k, a in enumerate(acts)
               if len(a[0]) > 1 and (k == 0 or len(acts[k - 1][0]) == 1))
    assert runs >= 2 * 4 and 0 < grew <= runs * 1e-3 + 1e-12


def test_concurrent_gemms_fit_and_priced(tmp_path):
    """concurrent_gemm: the median of alone / together seconds, at most 1; under it a
    host of two ranks runs its GEMMs (the head's and attention's too) that much slower,
    one rank alone not at all."""
    alone = [{"m": 64, "k": 64, "n": 64, "dtype": "float32", "seconds": 1.0},
             {"m": 256, "k": 128, "n": 128, "dtype": "float32", "seconds": 2.0},
             {"m": 512, "k": 256, "n": 256, "dtype": "float32", "seconds": 4.0}]
    together = [dict(r, seconds=r["seconds"] / f) for r, f in zip(alone, (0.9, 0.8, 1.1))]
    assert fit_concurrent(alone, together) == pytest.approx(0.9)
    assert fit_concurrent(alone, [dict(r, seconds=r["seconds"] / 2) for r in alone]) == 1.0
    assert fit_concurrent(alone, None) == 1.0
    path, prof = tmp_path / "p.json", _profile()
    flags = ("--layout", "dp=2", "--zero", "0")
    base2, base1 = (_plan_json(path, prof, "--gpus", g, *flags[:1], f"dp={g}", *flags[2:])
                    for g in ("2", "1"))
    prof["fit"]["concurrent_gemm"] = 0.5
    slow2, slow1 = (_plan_json(path, prof, "--gpus", g, *flags[:1], f"dp={g}", *flags[2:])
                    for g in ("2", "1"))
    assert slow1["time_breakdown_s"] == base1["time_breakdown_s"]  # one rank: alone
    assert slow2["time_breakdown_s"]["compute"] > base2["time_breakdown_s"]["compute"]
    assert slow2["mfu"] < base2["mfu"]  # slower step, the same peak
