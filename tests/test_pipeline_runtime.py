"""Pipeline runtime: I/W split, partition, validation, parity of every schedule, ledger."""

import json

import pytest
import torch
from helpers import ELEMENT_BYTES, batches_for, config, reference, run_layout

from plait.config import ConfigError
from plait.device.memory import MemoryTracker
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model.presets import PRESETS
from plait.model.rope import Positions, rope_tables
from plait.model.transformer import Block, build_model
from plait.parallel.pipeline.partition import Stage, partition_layers
from plait.parallel.pipeline.runtime import OutputCapture, backward_input, backward_weight
from plait.parallel.pipeline.split import SavedStore
from plait.schedule.lower import lower
from plait.schedule.registry import (
    SCHEDULE_NAMES,
    build_schedule,
    natural_virtual_stages,
    validate_schedule_request,
)
from plait.testing import assert_parity, merge_ranks
from plait.train.loop import train

# --- the I/W split is a plain backward, reordered -----------------------------------------


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _block_after_a_plain_backward():
    """A tiny block, its input and output gradient, and the weight gradients of one plain
    backward (the block's .grad cleared again for the split run)."""
    cfg = PRESETS["tiny"]
    torch.manual_seed(0)
    block = Block(cfg)
    pos = Positions(None, *rope_tables(cfg.head_dim, 16, cfg.rope_theta))
    x = torch.randn(2, 16, cfg.dim, requires_grad=True)
    g = torch.randn(2, 16, cfg.dim)
    block(x, pos).backward(g)
    plain = _grads(block)
    block.zero_grad(set_to_none=True)
    return block, pos, x, g, plain


def test_iw_split_equals_plain_backward_on_a_block():
    block, pos, x, g, plain = _block_after_a_plain_backward()
    plain_x = x.grad.clone()

    cap = OutputCapture(block)
    x2 = x.detach().clone().requires_grad_()
    cap.start()
    out = block(x2, pos)
    kept = cap.stop()
    assert len(kept) == 9  # 2 norms + 4 attention + 3 MLP projections
    (gx,), deferred = backward_input(out, g, [x2], kept)
    assert all(p.grad is None for p in block.parameters())  # I wrote no weight gradient
    torch.testing.assert_close(gx, plain_x, rtol=1e-6, atol=1e-7)
    backward_weight(deferred)
    split = _grads(block)
    for name, ref in plain.items():
        torch.testing.assert_close(split[name], ref, rtol=1e-6, atol=1e-7, msg=name)


def test_between_i_and_w_only_what_w_reads_is_held():
    """SavedStore: after I a block keeps the linears' inputs, the norms' normalised values
    and the output gradients, not attention's or SwiGLU's tensors; W's gradients are
    those of a plain backward, and after W nothing of the forward is left."""
    block, pos, x, g, plain = _block_after_a_plain_backward()
    cap, store = OutputCapture(block), SavedStore()
    x2 = x.detach().clone().requires_grad_()
    with MemoryTracker(new_only=True) as live:
        with store.hooks():
            cap.start()
            out = block(x2, pos)
            kept = cap.stop()
        forward = live.live_bytes()
        grads, deferred = backward_input(out, g, [x2], kept)
        del out, kept, grads
        before = live.live_bytes()
        store.keep_only_for_weights(deferred)
        after = live.live_bytes()
        backward_weight(deferred)
        store.release()
        del deferred
        grads_only = live.live_bytes()
    print(f"\nforward {forward}, after I {before}, kept for W {after}")
    assert after < before - forward / 2, (forward, before, after)  # most of it let go
    assert grads_only == sum(p.grad.numel() * 4 for p in block.parameters())
    for name, ref in _grads(block).items():
        torch.testing.assert_close(ref, plain[name], rtol=1e-6, atol=1e-7, msg=name)


def test_iw_split_on_first_stage_with_embedding_and_accumulation():
    cfg = config("model.n_layers=2").model
    model = build_model(cfg, seed=1)
    stage = Stage(model, (0, 1), first=True, last=False)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    g = torch.randn(2, 8, cfg.dim)
    for _ in range(2):  # two micro-batches accumulate
        stage(tokens).backward(g)
    plain = _grads(stage)
    stage.zero_grad(set_to_none=True)
    cap = OutputCapture(stage)
    pending = []
    for _ in range(2):
        cap.start()
        out = stage(tokens)
        _, deferred = backward_input(out, g, [], cap.stop())
        pending.append(deferred)
    for d in pending:  # W deferred past both I's
        backward_weight(d)
    for name, ref in plain.items():
        torch.testing.assert_close(stage.get_parameter(name).grad, ref, rtol=1e-6, atol=1e-7)


# --- partition and validation ---------------------------------------------------------------


def test_partition_balances_cost_and_reports_uneven_splits():
    even = partition_layers(8, 4, embed=0.0, layer=1.0, head=0.0)
    assert even.layers == ((0, 2), (2, 4), (4, 6), (6, 8)) and even.even
    heavy = partition_layers(8, 4, embed=0.0, layer=1.0, head=2.0)  # head = 2 layers
    assert sorted(heavy.costs) == [2.0, 2.0, 3.0, 3.0] and not heavy.even
    assert heavy.layers[-1] == (7, 8)  # the head's stage takes one layer
    assert "uneven on purpose" in heavy.describe()
    assert sum(b - a for a, b in heavy.layers) == 8  # never a dropped layer
    with pytest.raises(ValueError, match="at most 3 stages"):
        partition_layers(3, 4)


@pytest.mark.parametrize("sets, needle", [
    (["parallel.pp=4", "parallel.schedule=zb-h1", "parallel.microbatches=2",
      "model.n_layers=4"], "microbatches>=4"),
    (["parallel.pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=3",
      "model.n_layers=6"], "virtual_stages=2"),
    (["parallel.pp=3", "parallel.schedule=dualpipe", "parallel.microbatches=4",
      "model.n_layers=6"], "even pp"),
    (["parallel.pp=4", "model.n_layers=2"], "pp <= 2"),
    (["parallel.pp=4", "parallel.schedule=zb-v", "parallel.microbatches=4",
      "model.n_layers=4"], "use pp in 2"),
    (["parallel.pp=2", "parallel.schedule=dualpipev", "parallel.microbatches=2",
      "model.n_layers=4"], "microbatches>=3"),
])
def test_bad_pipeline_requests_fail_validation_naming_options(sets, needle):
    with pytest.raises(ConfigError, match=needle):
        config(*sets).check()


def test_valid_pipeline_config_passes_and_picks_two_stages_per_rank_for_v():
    cfg = config("parallel.pp=4", "parallel.schedule=zb-v", "parallel.microbatches=8",
                 "model.n_layers=8").check()
    assert cfg.parallel.virtual_stages is None  # the schedule's own: 2


# --- parity: every schedule at pp 4 with twice as many micro-batches as stages ----------------

STEPS = "train.steps=2"
# the steady state (m > pp) at four stages; the parity matrix (tests/test_matrix.py) runs
# every schedule at pp 2 with m = pp x 2, and four of them at pp 4 with m = pp, in
# combination with the other dimensions
CASES = [(s, 4, 8) for s in SCHEDULE_NAMES
         if not validate_schedule_request(s, 4, 8, natural_virtual_stages(s, None))]


# at pp=4 on 4 ranks: DualPipe (its two copies) in the fast tier, the others in the slow
# one (the matrix runs every schedule at pp=2 and four of them at pp=4 in the fast tier)
FAST = {"dualpipe"}


@pytest.mark.parametrize("schedule, pp, m", [
    pytest.param(*c, marks=[] if c[0] in FAST else [pytest.mark.slow]) for c in CASES])
def test_schedule_parity(schedule, pp, m):
    """Every rank's loss and grad norm, every gradient and parameter of every stage."""
    layers = f"model.n_layers={2 * pp}"
    outs = run_layout(layers, STEPS, f"parallel.pp={pp}", f"parallel.schedule={schedule}",
                      f"parallel.microbatches={m}")
    assert_parity(merge_ranks(outs), reference(layers, STEPS))


# pp2 x dp2 (with and without ZeRO-1): the parity matrix's dp x pp rows


def test_one_stage_runtime_is_gradient_accumulation():
    outs = run_layout("parallel.microbatches=4", STEPS)
    assert_parity(merge_ranks(outs), reference(STEPS))


# --- ledger: P2P bytes per step are the boundary crossings ----------------------------------


@pytest.mark.parametrize("schedule, pp, m", [("1f1b", 4, 4), ("zb-v", 2, 4),
                                             ("interleaved", 2, 4), ("dualpipe", 4, 4)])
def test_ledger_p2p_bytes_are_boundary_crossings(schedule, pp, m):
    sets = [f"model.n_layers={2 * pp}", STEPS, f"parallel.pp={pp}",
            f"parallel.schedule={schedule}", f"parallel.microbatches={m}"]
    outs = run_layout(*sets)
    cfg = config(*sets)
    b, s, h = cfg.micro_batch_size(), cfg.train.seq_len, cfg.model.dim
    act = b * s * h * ELEMENT_BYTES
    sched = lower(build_schedule(schedule, pp, m, natural_virtual_stages(schedule, None)))
    # stage boundaries that cross ranks, once per micro-batch through them
    crossings = sum(1 for s_ in range(sched.num_stages)
                    if (n := sched.next_stage(s_)) is not None
                    and sched.stage_to_rank[n] != sched.stage_to_rank[s_]) * (
        m // sched.num_chains)
    total = 0
    for r, o in enumerate(outs):
        sends = sum(1 for a in sched.actions[r] if a.kind.startswith("SEND"))
        for step in range(2):
            p2p = [x for x in o["ledger"] if x["step"] == step and x["tag"] == "pp"]
            sent = sum(x["sent"] for x in p2p)
            assert sent == sends * act
            assert sum(x["received"] for x in p2p) == sum(
                1 for a in sched.actions[r] if a.kind.startswith("RECV")) * act
            total += sent if step == 0 else 0
    assert total == 2 * crossings * act  # an activation down, a gradient up


# --- measured timeline ----------------------------------------------------------------------


def test_p2p_median_from_exact_values_and_bounds():
    from plait.parallel.pipeline.measure import p2p_median

    assert p2p_median([]) == 0.0
    assert p2p_median([(1.0, True), (2.0, True), (3.0, True)]) == 2.0
    # most transfers arrived before anyone asked (bounds of 0.1): the median is <= 0.1,
    # although the three a consumer waited for took 9
    assert p2p_median([(0.1, False)] * 10 + [(9.0, True)] * 3) == 0.1
    # bounds above the exact values say nothing more: the exact ones decide
    assert p2p_median([(9.0, False)] * 10 + [(1.0, True)] * 3) == 1.0
    # the estimate stays above one half down to the smallest value: more than half the
    # latencies lie below it, whatever the large bounds (their median would be 5)
    assert p2p_median([(5.0, False)] * 10 + [(0.3, True)] * 2 + [(0.2, False)] * 5) == 0.2


def test_each_compute_gap_and_each_step_between():
    """What a replay lays out from the records (runtime_stats.gap_each_compute,
    between_each_step): one rank's step from 0, a post 1-2, F at 3-5 (its gap: 3 less the
    post), an I that waited from 5.5 to 7 for its input (its gap: up to the wait, 0.5), a
    W at 8.1 after a wait of 0.1 ms, completing an arrived receive (its gap: all 0.1).
    The other rank ends at 9.5; the next steps start at 12 and 11: with the barrier 2.5
    and 1.5 after the last end, with post-validation 3 after rank 0's own end."""
    from plait.parallel.pipeline.runtime_stats import between_each_step, gap_each_compute

    rank = (0.0, 10.0, [("F", 0, 0, 3.0, 5.0), ("I", 0, 0, 7.0, 8.0), ("W", 0, 0, 8.1, 9.0)],
            [(3.0, 2.0), (5.5, 1.0), (8.0999, 0.9)], [(1.0, 2.0, 0.1)], [])
    other = (0.0, 10.0, [("F", 1, 0, 5.0, 9.5)], [(5.0, 4.5)], [], [])
    gaps = gap_each_compute([rank])
    assert gaps == pytest.approx({("F", 0, 0): 2.0, ("I", 0, 0): 0.5, ("W", 0, 0): 0.1})
    nxt = [(12.0, 20.0, [], [], [], []), (11.0, 20.0, [], [], [], [])]
    assert between_each_step([[rank, other], nxt], "barrier") == ((2.5, 1.5),)
    assert between_each_step([[rank, other], nxt], "post_validation") == ((3.0, 1.5),)


def _trace_rank(rank, world, sets, out_dir):
    from plait.parallel.pipeline.measure import write_timeline, write_trace

    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    result = train(cfg, mesh, batches_for(cfg))
    if rank == 0:
        write_trace(result.pipeline, f"{out_dir}/trace.json")
        write_timeline(result.pipeline, f"{out_dir}/timeline.png")
    return result.summary["pipeline"]


def test_measured_bubble_trace_and_timeline(tmp_path):
    sets = ["model.n_layers=4", "train.steps=3", "parallel.pp=2", "parallel.schedule=zb-h1",
            "parallel.microbatches=4"]
    outs = run_ranks(_trace_rank, 2, sets, str(tmp_path))
    s = outs[0]
    assert s == outs[1]  # one report, the same on every rank
    assert 0 < s["measured_bubble"] < 1 and 0 < s["simulated_bubble"] < 1
    assert set(s["mean_ms"]) == {"F", "I", "W"} and s["steps_measured"] == 2
    d = s["durations_ms"]  # what the prediction was fed: per stage, and the transfers
    assert len(d["F"]) == len(d["I"]) == len(d["W"]) == 2 and min(d["F"]) > 0
    assert d["p2p"] >= 0 and d["post"] > 0 and d["p2p_samples"] == 2 * 4 * 2
    # the runtime's own work before each compute is measured and fed to the prediction
    assert d["gap"] > 0 and s["simulated_bubble"] > s["simulated_bubble_no_gap"]
    assert 0 <= d["p2p_waited"] <= d["p2p_samples"]
    assert abs(sum(s["idle"].values()) - s["measured_bubble"]) < 1e-9  # idle, accounted
    assert s["idle"]["check"] == 0.0  # the barrier: no post-validation check
    # zb-h1 splits every backward: no whole B was measured, so B = I + W
    assert d["B"] == pytest.approx([i + w for i, w in zip(d["I"], d["W"], strict=True)])
    # the per-step prediction, the pooled one and the replay (each action its own time)
    for key in ("simulated_bubble_pooled", "simulated_bubble_replay"):
        assert 0 < s[key] < 1, key
    assert all(0 < v <= 1.05 for v in s["cpu_share"].values())
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    computes = [e for e in trace if e["ph"] == "X"]
    assert len(computes) == 2 * 4 * 3  # 2 ranks x 4 micro-batches x (F, I, W)
    assert {e["pid"] for e in computes} == {0, 1}
    assert (tmp_path / "timeline.png").stat().st_size > 1000
