"""ZeRO 1/2/3: parity with the single-process reference, memory by formula, ledger bytes."""

import pytest
from helpers import ELEMENT_BYTES, initial_params, reference, run_layout, shared_run

from plait.launch.forked import run_ranks
from plait.testing import assert_parity, merge_ranks


# dp=4 with every stage: tests/test_matrix.py's rows (dp4 z1 / z2 / z3); here the
# accumulated micro-batches with clipping active
def _run(stage: int) -> list[dict]:
    """dp=2, two micro-batches a replica: one run per stage, read by the parity and the
    ledger tests."""
    return shared_run("parallel.dp=2", f"parallel.zero={stage}", "parallel.microbatches=2")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parity_with_accumulation_and_clipping(stage):
    outs = _run(stage)
    assert all(m["grad_norm"] > 0.5 for m in outs[0]["metrics"])  # clipping is active
    assert_parity(merge_ranks(outs), reference())  # every rank gathers the same parameters


def test_uneven_shards_padding_never_reaches_the_maths():
    # dp=3: 64-wide norm gains and 16384-element embeddings split 22/21 with padding
    outs = run_layout("parallel.dp=3", "parallel.zero=3", "train.global_batch=6")
    assert_parity(merge_ranks(outs), reference("train.global_batch=6"))
    outs = run_layout("parallel.dp=3", "parallel.zero=2", "train.global_batch=6")
    assert_parity(merge_ranks(outs), reference("train.global_batch=6"))


def _shard_padding(rank, world):
    """Every stage's padding of this rank's gradient shard after a backward, and of its
    master and moments after the update."""
    import torch
    from torch import nn

    from plait.config import load_config
    from plait.mesh import ParallelMesh
    from plait.parallel.zero import ZeroOptimizer

    mesh = ParallelMesh.build(load_config(sets=[f"parallel.dp={world}"]).parallel)
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 3, bias=False))  # 15 elements: shards of 8
        zero = ZeroOptimizer(model, mesh, stage, (0.9, 0.95), 1e-8, 0.1)
        zero.before_backward(True)
        model(torch.randn(4, 5) + rank).pow(2).sum().backward()
        zero.after_backward(True)
        u = zero.units[0]
        pad = slice(max(0, u.numel - u.lo), None)  # the padding in shard coordinates
        out[stage] = {"grad": u.grad_shard[pad].clone()}
        zero.step(lr=0.1)
        out[stage].update({s: getattr(u, s)[pad].clone()
                           for s in ("master", "exp_avg", "exp_avg_sq")})
    return out


def test_shard_padding_stays_zero():
    """The padding of a unit's flat shard is zero in the gradient and in every optimizer
    state (nothing reads it today; a norm or update over whole shards would)."""
    outs = run_ranks(_shard_padding, 2)
    assert all(t.numel() == 0 for t in outs[0][1].values())  # rank 0: no padding
    for stage, states in outs[1].items():
        for name, t in states.items():
            assert t.numel() == 1 and t.abs().max() == 0, (stage, name, t)


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_close_to_fp32_reference(stage):
    outs = run_layout("parallel.dp=2", f"parallel.zero={stage}", "train.precision=bf16")
    assert_parity(merge_ranks(outs), reference(), "bf16", init=initial_params())


def test_stage3_with_recompute():
    outs = run_layout("parallel.dp=2", "parallel.zero=3", "train.recompute=full",
                      "parallel.microbatches=2")
    assert_parity(merge_ranks(outs), reference())


# ---- communication ledger ---------------------------------------------------------------

def _grad_bytes(n, stage):
    """Gradient bytes of one all-reduce: each unit padded to a multiple of n, fp32 (stages
    1, 2: units of consecutive modules up to parallel.bucket_mb; 3: one per module)."""
    from helpers import config

    from plait.model.transformer import build_model
    from plait.parallel.zero_units import zero_unit_groups

    cfg = config()
    model = build_model(cfg.model, seed=0, device="meta")
    cap = None if stage == 3 else cfg.parallel.bucket_mb * 2**20
    return sum(-(-sum(p.numel() for _, m in group for p in m.parameters()) // n) * n * ELEMENT_BYTES
               for _, group in zero_unit_groups(model, cap))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ledger_bytes_per_step(stage):
    n, micro = 2, 2
    outs = _run(stage)
    S = _grad_bytes(n, stage)
    one_all_reduce = 2 * (n - 1) / n * S
    half = (n - 1) / n * S  # one reduce-scatter or one all-gather of everything
    if stage == 1:  # reduce-scatter once + all-gather once == one all-reduce
        want = {"reduce_scatter": half, "all_gather": half}
    elif stage == 2:  # a reduce-scatter per micro-batch, one all-gather after the update
        want = {"reduce_scatter": micro * half, "all_gather": half}
    else:  # per micro-batch: all-gather for forward and for backward, one reduce-scatter
        want = {"reduce_scatter": micro * half, "all_gather": 2 * micro * half}
    for step in range(4):
        recs = [r for r in outs[1]["ledger"] if r["step"] == step
                and r["tag"] not in ("metrics", "grad_norm", "state")]
        got = {op: sum(r["sent"] for r in recs if r["op"] == op) for op in want}
        assert got == pytest.approx(want, rel=1e-12), (step, got, want)
        assert {r["op"] for r in recs} == set(want)
        # per step: stage 1 moves one all-reduce's bytes, stage 2 (micro + 1) / 2 of
        # them, stage 3 3 x micro / 2
        factor = {1: 1.0, 2: (micro + 1) / 2, 3: 3 * micro / 2}[stage]
        assert sum(got.values()) == pytest.approx(one_all_reduce * factor, rel=1e-12)


def test_stage3_prefetch_overlaps_compute():
    """The next unit's all-gather is issued before the current unit's forward ends."""
    outs = run_ranks(_prefetch_probe, 2)
    for issued_before_end, units in outs:
        assert units >= 4 and issued_before_end == units - 1


def _prefetch_probe(rank, world):
    from helpers import batches_for, config

    from plait.mesh import ParallelMesh
    from plait.train.loop import train

    cfg = config("parallel.dp=2", "parallel.zero=3").check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    result = train(cfg, mesh, batches_for(cfg))
    zero, step = result.optimizer, cfg.train.steps - 1
    fwd = {u: (t0, t1) for s, u, t0, t1 in zero.forward_times if s == step}
    gathers = {}
    for r in mesh.ledger.records:
        if r.step == step and r.tag.startswith("params:"):
            gathers.setdefault(int(r.tag.split(":")[1]), r.start)  # the forward gather
    overlapped = sum(1 for u in range(len(fwd) - 1) if gathers[u + 1] < fwd[u][1])
    return overlapped, len(fwd)


# stages 1, 2: a bucket smaller than any module makes each module its own unit, as stage 3
ONE_MODULE_UNITS = "parallel.bucket_mb=0.0001"


@pytest.mark.parametrize("stage", [1, 2])
def test_backward_keeps_the_set_reduce_scatters_in_flight(stage):
    """Each unit's reduce-scatter is posted while the k = ZERO_REDUCE_SCATTERS_IN_FLIGHT
    before it are still in flight (the oldest is completed just after): k + 1 records
    overlap at each launch from unit k + 1 on, never more."""
    from plait.config import ZERO_REDUCE_SCATTERS_IN_FLIGHT as in_flight

    outs = run_layout("parallel.dp=2", f"parallel.zero={stage}", ONE_MODULE_UNITS)
    grads = [r for r in outs[0]["ledger"] if r["tag"] == "grads" and r["step"] == 1]
    overlap = [sum(1 for o in grads if o["start"] <= r["start"] <= o["end"]) for r in grads]
    assert len(grads) > in_flight + 1
    assert overlap[:in_flight + 1] == list(range(1, in_flight + 2))
    assert set(overlap[in_flight:]) == {in_flight + 1}, overlap


@pytest.mark.parametrize("stage", [1, 2])
def test_update_gathers_are_waited_on_unit_by_unit_in_the_next_forward(stage):
    """Stages 1, 2: after an update every unit's all-gather is still in flight; in the next
    forward each unit waits on its own just before it runs, so the later units' gathers
    stay in flight behind the earlier units' forwards; the loop settles after its last
    step. The gathers count in the step that issued them (the ledger test above)."""
    for seen in run_ranks(_gather_probe, 2, stage):
        assert seen["after_update"] and all(seen["after_update"]), seen
        for pending in seen["at_forward"]:  # units 0..j settled, j+1.. still in flight
            j = pending.index(True)
            assert not any(pending[:j]) and all(pending[j:]), pending
        assert seen["at_forward"] and not any(seen["after_train"]), seen


def _gather_probe(rank, world, stage):
    from helpers import batches_for, config

    from plait.mesh import ParallelMesh
    from plait.train import loop

    cfg = config("parallel.dp=2", f"parallel.zero={stage}", ONE_MODULE_UNITS).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    real, seen = loop.parallelize, {"after_update": [], "at_forward": []}
    made = []

    def pending():
        return [u.gather_handle is not None for u in made[0].optimizer.units]

    def probed(model, mesh_, cfg_, **kwargs):
        par = real(model, mesh_, cfg_, **kwargs)
        made.append(par)
        for block in par.model.layers:  # after ZeRO's own pre-hook: this unit settled
            block.register_forward_pre_hook(
                lambda m, a: seen["at_forward"].append(pending()) if mesh.ledger.step else None)
        return par

    def on_step(row):
        if row["step"] == 0:
            seen["after_update"] = pending()

    loop.parallelize = probed
    try:
        loop.train(cfg, mesh, batches_for(cfg), loop.TrainOptions(on_step=on_step))
    finally:
        loop.parallelize = real
    seen["after_train"] = pending()
    return seen


# ---- measured memory ----------------------------------------------------------------------

MEM = ["model.dim=128", "model.n_layers=4", "model.ffn_dim=352", "train.precision=bf16",
       "train.global_batch=4", "train.seq_len=16", "train.memory_step=1", "train.steps=2"]


def _memory(stage):
    outs = run_layout("parallel.dp=4", f"parallel.zero={stage}", *MEM)
    row = outs[0]["metrics"][1]["memory"]
    n_params = sum(p.numel() for p in outs[0]["params"].values())
    return row, n_params


@pytest.mark.slow  # four 4-rank runs; tests/test_predict_vs_measured.py's dp4 layouts are fast
def test_persistent_memory_matches_formula_planner_and_peaks_order():
    from helpers import config

    from plait.plan import predict_memory

    n, peaks = 4, {}
    for stage in (0, 1, 2, 3):
        row, phi = _memory(stage)
        pre = row["pre_optimizer"]
        # the planner's prediction for this very layout (one cost model): model states
        predicted = predict_memory(config("parallel.dp=4", f"parallel.zero={stage}", *MEM))
        for cat, name in (("params", "parameters"), ("grads", "gradients"),
                          ("optimizer", "optimizer states")):
            assert pre[cat] == pytest.approx(predicted[name], rel=0.05), (stage, cat)
        # (2 + 2 + 12) bytes/param with the stage's divisors (Rajbhandari et al. 2020)
        want = {0: (2, 2, 12), 1: (2, 2, 12 / n), 2: (2, 2 / n, 12 / n),
                3: (2 / n, 2 / n, 12 / n)}[stage]
        for cat, per_param in zip(("params", "grads", "optimizer"), want):
            assert pre[cat] == pytest.approx(per_param * phi, rel=0.05), (stage, cat, pre)
        peaks[stage] = row["peak_total"]
    assert peaks[3] < peaks[2] < peaks[1] < peaks[0], peaks


def test_fp32_model_states_match_the_planner(stage=1):
    """fp32: with ZeRO >= 1 the runtime keeps an fp32 master shard beside the fp32
    parameter (12 bytes/param of optimizer state over dp, not the 8 of m + v; without
    ZeRO the parameter is its own master). The planner's model states say the same."""
    from helpers import config

    from plait.plan import predict_memory

    sets = ["parallel.dp=2", f"parallel.zero={stage}", *MEM, "train.precision=fp32"]
    outs = run_layout(*sets)
    pre = outs[0]["metrics"][1]["memory"]["pre_optimizer"]
    predicted = predict_memory(config(*sets))
    n_params = sum(p.numel() for p in outs[0]["params"].values())
    assert pre["optimizer"] == pytest.approx(predicted["optimizer states"], rel=0.05)
    assert predicted["optimizer states"] == pytest.approx(
        (8 if stage == 0 else 12 / 2) * n_params, rel=0.05)


def test_zero2_peak_is_never_above_zero1s_and_is_the_planners():
    """Same run under ZeRO-1 and ZeRO-2. Here the peak is the first micro-batch's loss
    backward, before any reduce-scatter: ZeRO-2 must hold no gradient there (its shards are
    dropped after each update, as ZeRO-1's are), so its peak is at most ZeRO-1's. Before
    the fix it kept last step's shards zeroed, 8 % above ZeRO-1 at this size (1.030x in
    benchmarks/zero_vs_torch.py), and the planner said so too: one cost model, so the
    planner's order and the measured one are asserted together."""
    from helpers import assert_ranks_memory_match, config, data_windows

    from plait.plan import predict_memory

    peaks, predicted = {}, {}
    for stage in (1, 2):
        sets = ["parallel.dp=2", f"parallel.zero={stage}", "train.memory_step=1",
                "train.steps=2", "train.precision=fp32"]
        cfg = config(*sets)
        outs = run_layout(*sets)
        assert_ranks_memory_match(outs, cfg, f"zero {stage}")  # every category, 5 %
        peaks[stage] = max(o["metrics"][1]["memory"]["peak_total"] for o in outs)
        predicted[stage] = predict_memory(cfg, "eager", data_windows(cfg))["total"]
    assert predicted[2] <= predicted[1], predicted
    assert peaks[2] <= peaks[1], peaks
    assert peaks[2] == pytest.approx(predicted[2], rel=1e-3), (peaks, predicted)
