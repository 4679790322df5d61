"""A plan's step time as a range: the held-out errors of published runs like it
(plait/plan/error_band.py), the data file against benchmarks/plan_gpu_error.py, and the
line `plait plan` prints."""

import json
import sys
from pathlib import Path

import pytest
from helpers import plan_cli as plan

from plait.plan import error_band
from plait.plan.gpu_data import family_of

ROOT = Path(__file__).resolve().parents[1]
RUNS = [{"family": "h100", "gpus": 8, "stack": "fused", "error": -0.2},
        {"family": "h100", "gpus": 8, "stack": "fused", "error": 0.1},
        {"family": "h100", "gpus": 512, "stack": "fused", "error": 0.05},
        {"family": "h100", "gpus": 8, "stack": "eager", "error": -0.15},
        {"family": "h100", "gpus": 64, "stack": "eager", "error": -0.17},
        {"family": "a100", "gpus": 64, "stack": "fused", "error": -0.1}]


def test_band_takes_the_runs_of_the_same_stack_and_scale():
    band = error_band.band_of("h100", 8, "fused", RUNS)
    assert band.like == "fused stack, one node" and band.errors == (-0.2, 0.1)
    assert band.largest_gpus == 512
    # measured = predicted / (1 + error): a run 20 % too fast measured 1.25 x the
    # prediction, one 10 % too slow 1 / 1.1 x
    assert band.measured_range(1.0) == pytest.approx((1 / 1.1, 1.25))
    assert band.mean_abs == pytest.approx(0.15)


def test_band_falls_back_where_a_class_has_one_run():
    band = error_band.band_of("h100", 256, "fused", RUNS)
    assert band.like == "fused stack, every scale" and sorted(band.errors) == [-0.2, 0.05, 0.1]
    band = error_band.band_of("h100", 8, "eager", RUNS)  # one eager run on one node
    assert band.like == "eager stack, every scale" and band.errors == (-0.15, -0.17)
    band = error_band.band_of("a100", 8, "eager", RUNS)  # one a100 run in all
    assert band.like == "every stack and scale" and band.errors == (-0.1,)
    assert error_band.band_of("b200", 8, "fused", RUNS) is None


def test_lines_flag_an_untested_gpu_and_scale():
    (line,) = error_band.range_lines(2.0, "h100", 8, "fused", RUNS)
    assert line.startswith("Step time 2.000 s; runs like this one measured 1.818-2.500 s")
    assert "-20.0 % to +10.0 %" in line
    assert "2 published H100 runs like it (fused stack, one node;" in line
    lines = error_band.range_lines(2.0, "h100", 1024, "fused", RUNS)
    assert lines[-1].startswith("UNTESTED SCALE: 1,024 GPUs, beyond the largest scored H100 "
                                "run (512)")
    (untested,) = error_band.range_lines(2.0, "b200", 8, "fused", RUNS)
    assert untested.startswith("UNTESTED: step time 2.000 s with no measured error")


def test_terms_name_each_split_the_schedule_when_pipelined_and_the_rest():
    assert error_band.terms_of({"tp": 8, "pp": 4, "dp": 2}, "zb-v", 1, "full", True) == [
        "tensor parallel", "pipeline parallel", "the zb-v schedule", "ZeRO-1",
        "recompute full", "routed experts"]
    assert error_band.terms_of({"tp": 1, "pp": 1, "dp": 8}, "zb-v", 3, "none", False) == [
        "ZeRO-3", "recompute none"]


def test_untested_terms_are_those_no_scored_run_used():
    runs = [{"terms": ["tensor parallel", "ZeRO-1", "recompute none"]},
            {"terms": ["ZeRO-3", "recompute full"]}]
    assert error_band.untested_lines(["tensor parallel", "ZeRO-3", "recompute full"],
                                     runs) == []
    (line,) = error_band.untested_lines(["pipeline parallel", "the 1f1b schedule", "ZeRO-1",
                                         "recompute none"], runs)
    assert line.startswith("UNTESTED TERMS: no scored run used pipeline parallel, the 1f1b "
                           "schedule; the step time prices them")


def _script():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_gpu_error
    return plan_gpu_error


def test_data_file_names_the_scripts_runs():
    """Every run the range reads is one of the error script's, with its family and size."""
    cases = _script().cases()
    runs = error_band.load()["runs"]
    assert [(r["name"], r["family"], r["gpus"], r["stack"], r["terms"]) for r in runs] == [
        (c.name, family_of(c.cluster.gpu.name), c.cluster.n_gpus,
         error_band.stack_of(c.train.stack.fused_kernels),
         error_band.terms_of(c.layout.sizes, c.layout.schedule, c.layout.zero,
                             c.layout.recompute, bool(c.shape.moe))) for c in cases]


@pytest.mark.slow
def test_data_file_holds_the_scripts_held_out_errors():
    """The errors are what benchmarks/plan_gpu_error.py --write-bands measures now."""
    script = _script()
    cases = script.cases()
    _, _, held = script.rate_tables(cases)
    written = json.loads(json.dumps(script.bands(cases, held)))
    assert written == error_band.load(), (
        "plait/plan/data/step_time_error.json is stale (a prediction moved): run "
        "python benchmarks/plan_gpu_error.py --write-bands")


def test_plan_prints_the_range_on_the_published_numbers_only():
    base = ("--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--global-batch", "16",
            "--layout", "dp=8", "--microbatch", "2", "--zero", "3")
    rc, out = plan(*base, "--json")
    assert rc == 0
    doc = json.loads(out)
    step = doc["layouts"][0]["step_time_s"]
    (line,) = [x for x in doc["explanation"] if x.startswith("Step time")]
    band = error_band.band_of("h100", 8, "fused")
    lo, hi = band.measured_range(step)
    assert line.startswith(f"Step time {step:.3f} s; runs like this one measured "
                           f"{lo:.3f}-{hi:.3f} s")
    rc, out = plan(*base, "--json", "--fused-kernels", "no")  # the eager runs' errors
    doc = json.loads(out)
    (line,) = [x for x in doc["explanation"] if x.startswith("Step time")]
    lo, hi = error_band.band_of("h100", 8, "eager").measured_range(
        doc["layouts"][0]["step_time_s"])
    assert f"measured {lo:.3f}-{hi:.3f} s" in line and "(eager stack, one node;" in line
    assert not [x for x in doc["explanation"] if x.startswith("UNTESTED TERMS")]
    rc, out = plan(*base[:-1], "2", "--json")  # ZeRO-2: no scored run used it
    flags = [x for x in json.loads(out)["explanation"] if x.startswith("UNTESTED TERMS")]
    assert [x.split(";")[0] for x in flags] == ["UNTESTED TERMS: no scored run used ZeRO-2"]
    rc, out = plan(*base, "--json", "--efficiency", "fitted")
    assert rc == 0
    assert not [x for x in json.loads(out)["explanation"] if x.startswith("Step time")]
