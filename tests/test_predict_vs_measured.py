"""Predicted memory (plait/plan, kernels="eager") equals the runtime's measured peak.

For CPU layouts the runtime can run, the planner's prediction of the peak live
bytes per rank, and of each category at that peak, is within 5 % of what MemoryTracker
measures during `train.memory_step`. One cost model: the prediction is
`plait.plan.predict_memory(cfg, kernels="eager")`, the same code `plait report` prints.
"""

import pytest
from helpers import assert_ranks_memory_match, config, data_windows, run_layout, token_file

from plait.plan import predict_memory

# fp32 unless a layout says bf16 (its setting comes later and wins): the eager model prices
# fp32 and bf16 runs, not the float64 of tests/helpers.py's BASE
FP32 = "train.precision=fp32"
MEASURE = ["train.memory_step=1", "train.steps=2"]
# the loader's permutation is passed in (data_windows); nothing else is left out

LAYOUTS = {
    "single fp32": [],
    "dp2 zero0 bf16 recompute": ["parallel.dp=2", "train.precision=bf16",
                                 "train.recompute=full"],
    "dp4 zero0 fp32": ["parallel.dp=4"],
    "dp4 zero1 bf16": ["parallel.dp=4", "parallel.zero=1", "train.precision=bf16"],
    "dp2 zero1 fp32 m2": ["parallel.dp=2", "parallel.zero=1", "parallel.microbatches=2"],
    "dp4 zero2 fp32": ["parallel.dp=4", "parallel.zero=2"],
    "dp2 zero2 bf16 m2": ["parallel.dp=2", "parallel.zero=2", "train.precision=bf16",
                          "parallel.microbatches=2"],
    # ZeRO-1/2 units of several modules (parallel.bucket_mb): [embed, block 0], [blocks 1,
    # 2], [block 3, norm, head]; above, the tiny model is one unit
    "dp2 zero2 fp32 m2 units": ["parallel.dp=2", "parallel.zero=2", "parallel.microbatches=2",
                                "model.n_layers=4", "parallel.bucket_mb=0.25"],
    "dp2 zero1 bf16 units": ["parallel.dp=2", "parallel.zero=1", "train.precision=bf16",
                             "model.n_layers=4", "parallel.bucket_mb=0.125"],
    "dp4 zero3 fp32": ["parallel.dp=4", "parallel.zero=3"],
    "dp2 zero3 bf16 m2 recompute": ["parallel.dp=2", "parallel.zero=3", "train.precision=bf16",
                                    "parallel.microbatches=2", "train.recompute=full"],
    # hybrid sharding: ZeRO over shard groups of 2 ranks, the shards' copies in the other
    "dp2x2 zero1 bf16": ["parallel.dp_shard=2", "parallel.dp_replicate=2", "parallel.zero=1",
                         "train.precision=bf16"],
    "dp2x2 zero3 fp32 m2": ["parallel.dp_shard=2", "parallel.dp_replicate=2",
                            "parallel.zero=3", "parallel.microbatches=2"],
    "tp2": ["parallel.tp=2"],
    "tp2 sp bf16": ["parallel.tp=2", "parallel.sp=true", "train.precision=bf16"],
    "tp2 sp recompute": ["parallel.tp=2", "parallel.sp=true", "train.recompute=full"],
    "tp2 sp selective": ["parallel.tp=2", "parallel.sp=true", "train.recompute=selective"],
    "dp2 zero1 bf16 m2 selective": ["parallel.dp=2", "parallel.zero=1", "train.precision=bf16",
                                    "parallel.microbatches=2", "train.recompute=selective"],
    "pp2 1f1b small m4": ["model_name=small", "model.vocab_size=256", "parallel.pp=2",
                          "parallel.microbatches=4"],
    "pp2 gpipe bf16": ["parallel.pp=2", "parallel.schedule=gpipe", "train.precision=bf16"],
    # 3-D: tp inside pipeline stages (receive buffers are (mbs, seq/t, dim) under SP)
    "pp2 tp2 m4": ["model.n_layers=4", "parallel.pp=2", "parallel.tp=2",
                   "parallel.microbatches=4"],
    "pp2 tp4 sp gqa recompute m4": ["model.n_layers=4", "parallel.pp=2", "parallel.tp=4",
                                    "parallel.sp=true", "model.n_kv_heads=2",
                                    "train.recompute=full", "parallel.microbatches=4"],
    "pp2 1f1b selective m4": ["model.n_layers=4", "parallel.pp=2", "parallel.microbatches=4",
                              "train.recompute=selective"],
}


# the pipelines are in the slow tier; the dp, ZeRO, hybrid and tp layouts hold the eager
# model in the fast one
PIPELINES = {n for n in LAYOUTS if n.startswith("pp2")}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] * (n in PIPELINES))
                                  for n in LAYOUTS])
def test_predicted_peak_equals_measured(name):
    sets = [FP32, *LAYOUTS[name], *MEASURE]
    cfg = config(*sets)
    outs = run_layout(*sets)
    assert_ranks_memory_match(outs, cfg, name)
    # predict_memory(kernels="eager") is the most loaded rank's
    top = max(o["metrics"][1]["memory"]["peak_total"] for o in outs)
    assert predict_memory(cfg, "eager", data_windows(cfg))["total"] == pytest.approx(top, rel=0.05)


def test_plait_report_on_a_metrics_file(tmp_path, capsys):
    import json

    from plait.cli.main import main

    sets = [FP32, "parallel.dp=2", "parallel.zero=1", f"train.data={token_file()}", *MEASURE]
    out = run_layout(*sets)[0]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*out["metrics"], out["summary"]]))
    assert main(["report", "--metrics", str(path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    cats = {c["category"]: c for c in rep["memory"]["categories"]}
    assert cats["total (peak)"]["ratio"] == pytest.approx(1.0, abs=0.05)
    assert cats["params"]["ratio"] == pytest.approx(1.0, abs=0.05)
    dp = next(d for d in rep["communication"] if d["dim"] == "dp")
    assert dp["ratio"] == pytest.approx(1.0, abs=0.05)  # reduce-scatter + all-gather bytes
    # overlap: ZeRO-1's reduce-scatters are async (partly hidden), measured as the ledger
    assert 0 < dp["measured_exposed_share"] <= 1 and 0 <= dp["predicted_exposed_share"] <= 1
    ledger = out["summary"]["ledger"]["overlap_per_step"]["dp"]
    assert dp["measured_exposed_s"] == ledger["exposed"]
    assert main(["report", "--metrics", str(path)]) == 0  # the rich tables
    text = capsys.readouterr().out
    assert "predicted" in text and "all_gather" in text and "exposed share" in text


def test_plait_report_matches_every_collective_under_context_parallel(tmp_path, capsys):
    """dp2 x cp2 with ZeRO-1: the gradients' reduce-scatter and the parameters' all-gather
    run over the dp x cp ranks, which the ledger and the planner both name "dp_cp": every
    dim the planner prices has the ledger's bytes beside it, at a ratio of 1, and every
    dim with more than control bytes in the ledger has a prediction."""
    import json

    from plait.cli.main import main

    sets = [FP32, "parallel.dp=2", "parallel.cp=2", "parallel.zero=1",
            f"train.data={token_file()}", *MEASURE]
    out = run_layout(*sets)[0]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*out["metrics"], out["summary"]]))
    assert main(["report", "--metrics", str(path), "--json"]) == 0
    dims = {d["dim"]: d for d in json.loads(capsys.readouterr().out)["communication"]}
    assert dims["dp_cp"]["predicted_bytes"] > 0 and "dp" not in {
        d for d, row in dims.items() if row["predicted_bytes"]}
    for dim, row in dims.items():
        if row["predicted_bytes"] or row["measured_bytes"] > 1024:  # beyond control bytes
            assert row["ratio"] == pytest.approx(1.0, abs=0.01), (dim, row)


@pytest.mark.parametrize("sets", [["parallel.schedule=zb-h1"], ["parallel.zero=1",
                                                               "parallel.dp=2"]])
def test_eager_model_refuses_layouts_it_does_not_cover(sets):
    cfg = config("model.n_layers=4", "parallel.pp=2", "parallel.tp=2",
                 "parallel.microbatches=4", *sets)
    with pytest.raises(ValueError, match="does not cover"):
        predict_memory(cfg, "eager")


def test_zero3_gathered_for_the_step_is_the_closed_forms_only():
    """ZeRO-3 keeping its units gathered through the step: the eager model refuses it
    (it frees each unit after use); the closed form holds the whole parameters beside
    their shards, the step's gathered copy on top of ZeRO-3's 1/N."""
    sets = [FP32, "parallel.dp=4", "parallel.zero=3", "model.tie_embeddings=false"]
    step = config(*sets, "parallel.zero3_gather=step")
    with pytest.raises(ValueError, match="zero3_gather=step"):
        predict_memory(step, "eager")
    shards = predict_memory(config(*sets))["parameters"]
    assert predict_memory(step)["parameters"] == pytest.approx(5 * shards)  # 1/4 + 1
