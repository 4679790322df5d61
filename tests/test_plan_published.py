"""The planner's published GPU numbers (plait/plan/gpu_data.py), the stack knobs
(plait/plan/stack.py), the plausibility flag and --explain (plait/plan/trust.py,
explain_terms.py)."""

import argparse
import io
import json

import pytest

from plait.plan.cli import add_parser, run
from plait.plan.gpu_data import load, published
from plait.plan.hardware import GPUS


def plan(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="plait")
    add_parser(parser.add_subparsers(dest="cmd"))
    out = io.StringIO()
    return run(parser.parse_args(["plan", *argv]), out=out), out.getvalue()


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
