"""Context parallel: ring and all-gather attention against full causal attention, parity
of every composed layout with the single-process reference, the ledger's bytes per layer
against the formula (and the planner's), load balance, activation memory, bad input."""

import pytest
import torch
import torch.nn.functional as F
from helpers import ELEMENT_BYTES, batches_for, config, initial_params, reference, run_layout

from plait.config import load_config
from plait.device.memory import MemoryTracker
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model.rope import Positions
from plait.model.transformer import build_model
from plait.parallel.attention_blocks import fused_available
from plait.parallel.context import ContextLayout, ContextParallelAttention, apply_context_parallel
from plait.parallel.pipeline.partition import Stage
from plait.plan import estimate_config
from plait.plan.activations import layer_activation_bytes
from plait.testing import assert_parity, merge_ranks

# ---- the attention core alone: exact against SDPA's causal attention --------------------

# fp32, unit-normal q/k/v: blockwise softmax merged by log-sum-exp differs from one softmax
# by rounding only. Measured max |diff| over outputs and dq/dk/dv: 1.4e-6 (ring), 8.3e-7
# (all-gather); a wrong mask, a dropped block or a lost dK/dV hop is O(0.1).
CORE_ATOL = 1e-5


def _core(mesh, layout, mode, kv_heads, fused=None):
    b, h, s, d = 2, 4, 32, 8
    world = mesh.size("cp")
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(b, h, s, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, kv_heads, s, d, generator=gen) for _ in range(2))
    lay = ContextLayout(world, s, layout)
    core = ContextParallelAttention(mesh, lay, mode, fused=fused)
    pos = lay.positions(mesh.coord("cp"), "cpu")
    mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    out = core(*mine, Positions(pos, torch.zeros(1), torch.zeros(1)))
    out.backward(dout[:, :, pos])
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=kv_heads != h)
    ref.backward(dout)
    errs = [(out - ref[:, :, pos]).abs().max()]
    errs += [(a.grad - r.grad[:, :, pos]).abs().max() for a, r in zip(mine, full, strict=True)]
    return max(float(e) for e in errs), core.ring.work, lay.work(mesh.coord("cp"))


# (layout, mode, KV heads, fused): ring both layouts, MHA and GQA, with the fused CPU kernel
# (the default here) and with the eager maths (what devices without it run); all-gather
CASES = [(lay, "ring", kv, None) for lay in ("zigzag", "contiguous") for kv in (4, 2)]
CASES += [("zigzag", "ring", 4, False), ("contiguous", "ring", 2, False),
          ("contiguous", "allgather", 4, None), ("zigzag", "allgather", 2, None)]
# all-to-all (Ulysses): MHA, and one KV head repeated for cp ranks
CASES += [("zigzag", "a2a", 4, None), ("contiguous", "a2a", 2, None), ("zigzag", "a2a", 1, None)]


def _cores(rank, world, cases):
    mesh = ParallelMesh.build(load_config(sets=[f"parallel.cp={world}"]).parallel)
    return [_core(mesh, *case) for case in cases]  # one process group for every case


@pytest.mark.parametrize("cp", [2, 4])
def test_core_equals_full_causal_attention(cp):
    assert fused_available(torch.device("cpu"))
    for rank_rows in run_ranks(_cores, cp, CASES):
        for case, (err, _, _) in zip(CASES, rank_rows, strict=True):
            assert err <= CORE_ATOL, (case, err)


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_balances_the_causal_work(cp):
    """Counted: each rank's scores computed in forward (future blocks skipped, diagonal
    ones half) equal the layout's formula; zigzag gives every rank the same work,
    contiguous gives the last rank (cp - 1/2)/(cp/2) of the mean."""
    cases = [("zigzag", "ring", 4), ("contiguous", "ring", 4)]
    rows = run_ranks(_cores, cp, cases)  # rows[rank][case]
    shares = {}
    for c, (layout, _, _) in enumerate(cases):
        assert [r[c][1] for r in rows] == [r[c][2] for r in rows]
        work = [r[c][1] for r in rows]
        shares[layout] = max(work) / (sum(work) / cp)
    assert shares["zigzag"] == 1.0
    assert shares["contiguous"] == pytest.approx((cp - 0.5) / (cp / 2))
    print(f"\ncp={cp}: max/mean attention work zigzag {shares['zigzag']:.2f}, "
          f"contiguous {shares['contiguous']:.2f}")


# ---- parity of the composed layouts with the single-process reference --------------------

def _check(outs, *model_sets, precision="fp64"):
    """Every rank's loss and grad norm, every gradient and parameter (gathered: replicas
    and cp ranks agree exactly), with clipping active at every step."""
    assert_parity(merge_ranks(outs), reference(*model_sets), precision)
    clip = config(*model_sets).train.grad_clip  # clipping was active: the norm mattered
    assert all(m["grad_norm"] > clip for m in outs[0]["metrics"])


# cp2 all-gather, with dp, tp+SP, ZeRO-3 and recompute: tests/test_matrix.py's rows
# (`z2 cp2:allgather`, `dp2 cp2:ring moe ep4`, `z3 tp2 sp cp2:allgather moe`,
# `z3 cp2:ring moe ep2`, `z1 pp4:zb-h1 cp2:ring rc`)
@pytest.mark.parametrize("sets", [
    ["parallel.cp=2"], ["parallel.cp=4"], ["parallel.cp=2", "parallel.cp_layout=contiguous"],
    ["parallel.dp=2", "parallel.cp=2", "parallel.zero=1", "parallel.microbatches=2"]],
    ids=lambda s: ",".join(x.split(".", 1)[1] for x in s))
def test_parity(sets):
    _check(run_layout(*sets))


@pytest.mark.parametrize("sets", [
    ["parallel.cp=2", "model.n_kv_heads=2"],
    ["parallel.cp=4", "parallel.cp_mode=allgather", "model.n_kv_heads=2"],
    ["parallel.cp=2", "parallel.tp=2", "model.n_kv_heads=1"]],  # KV head replicated over tp
    ids=lambda s: ",".join(x.split(".", 1)[1] for x in s))
def test_parity_gqa(sets):
    model = [s for s in sets if s.startswith("model.")]
    _check(run_layout(*sets), *model)


# every schedule with every cp level, DualPipe's two copies and pp x cp x tp+SP included:
# tests/test_matrix.py (`pp2:dualpipe cp2:allgather rcs`, `tp2 pp2:dualpipe cp2:ring`,
# `z1 tp2 sp pp2:1f1b cp2:ring moe ep2`, ...), which pairs schedules with cp and tp


def test_parity_dp_pp_cp_three_dims():
    # the gradients summed over pp's stages, then over dp x cp, with ZeRO-1 (a triple no
    # matrix row holds: the matrix is a pairwise cover)
    model = ["model.tie_embeddings=false", "model.n_layers=4"]
    _check(run_layout(*model, "parallel.dp=2", "parallel.pp=2", "parallel.cp=2",
                      "parallel.zero=1", "parallel.microbatches=2"), *model)


def test_bf16_close_to_fp32_reference():
    # bf16 compute (fp32 masters): the block maths runs in fp32 inside the core, K/V and
    # dK/dV travel in bf16. Measured: loss 7.5e-5, grad norm 3.1e-3, first grads 9.9e-3.
    outs = run_layout("parallel.cp=2", "train.precision=bf16")
    assert_parity(merge_ranks(outs), reference(), "bf16", init=initial_params())


LONG = ("model.max_seq_len=1024", "train.seq_len=1024", "train.global_batch=2",
        "train.steps=2", "train.grad_clip=0.2")


def test_parity_long_sequence():
    # 1024 tokens on 4 ranks: 8 chunks of 128, each rank 2 of them
    _check(run_layout(*LONG, "parallel.cp=4"), *LONG)


# ---- the ledger: bytes per layer per micro-batch, and the planner's --------------------------

@pytest.mark.parametrize("mode", ["ring", "allgather"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ledger_per_layer(cp, mode):
    micro = 2
    sets = [f"parallel.cp={cp}", f"parallel.cp_mode={mode}", "train.steps=1",
            f"parallel.microbatches={micro}", "model.n_kv_heads=2"]
    cfg = config(*sets)
    m = cfg.model
    # one rank's packed K/V chunk: (2, mbs, kv heads, seq/cp, head dim), float64
    chunk = (2 * cfg.micro_batch_size() * m.n_kv_heads * (cfg.train.seq_len // cp)
             * m.head_dim * ELEMENT_BYTES)
    if mode == "ring":  # (cp-1) hops forward; K/V and dK/dV (cp-1) hops each backward
        want = {"fwd": (cp - 1) * chunk, "bwd": 2 * (cp - 1) * chunk}
        ops = {"fwd": {"send", "recv"}, "bwd": {"send", "recv"}}
    else:  # all-gather K/V, reduce-scatter dK/dV: (cp-1)/cp of the gathered cp chunks
        want = {"fwd": (cp - 1) * chunk, "bwd": (cp - 1) * chunk}
        ops = {"fwd": {"all_gather"}, "bwd": {"reduce_scatter"}}
    outs = run_layout(*sets)
    for o in outs:
        recs = [r for r in o["ledger"] if r["tag"].startswith("cp.layers.")]
        assert {r["dim"] for r in recs} == {"cp"}
        for layer in range(m.n_layers):
            for phase in ("fwd", "bwd"):
                mine = [r for r in recs if r["tag"] == f"cp.layers.{layer}.attn.{phase}"]
                assert {r["op"] for r in mine} == ops[phase]
                assert sum(r["sent"] for r in mine) == pytest.approx(micro * want[phase])
                assert sum(r["received"] for r in mine) == pytest.approx(micro * want[phase])
    # the planner's cp collectives move the same bytes per step
    planned = [c for c in estimate_config(cfg).collectives if c.dim == "cp"]
    sent = sum(r["sent"] for r in outs[0]["ledger"] if r["tag"].startswith("cp.layers."))
    share = 1.0 if mode == "ring" else (cp - 1) / cp  # a collective's size is its payload
    assert sum(float(c.size * c.count) * share for c in planned) == pytest.approx(sent)
    print(f"\ncp={cp} {mode}: {want['fwd']} B forward, {want['bwd']} B backward per layer "
          f"per micro-batch")


def test_gradients_and_loss_reduced_over_dp_cp():
    outs = run_layout("parallel.dp=2", "parallel.cp=2", "train.steps=1")
    for o in outs:
        grads = [r for r in o["ledger"] if r["tag"] == "grads"]
        assert grads and {(r["dim"], r["group_size"]) for r in grads} == {("dp_cp", 4)}
        metrics = {r["dim"] for r in o["ledger"] if r["tag"] == "metrics"}
        assert {"cp", "dp"} <= metrics


# ---- activation memory per rank falls as 1/cp -------------------------------------------------

def _activation_bytes(rank, world, sets):
    res = {}
    for layers in (1, 2):
        cfg = config(*sets, f"model.n_layers={layers}")
        mesh = ParallelMesh.build(cfg.parallel)
        model = build_model(cfg.model, cfg.train.seed)
        stage = Stage(model, (0, layers), True, True)
        pos = None
        if world > 1:
            pos = apply_context_parallel({0: stage}, mesh, "ring",
                                         ContextLayout(world, cfg.train.seq_len))
        tokens = batches_for(cfg).rows(0)
        x, y = tokens[:, :-1], tokens[:, 1:]
        if pos is not None:
            x, y = x[:, pos], y[:, pos]
        with MemoryTracker(new_only=True) as live:
            loss = stage(x, y, tokens[:, 1:].numel(), positions=pos)
            res[layers] = live.live_bytes()  # kept for backward when the forward is done
        loss.backward()
    return res


def test_activation_memory_falls_as_one_over_cp():
    """Per layer, what a rank keeps for backward is the block's formula at s/cp tokens
    (plait/plan/activations.py: ring attention saves q, the packed K/V, the output and its
    log-sum-exp, the flash path's tensors); the planner's layer_activations scales the
    same way (tokens = mbs·s/cp)."""
    cfg = config()
    b, s = cfg.train.global_batch, cfg.train.seq_len
    per_layer = {}
    for cp in (1, 2, 4):
        for measured in run_ranks(_activation_bytes, cp, [f"parallel.cp={cp}"]):
            layer = measured[2] - measured[1]
            predicted = layer_activation_bytes(cfg.model, b, s // cp)
            assert layer == predicted, (cp, layer, predicted)  # measured: exact
            per_layer[cp] = layer
    print(f"\nper-layer activation bytes per rank: {per_layer}")
    assert per_layer[2] / per_layer[1] == pytest.approx(1 / 2, rel=0.05)
    assert per_layer[4] / per_layer[1] == pytest.approx(1 / 4, rel=0.05)


# ---- bad input: named before any rank starts ----------------------------------------------------

def test_bad_context_parallel_input_named_at_validation():
    text = "\n".join(config("parallel.cp=4", "train.seq_len=36").validate(4))
    assert "cuts train.seq_len=36 into 8 equal chunks" in text and "multiple of 8" in text
    assert config("parallel.cp=4", "train.seq_len=36",
                  "parallel.cp_layout=contiguous").validate(4) == []
    text = "\n".join(config("parallel.cp=2", "parallel.cp_mode=ulysses").validate(2))
    assert "parallel.cp_mode='ulysses'; use one of ring, allgather, a2a" in text
    text = "\n".join(config("parallel.cp=2", "parallel.cp_layout=striped").validate(2))
    assert "use 'zigzag' or 'contiguous'" in text
    text = "\n".join(config("parallel.cp=2", "parallel.tp=3", "parallel.sp=true",
                            "model.n_heads=6", "model.dim=96", "model.ffn_dim=192",
                            "model.n_kv_heads=3").validate(6))
    assert "splits each cp rank's 16 tokens over tp=3" in text


class _SlidingWindow(torch.nn.Module):
    def forward(self, q, k, v, positions):
        return q


def test_unknown_attention_core_refused():
    model = build_model(config().model, 0, device="meta")
    stage = Stage(model, (0, 2), True, True)
    stage.layers["1"].attn.core = _SlidingWindow()
    mesh = ParallelMesh.build(load_config().parallel)
    with pytest.raises(ValueError, match="cannot shard layers.1.attn.core"):
        apply_context_parallel({0: stage}, mesh, "ring", ContextLayout(2, 32))


def test_cp_flags_reach_the_config():
    import argparse

    from plait.train.flags import add_train_args, config_from_args

    parser = argparse.ArgumentParser()
    add_train_args(parser)
    cfg = config_from_args(parser.parse_args(["--cp", "2", "--cp-mode", "allgather",
                                              "--cp-layout", "contiguous"]))
    assert (cfg.parallel.cp, cfg.parallel.cp_mode, cfg.parallel.cp_layout) == (
        2, "allgather", "contiguous")
    assert cfg.validate(2) == []
    with pytest.raises(SystemExit):  # argparse names the choices
        parser.parse_args(["--cp-mode", "ulysses"])
