"""Dry run: one rank of a layout, alone on the fake process group, holds and issues exactly
what that rank of a real run does (memory by category to the byte, ledger payloads)."""

import multiprocessing as mp
import traceback

import pytest
import torch
from helpers import batches_for, config, run_layout, shared_run, token_file

from plait.observe.dry_run import TABLE_ROWS, dry_run

STEADY = 1  # the real run's step measured: a later step holds what every later one does
# fp32: the eager memory model prices fp32 and bf16 runs (tests/helpers.py's BASE is fp64)
FP32 = "train.precision=fp32"
LAYOUT = [FP32, "parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2",
          "train.steps=2", f"train.memory_step={STEADY}"]


def _child(sets, world, rank, q):
    torch.set_num_threads(1)
    try:
        cfg = config(*sets).check(world)
        q.put(("ok", dry_run(cfg, world, rank, batches_for(cfg))))
    except BaseException:  # noqa: BLE001 - the parent reports it
        q.put(("error", traceback.format_exc()))


def _dry(sets, world, rank):
    """A dry run in a process of its own (the fake process group is per process)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(list(sets), world, rank, q))
    p.start()
    try:
        status, out = q.get(timeout=300)
    finally:  # the child never outlives the test, whether it reported or not
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
    assert status == "ok", out
    return out


def _payload(ledger, step):
    out = {}
    for r in ledger:
        if r["step"] == step:
            out[r["dim"]] = out.get(r["dim"], 0.0) + r["payload"]
    return out


@pytest.fixture(scope="module")
def real():
    return run_layout(*LAYOUT)


@pytest.mark.parametrize("rank", [0, 7])  # first and last pipeline rank
def test_dry_run_rank_equals_the_real_rank(real, rank):
    dry = _dry(LAYOUT, 8, rank)
    assert dry["coords"]["pp"] == rank // 4 and dry["world_size"] == 8
    # ZeRO 0: the dry run runs and measures step 0 only (`measure_step`), which holds
    # what the real rank's later steps hold
    assert dry["measured_step"] == 0
    measured = real[rank]["metrics"][STEADY]["memory"]
    assert dry["memory"]["peak"] == measured["peak"]  # every category, to the byte
    assert dry["memory"]["peak_total"] == measured["peak_total"]
    assert dry["bytes_per_step"] == _payload(real[rank]["ledger"], STEADY)
    # the data collectives' bytes are this pipeline rank's own in the planner, exactly
    assert dry["data_bytes_per_step"] == pytest.approx(dry["predicted_bytes_per_step"],
                                                       rel=1e-12, abs=0.5)
    # the eager model covers this layout: its prediction for the rank is within 5 %
    pred = dry["predicted_memory"]
    assert pred["total"] == pytest.approx(dry["memory"]["peak_total"], rel=0.05)


@pytest.mark.parametrize("sets", [["parallel.dp=2", "parallel.zero=1"],
                                  ["parallel.tp=2", "parallel.sp=true"], LAYOUT])
def test_dry_run_and_report_print_one_prediction(sets):
    """The dry run's predicted memory for rank 0 is `plait report`'s for the same run, every
    category: a dry run's config names no token file (the command line gives it beside the
    config, as with the default corpus), and the loader's epoch permutation is priced
    from the file the loader reads, as the report prices it from the run's train.data."""
    from plait.observe.report import compare

    sets = [FP32, *sets]
    cfg = config(*sets)
    world = cfg.parallel.world_size
    assert cfg.train.data is None
    dry = _dry(sets, world, 0)
    rows = [{"step": dry["measured_step"], "memory": dry["memory"]}]
    rep = compare(rows, {}, config(*sets, f"train.data={token_file()}"))
    predicted = {c["category"]: c["predicted"] for c in rep["memory"]["categories"]}
    mine = dry["predicted_memory"]
    assert predicted.pop("total (peak)") == mine["total"]
    assert predicted == {cat: sum(mine[n] for n in names) for cat, names in TABLE_ROWS.items()}


# llama3-8b's proportions at tp=8, pp=4 scaled down 16x (dim / tokens = 4, ffn = 3.5 dim,
# 8 heads of 8 KV): a tp-sliced weight gradient is large beside a micro-batch's
# activations, so the first stage's peak is its first backward's MLP norm backward, with
# the MLP's three weight gradients new (benchmarks/dry_run.py's rank 0; the eager model
# had put it at w2's backward, 67 % short on gradients)
SCALED_8B = [FP32, "parallel.dp=32", "parallel.tp=8", "parallel.pp=4",
             "parallel.microbatches=4",
             "model.dim=256", "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_dim=896",
             "model.n_layers=4", "train.seq_len=64", "train.global_batch=128"]


@pytest.mark.parametrize("rank", [0, 1023])
def test_dry_run_of_a_1024_rank_layout_builds_one_rank(rank):
    dry = _dry(SCALED_8B, 1024, rank)
    coords = ({"tp": 7, "cp": 0, "pp": 3, "dp": 31} if rank
              else {"tp": 0, "cp": 0, "pp": 0, "dp": 0})
    assert dry["coords"] == coords
    assert set(dry["bytes_per_step"]) >= {"tp", "pp", "dp"}
    # every dim's bytes are the planner's for this rank's own stages (rank 1023: the
    # last stage, fewer layers than the first, the head and the loss, sends one way)
    assert dry["data_bytes_per_step"] == pytest.approx(dry["predicted_bytes_per_step"],
                                                       rel=1e-12, abs=0.5)
    full = sum(p.numel() for p in __import__("plait.model.transformer", fromlist=["x"])
               .build_model(config(*SCALED_8B).model, 0, device="meta").parameters())
    assert dry["param_count_local"] < full / 8  # one pp stage's tp slice
    pred, peak = dry["predicted_memory"], dry["memory"]["peak"]
    assert pred["total"] == pytest.approx(dry["memory"]["peak_total"], rel=0.05)
    if rank == 0:  # every category at the peak moment, within 5 %
        assert "MLP norm backward (stage 0, mb 0)" in pred["moment"]
        for cat, names in TABLE_ROWS.items():
            assert sum(pred[n] for n in names) == pytest.approx(peak[cat], rel=0.05), cat


def test_dry_run_refuses_a_wrong_world_size():
    with pytest.raises(ValueError, match="needs 8 ranks"):
        dry_run(config(*LAYOUT), 4, 0, None)


def test_dry_run_of_an_expert_parallel_rank():
    """An MoE rank of a 64-rank dp x ep layout: its experts only, and all-to-all bytes as
    the planner's (the fake group leaves the exchanged counts at this rank's own, a
    symmetric load; the counts' own small all-to-all is the difference, a control
    collective the data bytes leave out)."""
    moe = [FP32, "model.n_experts=16", "model.top_k=2", "model.expert_ffn_dim=64",
           "model.n_layers=2", "parallel.dp=64", "parallel.ep=16", "train.global_batch=64",
           "train.steps=2"]
    dry = _dry(moe, 64, 17)
    ep, pred = dry["bytes_per_step"]["ep"], dry["predicted_bytes_per_step"]["ep"]
    counts = 2 * 16 * 8  # one exchange per layer and micro-batch (forward): 16 int64
    assert ep - pred == counts
    assert dry["data_bytes_per_step"]["ep"] == pred
    assert dry["bytes_per_step"]["dp"] == pytest.approx(
        dry["predicted_bytes_per_step"]["dp"], rel=1e-3)
    model = config(*moe).model
    experts_local = model.n_layers * 3 * model.dim * model.expert_ffn_dim * 16 // 16
    dense = model.num_params() - model.n_layers * 3 * model.dim * model.expert_ffn_dim * 16
    assert dry["param_count_local"] == dense + experts_local


HYBRID = [FP32, "parallel.dp_shard=2", "parallel.dp_replicate=2", "train.steps=2"]


@pytest.mark.parametrize("sets", [
    ["parallel.tp=2", "parallel.sp=true", "parallel.zero=2", "parallel.microbatches=2"],
    ["parallel.cp=2", "parallel.zero=3"]], ids=["tp2 zero2", "cp2 zero3"])
def test_dry_run_of_a_hybrid_sharding_rank(sets):
    """Hybrid sharding (dp 2 x 2) beside tp or cp on 8 ranks: ZeRO's bytes inside the
    rank's dp_shard group and the shards' all-reduce over dp_replicate are the planner's,
    exactly; the optimizer states are the planner's, sharded over the shard group (2 dp
    ranks x cp), to the byte. (The whole peak is held to the
    eager model by a real run, tests/test_predict_vs_measured.py: the fake group's
    reduce-scatter has no gloo chunks.)"""
    from plait.plan import predict_memory

    dry = _dry([*HYBRID, *sets], 8, 5)
    data, pred = dry["data_bytes_per_step"], dry["predicted_bytes_per_step"]
    assert {"dp_shard", "dp_replicate"} <= set(data)
    assert data == pytest.approx(pred, rel=1e-12, abs=0.5)
    states = predict_memory(config(*HYBRID, *sets))
    assert dry["memory"]["peak"]["optimizer"] == states["optimizer states"]


@pytest.mark.slow  # a process per rank
def test_dry_run_from_the_command_line(tmp_path):
    """`plait train --dry-run --world-size 8 --rank first,last`: the first and the last
    rank of dp2 x tp2 x pp2, one after the other (each in a process of its own); both
    tables and both results as JSON."""
    import json
    import subprocess
    import sys

    from helpers import token_file

    out = tmp_path / "dry.json"
    r = subprocess.run([sys.executable, "-m", "plait.cli", "train", "--data", str(token_file()),
                        "--set", "model.vocab_size=256", "--seq-len", "32", "--global-batch",
                        "8", "--steps", "2", "--dp", "2", "--tp", "2", "--pp", "2",
                        "--microbatches", "2", "--dry-run", "--world-size", "8", "--rank",
                        "first,last", "--metrics-out", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "dry run: rank 0 of 8" in r.stdout and "dry run: rank 7 of 8" in r.stdout, r.stdout
    assert r.stdout.count("peak total") == 2, r.stdout
    first, last = json.loads(out.read_text())
    assert first["coords"] == {"tp": 0, "cp": 0, "pp": 0, "dp": 0}
    assert last["coords"] == {"tp": 1, "cp": 0, "pp": 1, "dp": 1}
    for dry in (first, last):
        assert dry["predicted_memory"]["total"] == pytest.approx(dry["memory"]["peak_total"],
                                                                 rel=0.05)
        assert set(dry["bytes_per_step"]) >= {"dp", "pp", "tp"}


ZERO3_PIPE = [FP32, "parallel.dp=2", "parallel.pp=2", "parallel.zero=3",
              "parallel.schedule=zb-h1",
              "parallel.microbatches=2", "model.n_layers=4", "model.tie_embeddings=false",
              "train.steps=2", f"train.memory_step={STEADY}"]


@pytest.mark.parametrize("rank", [0, 3])  # first and last pipeline rank
def test_dry_run_of_a_zero3_pipeline_rank_equals_the_real_rank(rank):
    """ZeRO-3 over a pipeline with a split backward: the dry run's rank holds what the
    real one does (its units gathered and freed alike; to the byte) and moves the bytes
    the planner counts for its stages (each unit's gathers by the schedule's own I and W)."""
    real = shared_run(*ZERO3_PIPE)
    dry = _dry(ZERO3_PIPE, 4, rank)
    assert dry["coords"]["pp"] == rank % 2 and dry["measured_step"] == STEADY
    measured = real[rank]["metrics"][STEADY]["memory"]
    assert dry["memory"]["peak"] == measured["peak"]
    assert dry["bytes_per_step"] == _payload(real[rank]["ledger"], STEADY)
    assert dry["data_bytes_per_step"] == pytest.approx(dry["predicted_bytes_per_step"],
                                                       rel=1e-12, abs=0.5)
    assert "not_covered" in dry["predicted_memory"]  # the eager model's reason, not a number
