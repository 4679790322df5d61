"""`plait plan` through run(): one layout, search, JSON, plot, bad input."""

import argparse
import json

import pytest
from helpers import plan_cli as plan

from plait.model.presets import PRESETS
from plait.plan.cli import add_parser
from plait.plan.gpu_data import published
from plait.plan.hardware import GPUS

BASE = ("--model", "llama3-70b", "--gpu", "h100-sxm", "--gpus", "1024", "--global-batch",
        "1024")


def test_layout_json():
    rc, out = plan(*BASE, "--layout", "tp=8,pp=8,dp=16", "--microbatch", "1", "--schedule",
                   "interleaved", "--virtual-stages", "2", "--recompute", "selective", "--json")
    assert rc == 0
    doc = json.loads(out)
    lay = doc["layouts"][0]
    assert lay["layout"] == {"tp": 8, "pp": 8, "dp": 16, "cp": 1, "ep": 1, "dp_replicate": 1}
    assert lay["microbatches"] == 64 and lay["schedule"] == "interleaved"
    mem = lay["memory_bytes"]
    assert set(mem) >= {"parameters", "gradients", "optimizer states", "activations",
                        "communication buffers"}
    # recomputed from the preset's shape, not from the planner's own total: the first rank
    # holds the embedding and 80 / pp = 10 layers (two interleaved chunks of 5), each split
    # over tp = 8 but for the two norm gains, whole on every tp rank; in bf16 (2 bytes);
    # bf16 gradients the same; ZeRO-1 shards the fp32 master + Adam moments (12 bytes)
    # over dp = 16.
    shape = PRESETS["llama3-70b"]
    h, kv = shape.dim, shape.n_kv_heads * shape.head_dim
    layer = (2 * h * h + 2 * h * kv + 3 * h * shape.ffn_dim) / 8 + 2 * h
    first_rank = shape.n_layers // 8 * layer + shape.vocab_size * h / 8
    assert mem["parameters"] == pytest.approx(2 * first_rank, rel=1e-12)
    assert mem["gradients"] == pytest.approx(2 * first_rank, rel=1e-4)
    assert mem["optimizer states"] == pytest.approx(12 * first_rank / 16, rel=1e-4)
    assert lay["memory_peak_rank"] == "first"
    assert lay["memory_total_bytes"] >= sum(mem[k] for k in ("parameters", "gradients",
                                                             "optimizer states"))
    assert sum(lay["time_breakdown_s"].values()) == pytest.approx(lay["step_time_s"], rel=1e-6)
    dims = {c["dim"] for c in lay["collectives"]}
    assert dims == {"tp", "pp", "dp"}
    tp = next(c for c in lay["collectives"] if c["dim"] == "tp")
    assert tp["link"] == "nvlink" and tp["group"] == 8
    assert 0 < lay["mfu"] < 1 and lay["hardware_tflops_per_gpu"] >= lay["model_tflops_per_gpu"]


def test_search_table_and_words(tmp_path):
    png = tmp_path / "mem.png"
    rc, out = plan(*BASE, "--top", "3", "--plot", str(png))
    assert rc == 0
    assert "layouts considered" in out and "Best:" in out and "Fit first" in out
    assert "step time" in out and "collectives per step" in out
    assert png.stat().st_size > 1000


def test_search_json():
    rc, out = plan(*BASE, "--top", "2", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["layouts_considered"] > 0 and len(doc["layouts"]) == 2
    assert doc["layouts"][0]["step_time_s"] <= doc["layouts"][1]["step_time_s"]


def test_explicit_shape_flags():
    rc, out = plan("--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "32000",
                   "--seq", "4096", "--gpus", "8", "--global-batch-tokens", str(64 * 4096),
                   "--layout", "tp=8,pp=1,dp=1", "--json")
    lay = json.loads(out)["layouts"][0]
    assert rc == 0 and lay["microbatches"] == 64


def test_unknown_preset_lists_known():
    rc, out = plan("--model", "gpt5", "--gpus", "8", "--global-batch", "8")
    assert rc == 2 and "unknown model preset 'gpt5'" in out and "llama3-405b" in out


def test_unknown_gpu_lists_known():
    rc, out = plan("--model", "tiny", "--gpu", "v100", "--gpus", "8", "--global-batch", "8")
    assert rc == 2 and "h100-sxm" in out


def test_layout_must_multiply_to_gpus():
    rc, out = plan(*BASE, "--layout", "tp=8,pp=8,dp=8")
    assert rc == 2 and "does not multiply to the GPU count 1024" in out


def test_model_that_fits_nowhere():
    rc, out = plan("--model", "llama3-405b", "--gpu", "a100-40gb", "--gpus", "8",
                   "--global-batch", "8")
    assert rc == 2 and "no layout fits" in out and "GB over" in out
    assert "largest term is" in out


def test_layout_that_does_not_fit_says_so():
    rc, out = plan("--model", "llama3-70b", "--gpus", "8", "--global-batch", "8",
                   "--layout", "tp=8,pp=1,dp=1", "--zero", "0")
    assert rc == 0 and "does NOT fit: this layout needs" in out
    assert "Add GPUs" in out and "within the device" not in out


def test_layout_short_of_headroom_only_says_a_run_may_fit():
    """Over the usable 90 % but within the device's HBM: the headroom is what is short,
    and the --mem-limit that plans it is named (the margin is the planner's choice, not a
    measured need)."""
    base = ("--model", "llama3-8b", "--seq", "8192", "--gpus", "2", "--global-batch", "8",
            "--layout", "tp=2", "--zero", "0", "--recompute", "selective")
    rc, out = plan(*base, "--json")
    need = json.loads(out)["layouts"][0]["memory_total_bytes"]
    hbm = published(GPUS["h100-sxm"]).gpu.hbm_bytes  # what the device reports
    assert 0.9 * hbm < need <= hbm, need / hbm  # the case this test is about
    rc, out = plan(*base)
    text = " ".join(out.split())
    assert rc == 0 and "does NOT fit: this layout needs" in text
    assert f"within the device's {hbm / 1e9:.1f} GB" in text
    assert f"--mem-limit {need / hbm + 0.005:.2f}" in text and "Add GPUs" not in text


def test_help_explains_attention_and_recompute_in_one_line_each():
    plan_parser = add_parser(argparse.ArgumentParser(prog="plait").add_subparsers())
    actions = {a.dest: a for a in plan_parser._actions}
    for dest, choices, default in (("attention", ("flash", "math"), "flash"),
                                   ("recompute", ("none", "selective", "full"), "none")):
        act = actions[dest]
        assert tuple(act.choices) == choices and act.default == default
        assert "\n" not in act.help and act.help.count(". ") == 0  # one line, one sentence
        assert all(c in act.help for c in choices) and "default" in act.help
    assert "log-sum-exp" in actions["attention"].help
    assert "probabilities" in actions["attention"].help
    assert "plait train" in actions["recompute"].help  # the runtime's list, its default


# the issue-20 example: a Llama 70B layout that fits with flash attention and no recompute
EXAMPLE = ("--model", "llama3-70b", "--gpu", "h100-sxm", "--gpus", "64", "--global-batch",
           "64", "--layout", "tp=8,pp=2,dp=4", "--json")


def test_recompute_none_fits_where_the_flash_model_says():
    from plait.plan.memory import layer_activations
    from plait.plan.shape import from_preset

    docs = {}
    for attention in ("flash", "math"):
        rc, out = plan(*EXAMPLE, "--recompute", "none", "--attention", attention)
        assert rc == 0, out
        docs[attention] = json.loads(out)
    flash, math = (docs[k]["layouts"][0] for k in ("flash", "math"))
    assert docs["flash"]["attention"]["kernel"] == "flash" and flash["attention"] == "flash"
    assert flash["recompute"] == "none" and math["attention"] == "math"
    # 1F1B at pp = 2: the first rank holds 2 micro-batches of its 40 layers in flight
    sh = from_preset("llama3-70b")
    per_layer = {k: float(layer_activations(sh, 1, 8, 1, True, "none", attention=k))
                 for k in ("flash", "math")}
    assert flash["memory_peak_rank"] == "first"
    assert flash["memory_bytes"]["activations"] == pytest.approx(2 * 40 * per_layer["flash"],
                                                                 rel=1e-12)
    assert flash["fits"] and flash["memory_total_bytes"] <= 0.9 * 80e9
    # the materialised probabilities (`--attention math`) do not fit
    assert math["memory_bytes"]["activations"] == pytest.approx(2 * 40 * per_layer["math"],
                                                                rel=1e-12)
    assert not math["fits"]
    assert flash["flops_per_step"]["hardware"] == flash["flops_per_step"]["model"]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_time_breakdown_sums_to_the_step(recompute):
    """Each mode's recomputation is in the breakdown once (the replayed tp collectives in
    "tp comm", the rest in "recompute"), so the terms add up to the step time."""
    rc, out = plan(*EXAMPLE, "--recompute", recompute)
    lay = json.loads(out)["layouts"][0]
    assert rc == 0 and lay["recompute"] == recompute
    assert sum(lay["time_breakdown_s"].values()) == pytest.approx(lay["step_time_s"], rel=1e-9)
    assert (lay["time_breakdown_s"]["recompute"] > 0) == (recompute != "none")


def test_plan_takes_train_names_for_sequence_and_micro_batches():
    layout = ("--layout", "tp=8,pp=8,dp=16", "--schedule", "1f1b", "--json")
    docs = [json.loads(plan(*BASE, *layout, *names)[1])["layouts"][0] for names in (
        ("--seq", "4096", "--microbatch", "2"),  # the planner's own names, kept as aliases
        ("--seq-len", "4096", "--micro-batch-size", "2"),  # plait train's
        ("--seq-len", "4096", "--microbatches", "32"))]  # train's count: 1024 / 16 / 32 = 2
    assert docs[0] == docs[1] == docs[2]
    assert docs[0]["microbatch"] == 2 and docs[0]["microbatches"] == 32
    rc, out = plan(*BASE, *layout, "--microbatches", "3")
    assert rc == 2 and "--microbatches 3" in out and "64 sequences per replica" in out


def test_plan_says_the_defaults_unlike_train():
    rc, out = plan("--model", "tiny", "--gpus", "2", "--global-batch", "8",
                   "--layout", "dp=2")
    assert rc == 0
    said = next(line for line in out.splitlines() if line.startswith("defaults unlike"))
    assert "--precision bf16 (plait train's: fp32)" in said
    assert "--zero 1 (plait train's: 0)" in said and "--seq-len" in said
    rc, out = plan("--model", "tiny", "--gpus", "2", "--global-batch", "8", "--layout",
                   "dp=2", "--precision", "fp32", "--zero", "0", "--seq-len", "64")
    assert rc == 0 and "defaults unlike" not in out


def test_a_tiny_model_reads_in_units_that_fit():
    rc, out = plan("--model", "tiny", "--gpus", "2", "--global-batch", "8")
    assert rc == 0
    assert "363 K params" in out and "0.00 B" not in out
    assert "TFLOP/s" in out and "MB" in out and "0.0 GB" not in out


def test_units_fit_the_size():
    from plait.plan.units import flops_rate, nbytes, params

    assert (params(405e9), params(1.62e6), params(512)) == ("405 B", "1.62 M", "512")
    assert (nbytes(61.2e9), nbytes(14.2e6), nbytes(0)) == ("61.2 GB", "14.2 MB", "0 B")
    assert (flops_rate(412e12), flops_rate(3.25e9)) == ("412 TFLOP/s", "3.25 GFLOP/s")
