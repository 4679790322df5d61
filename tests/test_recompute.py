"""Recomputation: none / selective / full, with every pipeline schedule.

- What a block keeps for backward under each mode, measured by the memory tracker, equals
  the planner's `layer_saved_bytes` to the byte (plait/plan/activations.py).
- With a split backward (I and W) each forward runs exactly twice per micro-batch: F and
  one recomputation, shared by I and W; with whole-B schedules likewise (per block).
- Parity against the single-process run without recompute, at the tolerances of
  docs/parity.md: a pairwise cover of mode x (pp=1, 1f1b, zb-v, dualpipev) x (tp=1,
  tp=2+SP). `none` is covered by every other parity test; full with pp=1 (tp, dp, ZeRO),
  1f1b and gpipe by tests/test_parity_combinations.py.
"""

import json

import pytest
import torch
from helpers import batches_for, config, reference, run_layout

from plait.device.memory import MemoryTracker
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model import transformer
from plait.model.loss import microbatch_loss
from plait.model.recompute import Recompute, extra_forward_flops_per_token, op_group
from plait.parallel.pipeline.measure import write_trace
from plait.parallel.tensor import apply_tensor_parallel
from plait.placement import PlacementTable
from plait.plan.activations import layer_saved_bytes
from plait.testing import assert_parity, merge_ranks
from plait.train.loop import train

PP_MODEL = ("model.n_layers=4", "model.tie_embeddings=false")
MODES = [("none", ()), ("full", ()), ("selective", ("attention", "elementwise")),
         ("selective", ("elementwise",)), ("selective", ("matmul", "elementwise"))]


# ---- kept bytes per layer, measured against the planner --------------------------------

def _kept_per_layer(rank, world, sets, dtype, modes):
    """Per mode: live bytes after the forward with two layers minus with one."""
    out = []
    for mode, ops in modes:
        live = {}
        for layers in (1, 2):
            cfg = config(*sets, f"model.n_layers={layers}")
            mesh = ParallelMesh.build(cfg.parallel)
            model = transformer.build_model(cfg.model, cfg.train.seed, dtype=dtype)
            loss_fn = None
            if cfg.parallel.tp > 1:
                loss_fn = apply_tensor_parallel(model, mesh, sp=cfg.parallel.sp,
                                                placements=PlacementTable()).loss_sum
            model.recompute = Recompute.of(mode, ops)
            tokens = batches_for(cfg).rows(0)
            with MemoryTracker(new_only=True) as tracker:
                loss = microbatch_loss(model, tokens, tokens[:, 1:].numel(), loss_fn)
                live[layers] = tracker.live_bytes()
            loss.backward()
        out.append(live[2] - live[1])
    return out


@pytest.mark.parametrize("sets, dtype, modes", [
    ([], torch.float32, MODES), (["parallel.tp=2", "parallel.sp=true"], torch.float32,
                                 MODES[:4]),
    ([], torch.bfloat16, MODES[2:3])], ids=["tp1", "tp2-sp", "tp1-bf16"])
def test_kept_bytes_per_layer_equal_the_planner(sets, dtype, modes):
    """Exact: nothing but the block's input and the saved groups' outputs stays (tp1:
    none 1,447,936 B, full 65,536, selective 753,664)."""
    cfg = config(*sets)
    p, b, s = cfg.parallel, cfg.train.global_batch, cfg.train.seq_len
    e = torch.finfo(dtype).bits // 8
    for measured in run_ranks(_kept_per_layer, p.tp, sets, dtype, modes):
        predicted = [layer_saved_bytes(cfg.model, b, s, p.tp, p.sp, e, mode, ops)
                     for mode, ops in modes]
        assert measured == predicted, list(zip(modes, measured, predicted, strict=True))
    if modes[:3] == MODES[:3]:
        assert predicted[1] < predicted[2] < predicted[0]  # selective: between full, none


def test_op_groups():
    aten = torch.ops.aten
    assert op_group(aten.mm.default) == "matmul"
    assert op_group(aten._scaled_dot_product_flash_attention_for_cpu.default) == "attention"
    assert op_group(aten.mul.Tensor) == op_group(aten.rsqrt.default) == "elementwise"
    sel = Recompute.of("selective")
    assert sel.saved_groups == ("matmul",) and Recompute.of("full").saved_groups == ()
    assert Recompute.of("none") is None


def test_extra_forward_flops():
    """Full recompute with a split backward redoes the whole forward: a third of training's
    6N + attention; per block it skips the head; selective redoes the attention core."""
    cfg = config().model
    s, total = 32, cfg.flops_per_token(32)
    full, sel = Recompute.of("full"), Recompute.of("selective")
    assert extra_forward_flops_per_token(cfg, s, full, True) == pytest.approx(total / 3)
    head = 2 * cfg.dim * cfg.vocab_size
    assert extra_forward_flops_per_token(cfg, s, full, False) == pytest.approx(total / 3 - head)
    assert extra_forward_flops_per_token(cfg, s, sel, True) == cfg.n_layers * 2 * s * cfg.dim
    assert extra_forward_flops_per_token(cfg, s, None) == 0


def test_bad_recompute_settings_named_at_validation():
    text = "\n".join(config("train.recompute=some").validate(1))
    assert "use 'none', 'selective' or 'full'" in text
    text = "\n".join(config("train.recompute=selective",
                            "train.recompute_ops=attention,softmax").validate(1))
    assert "'softmax'" in text and "matmul, attention, elementwise" in text
    text = "\n".join(config("train.recompute=selective",
                            "train.recompute_ops=attention").validate(1))
    assert "include 'elementwise'" in text
    # every schedule takes recomputation, the I/W-split ones included
    for schedule in ("zb-h1", "zb-h2", "zb-v", "dualpipev", "dualpipe"):
        assert config(*PP_MODEL, "parallel.pp=2", f"parallel.schedule={schedule}",
                      "parallel.microbatches=4", "train.recompute=selective").validate(2) == []


# ---- each forward runs twice: F and one recomputation ----------------------------------

def _forwards_counted(rank, world, sets, out_dir):
    calls = [0]
    forward = transformer.Block.forward

    def counted(self, *args):
        calls[0] += 1
        return forward(self, *args)

    transformer.Block.forward = counted  # this forked rank's copy only
    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    result = train(cfg, mesh, batches_for(cfg))
    if rank == 0:  # the recomputations inside I, drawn nested in the Chrome trace
        write_trace(result.pipeline, f"{out_dir}/trace.json")
    return calls[0], result.summary["pipeline"]["recompute"]["count_per_step"]


@pytest.mark.parametrize("schedule, mode", [("1f1b", "selective"), ("zb-v", "selective")])
def test_each_forward_recomputed_once(schedule, mode, tmp_path):
    """4 layers, 2 per rank (zb-v: 2 stages of 1 layer each per rank), 4 micro-batches, 1
    step: 8 block forwards per rank without recomputation, exactly twice that with it; a
    split backward's recomputation is one per (stage, micro-batch), inside its I."""
    sets = [*PP_MODEL, "train.steps=1", "parallel.pp=2", f"parallel.schedule={schedule}",
            "parallel.microbatches=4", f"train.recompute={mode}"]
    split = schedule == "zb-v"
    for calls, recomputes in run_ranks(_forwards_counted, 2, sets, str(tmp_path)):
        assert calls == 2 * 8
        assert recomputes == [8.0 if split else 0.0] * 2
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    redone = [e for e in trace if e["ph"] == "X" and e["tid"] == 1]
    assert len(redone) == (2 * 8 if split else 0)  # 2 ranks x 8 (stage, micro-batch)
    inside = {(e["pid"], e["args"]["stage"], e["args"]["microbatch"]): e for e in trace
              if e["ph"] == "X" and e["cat"] == "I"}
    for r in redone:  # each inside its I
        i = inside[r["pid"], r["args"]["stage"], r["args"]["microbatch"]]
        assert i["ts"] <= r["ts"] and r["ts"] + r["dur"] <= i["ts"] + i["dur"] + 1e-3


# ---- parity: a pairwise cover of mode x schedule x tp ---------------------------------

TP_SP = ("parallel.tp=2", "parallel.sp=true")
# pp=1 with selective, with and without tp+sp: tests/test_matrix.py (`z2 cp2:ring moe rcs`,
# `dp2 z1 tp2 sp moe ep2 rcs`); the matrix pairs schedules with tp and cp only, so the
# schedule x mode pairs are here
PARITY = [  # (mode, schedule or None for pp=1, tp+sp?): every pair of the three, 6 runs
    ("selective", "1f1b", True), ("full", "1f1b", False),
    ("selective", "zb-v", False), ("full", "zb-v", True),
    ("selective", "dualpipev", False), ("full", "dualpipev", True),
]


@pytest.mark.parametrize("mode, schedule, tp", PARITY,
                         ids=[f"{m}-{s or 'pp1'}-{'tp2sp' if t else 'tp1'}"
                              for m, s, t in PARITY])
def test_recompute_parity(mode, schedule, tp):
    layout = [*(TP_SP if tp else ()), f"train.recompute={mode}"]
    if schedule is None:
        outs = run_layout(*layout, "parallel.microbatches=2")
        run, ref = merge_ranks(outs), reference()
    else:
        outs = run_layout(*PP_MODEL, *layout, "parallel.pp=2", f"parallel.schedule={schedule}",
                          "parallel.microbatches=4")
        run, ref = merge_ranks(outs), reference(*PP_MODEL)
    assert_parity(run, ref, "fp64")
