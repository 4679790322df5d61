"""The planner's published GPU numbers (plait/plan/gpu_data.py), the stack knobs
(plait/plan/stack.py), the plausibility flag and --explain (plait/plan/trust.py,
explain_terms.py)."""

import json

import pytest
from helpers import plan_cli as plan

from plait.plan.gpu_data import load, published
from plait.plan.hardware import GPUS


def test_every_published_value_names_its_source():
    doc = load()
    for fam, entry in doc["gpus"].items():
        for key, value in entry.items():
            if key != "presets":
                assert len(value["source"]) > 20, (fam, key)
    covered = {p for e in doc["gpus"].values() for p in e["presets"]}
    assert covered == set(GPUS)
    pub = published(GPUS["h100-sxm"])
    assert pub.gpu.nvlink_bw == 370e9 and pub.eff.link_efficiency == 1.0
    assert pub.gpu.hbm_bytes == pytest.approx(79.11 * 2**30, rel=1e-4)


def test_training_rate_scales_every_kernel_rate_and_nothing_else():
    """The data file's kernel_rate_in_training multiplies the isolated GEMM ceilings (bf16,
    float8), the attention sweep and the streaming-copy bandwidth; links, memory and the
    GEMM half point stay; rate 1 is the isolated numbers, and a lower rate a longer step;
    the plan prints the rate with its source and the isolated ceiling with its own."""
    from plait.plan.basis import Layout, Training
    from plait.plan.estimate import evaluate
    from plait.plan.hardware import Cluster
    from plait.plan.shape import from_preset

    pub, iso = published(GPUS["h100-sxm"]), published(GPUS["h100-sxm"], rate=1.0)
    rate = load()["kernel_rate_in_training"]["value"]
    assert pub.training_rate == rate and 0.5 < rate < 1.0 and iso.training_rate == 1.0
    assert pub.eff.gemm_max == pytest.approx(rate * iso.eff.gemm_max, rel=1e-12)
    assert pub.eff.fp8_gemm_max == pytest.approx(rate * iso.eff.fp8_gemm_max, rel=1e-12)
    assert pub.eff.hbm_fraction == pytest.approx(rate * iso.eff.hbm_fraction, rel=1e-12)
    assert [f for _, f in pub.eff.attention_curve] == pytest.approx(
        [rate * f for _, f in iso.eff.attention_curve], rel=1e-12)
    assert pub.gpu == iso.gpu and pub.eff.gemm_half == iso.eff.gemm_half
    s, lay = from_preset("llama3-8b", 8192), Layout(dp=8, mbs=1, zero=1)
    steps = [float(evaluate(s, Cluster(p.gpu, 8), Training(8), lay, p.eff).step_time)
             for p in (pub, iso)]
    assert steps[0] > steps[1]
    rc, out = plan("--model", "llama3-8b", "--gpus", "8", "--global-batch", "8",
                   "--layout", "dp=8")
    text = " ".join(out.split())
    assert rc == 0 and f"Kernels in a training step at {rate:.1%} of the isolated" in text
    assert f"GEMM ceiling {iso.eff.gemm_max:.1%} of peak, half" in text


LLAMA405 = ("--model", "llama3-405b", "--gpus", "8192", "--global-batch", "2048",
            "--seq-len", "8192", "--layout", "tp=8,pp=16,dp=64", "--json")


def test_llama3_405b_8k_layout_fits_with_its_uneven_stages():
    rc, out = plan(*LLAMA405, "--first-stage-layers", "7", "--last-stage-layers", "7")
    assert rc == 0, out
    lay = json.loads(out)["layouts"][0]
    assert lay["fits"]
    _, even = plan(*LLAMA405)
    even_lay = json.loads(even)["layouts"][0]
    assert not even_lay["fits"]  # an even split: 8 layers on the first rank
    ratio = lay["memory_bytes"]["activations"] / even_lay["memory_bytes"]["activations"]
    assert ratio == pytest.approx(7 / 8)
    rc, out = plan(*LLAMA405, "--first-stage-layers", "100", "--last-stage-layers", "100")
    assert rc == 2 and "cannot be split" in out


def test_dp_and_pp_overlap_knobs():
    base = ("--model", "llama3-8b", "--gpus", "64", "--global-batch", "256", "--json",
            "--layout", "tp=2,pp=4,dp=8", "--schedule", "interleaved", "--virtual-stages", "2")
    step = {}
    for knobs in ((), ("--dp-overlap", "no"), ("--pp-overlap", "no")):
        rc, out = plan(*base, *knobs)
        assert rc == 0, out
        lay = json.loads(out)["layouts"][0]
        step[knobs] = lay["step_time_s"]
        if knobs == ("--dp-overlap", "no"):  # nothing hides the reduction
            dp = [c for c in lay["collectives"] if c["dim"] == "dp"]
            assert sum(c["exposed_s"] for c in dp) == pytest.approx(
                sum(c["total_s"] for c in dp))
    assert step[("--dp-overlap", "no")] > step[()]
    assert step[("--pp-overlap", "no")] > step[()]


def test_implausible_mfu_is_flagged_and_explain_shows_terms():
    rc, out = plan("--model", "llama3-8b", "--gpus", "8", "--global-batch", "64", "--layout",
                   "dp=8", "--explain")
    assert rc == 0, out
    text = " ".join(out.split())
    assert "CHECK: predicted MFU" in text and "llm-foundry" in text
    assert "NCCL bus bandwidth 370 GB/s" in text and "nccl-tests issue #212" in text
    assert "Why tp=1,pp=1,dp=8 takes" in text and "mlp gate+up" in text
    rc, out = plan("--model", "llama3-8b", "--gpus", "8", "--global-batch", "64", "--layout",
                   "dp=8", "--efficiency", "fitted")
    assert rc == 0 and "--efficiency fitted" in " ".join(out.split())
