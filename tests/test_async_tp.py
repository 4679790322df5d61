"""Async tensor parallel (plait/parallel/async_tp.py): parity with the single-process run
and the ledger's bytes equal to plain tp + SP's (the planner's, which knows no async),
in one launch that meets ZeRO-3, a pipeline whose backward is split into I and W, and
full recomputation; and the settings it refuses."""

import pytest
from helpers import config, reference, run_layout
from matrix import parse

from plait.config import load_config
from plait.ledger import data_bytes_by_dim
from plait.plan import rank_collectives
from plait.plan.comm.rank import bytes_by_dim
from plait.testing import assert_parity, merge_ranks

# 8 ranks: dp2 x tp2 x pp2; zb-h1 splits each backward into I and W; rc recomputes each
# block (its forward's rings run again in backward, as plain SP's collectives do)
ROW = "dp2 z3 tp2 sp pp2:zb-h1 rc"
STEPS = 3


def _sets() -> tuple[str, ...]:
    return (*parse(ROW)["sets"], "parallel.async_tp=true", f"train.steps={STEPS}")


@pytest.mark.slow  # 8 ranks; the matrix's `atp` rows prove parity and bytes in the fast tier
def test_parity_and_ledger_bytes_with_zero3_split_backward_and_recompute():
    outs = run_layout(*_sets())
    assert_parity(merge_ranks(outs), reference(*parse(ROW)["model"], f"train.steps={STEPS}"),
                  "fp64")
    cfg = config(*_sets())
    stride = cfg.parallel.tp * cfg.parallel.cp  # mesh order tp, cp, pp, dp
    for rank, out in enumerate(outs):
        step1 = [r for r in out["ledger"] if r["step"] == 1]
        own = bytes_by_dim(rank_collectives(cfg, (rank // stride) % cfg.parallel.pp), 1)
        assert data_bytes_by_dim(step1)["tp"] == pytest.approx(own["tp"], rel=1e-12), rank
        tp = [r for r in step1 if r["tag"].startswith(("tp.layers.", "tp.head."))]
        # each ring is recorded as the collective it replaces, and what the rank waited
        # for lies inside the ring's span
        assert {r["op"] for r in tp} == {"all_gather", "reduce_scatter"}
        assert all(0 <= r["blocked"] <= r["end"] - r["start"] + 1e-9 for r in tp)


@pytest.mark.parametrize("sets, words", [
    (("parallel.tp=2", "parallel.async_tp=true"), "--sp"),
    (("parallel.async_tp=true",), "--tp > 1"),
])
def test_refused_without_sequence_parallel(sets, words):
    problems = load_config(sets=list(sets)).validate()
    assert any("async_tp" in p and words in p for p in problems), problems


def test_planner_hides_tp_time_behind_the_rings_matmuls_with_the_same_bytes():
    from plait.plan import estimate_config
    from plait.plan.comm.async_tp import async_tp_exposed

    def estimate(async_tp: bool):
        return estimate_config(load_config(overrides={"model_name": "llama3-8b"}, sets=[
            "parallel.tp=8", "parallel.sp=true", f"parallel.async_tp={async_tp}".lower(),
            "train.seq_len=8192", "train.global_batch=8", "train.precision=bf16"]))

    plain, overlapped = estimate(False), estimate(True)
    assert overlapped.time["tp comm (exposed)"] < plain.time["tp comm (exposed)"]
    assert overlapped.step_time < plain.step_time
    assert bytes_by_dim(overlapped.collectives, 1) == bytes_by_dim(plain.collectives, 1)
    # t - 1 of t chunks of half a layer's GEMMs beside each pair; the rest stays exposed
    assert async_tp_exposed(1.0, 1.0, 4, 1.0) == pytest.approx(1.0 - 0.5 * 3 / 4)
    assert async_tp_exposed(1.0, 8.0, 8, 1.0) == 0.0


def test_plan_flag_evaluates_one_layout_and_searches_with_the_rings():
    """`plait plan --async-tp`: the --layout it evaluates is that layout with async TP on
    the published numbers, faster than without; the search's layouts all carry it, and
    --no-sp beside it is refused before anything is computed."""
    import json

    from helpers import plan_cli as plan

    base = ("--model", "llama3-8b", "--seq", "8192", "--gpus", "8", "--global-batch", "8",
            "--zero", "0", "--json")
    steps = {}
    for flag in ((), ("--async-tp",)):
        rc, out = plan(*base, "--layout", "tp=8", *flag)
        assert rc == 0, out
        steps[flag] = json.loads(out)["layouts"][0]["step_time_s"]
    from plait.plan.basis import Layout, Training
    from plait.plan.estimate import evaluate
    from plait.plan.gpu_data import published
    from plait.plan.hardware import GPUS, Cluster
    from plait.plan.shape import from_preset

    pub = published(GPUS["h100-sxm"])
    want = evaluate(from_preset("llama3-8b", 8192), Cluster(pub.gpu, 8), Training(8),
                    Layout(tp=8, mbs=1, zero=0, async_tp=True), pub.eff)
    assert steps[("--async-tp",)] == pytest.approx(float(want.step_time), rel=1e-9)
    assert steps[("--async-tp",)] < steps[()]
    rc, out = plan(*base, "--top", "3", "--async-tp")
    assert rc == 0 and all(lay["async_tp"] for lay in json.loads(out)["layouts"]), out
    rc, out = plan(*base[:-3], "--top", "3", "--async-tp", "--layout", "tp=8", "--no-sp")
    assert rc == 2 and "--async-tp overlaps sequence parallel's" in out, out
