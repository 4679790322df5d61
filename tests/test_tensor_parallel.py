"""Tensor + sequence parallel: parity with the reference, gradients, ledger bytes, the
vocab-parallel loss, activation memory against the formula, and bad input."""

import pytest
import torch
import torch.nn.functional as F
from helpers import ELEMENT_BYTES, batches_for, config, reference, run_layout
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from plait.comm import autograd as comm_autograd
from plait.config import load_config
from plait.device.memory import MemoryTracker
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model.loss import microbatch_loss
from plait.model.transformer import build_model
from plait.parallel.tensor import (
    apply_tensor_parallel,
    padded_vocab,
    vocab_parallel_cross_entropy,
)
from plait.placement import PlacementTable
from plait.plan.activations import layer_activation_bytes, model_activation_bytes
from plait.testing import assert_parity, merge_ranks

# ---- parity with the single-process reference --------------------------------------------


def _check(outs, *model_sets, precision="fp64"):
    assert_parity(merge_ranks(outs), reference(*model_sets), precision)
    for other in outs[1:]:  # every rank logs the same loss and gathers the same weights
        assert other["losses"] == outs[0]["losses"]
        for name, p in outs[0]["params"].items():
            assert torch.equal(p, other["params"][name]), name
    # clipping was active (max norm 0.5) on every step, so the mesh-wide norm was used
    assert all(m["grad_norm"] > 0.5 for m in outs[0]["metrics"])


# tp=2 with and without SP: tests/test_matrix.py's rows (`tp2 sp rc`, `z1 tp2 cp2:ring`)
@pytest.mark.parametrize("sp", [False, True])
def test_parity(sp, tp=4):
    _check(run_layout(f"parallel.tp={tp}", f"parallel.sp={sp}", "parallel.microbatches=2"))


@pytest.mark.parametrize("tp", [2, 4])  # n_kv_heads=2: split at tp=2, replicated at tp=4
def test_parity_gqa(tp):
    _check(run_layout(f"parallel.tp={tp}", "parallel.sp=true", "model.n_kv_heads=2"),
           "model.n_kv_heads=2")


def test_parity_dp_x_tp():
    _check(run_layout("parallel.dp=2", "parallel.tp=2", "parallel.sp=true",
                      "parallel.microbatches=2"))


def test_parity_padded_vocabulary():
    # 258 ids over tp=4: 260 rows, the last 2 padding (never looked up, masked in the loss)
    _check(run_layout("parallel.tp=4", "model.vocab_size=258"), "model.vocab_size=258")


# ---- a layout's model on its own (the vocab-parallel loss, activation memory) -----------

def _tp_model(cfg):
    """The model with the layout's TP applied, its loss function, and step 0's tokens."""
    mesh = ParallelMesh.build(cfg.parallel)
    model = build_model(cfg.model, cfg.train.seed)
    loss_fn, placements = None, PlacementTable()
    if cfg.parallel.tp > 1:
        tp = apply_tensor_parallel(model, mesh, sp=cfg.parallel.sp, placements=placements)
        loss_fn = tp.loss_sum
    return mesh, model, loss_fn, batches_for(cfg).rows(0), placements


# ---- the ledger: bytes of the region collectives per layer per micro-batch ----------------

@pytest.mark.parametrize("sp", [False, True])
def test_ledger_per_layer(sp):
    tp, micro = 2, 2
    outs = run_layout(f"parallel.tp={tp}", f"parallel.sp={sp}", "train.steps=1",
                      f"parallel.microbatches={micro}")
    cfg = config()
    bsh = cfg.train.global_batch // micro * cfg.train.seq_len * cfg.model.dim * ELEMENT_BYTES
    ring_ar = 2 * (tp - 1) / tp * bsh  # sent per rank by an all-reduce of b·s·h
    for rank_out in outs:
        recs = [r for r in rank_out["ledger"] if r["tag"].startswith("tp.layers.")]
        for layer in range(cfg.model.n_layers):
            for phase in ("fwd", "bwd"):
                mine = [r for r in recs if r["tag"].startswith(f"tp.layers.{layer}.")
                        and r["tag"].endswith(phase)]
                assert all(r["dim"] == "tp" and r["payload"] == bsh for r in mine)
                ops = sorted(r["op"] for r in mine)
                if sp:  # per micro-batch: 2 all-gathers + 2 reduce-scatters
                    assert ops == sorted(["all_gather", "reduce_scatter"] * 2 * micro)
                else:  # per micro-batch: 2 all-reduces
                    assert ops == ["all_reduce"] * 2 * micro
                # either way: the bytes of 2 all-reduces of b·s·h per micro-batch
                assert sum(r["sent"] for r in mine) == pytest.approx(2 * micro * ring_ar)
                assert sum(r["received"] for r in mine) == pytest.approx(2 * micro * ring_ar)


# ---- the vocab-parallel loss ----------------------------------------------------------------

def _vocab_ce(rank, world, vocab):
    mesh = ParallelMesh.build(load_config(sets=[f"parallel.tp={world}"]).parallel)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(24, vocab, generator=gen) * 3
    targets = torch.randint(0, vocab, (24,), generator=gen)
    vp = padded_vocab(vocab, world)
    per = vp // world
    start = rank * per
    padded = torch.cat([logits, torch.full((24, vp - vocab), 7.0)], 1)  # junk in padding
    local = padded[:, start:start + per].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, mesh, start,
                                        max(0, min(per, vocab - start)))
    weights = torch.linspace(0.5, 1.5, 24)
    (loss * weights).sum().backward()
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full, targets, reduction="none")
    (ref * weights).sum().backward()
    ref_grad = torch.cat([full.grad, torch.zeros(24, vp - vocab)], 1)[:, start:start + per]
    return (float((loss - ref).abs().max()), float((local.grad - ref_grad).abs().max()))


@pytest.mark.parametrize("vocab", [64, 62])
def test_vocab_parallel_loss_equals_full_cross_entropy(vocab):
    for loss_err, grad_err in run_ranks(_vocab_ce, 4, vocab):
        assert loss_err < 1e-5 and grad_err < 1e-6


class _Shapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numels: list[tuple[int, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numels += [(t.numel(), tuple(t.shape)) for t in tree_leaves(out)
                        if isinstance(t, torch.Tensor)]
        return out


def _largest_tensor(rank, world, sets):
    cfg = config(*sets)
    mesh = ParallelMesh.build(cfg.parallel)
    model = build_model(cfg.model, cfg.train.seed)
    loss_fn = apply_tensor_parallel(model, mesh, sp=cfg.parallel.sp).loss_sum
    tokens = batches_for(cfg).rows(0)
    with _Shapes() as seen:
        microbatch_loss(model, tokens, tokens[:, 1:].numel(), loss_fn).backward()
    return max(seen.numels)


@pytest.mark.parametrize("sp", [False, True])
def test_no_rank_holds_full_logits(sp):
    cfg = config()
    b, s, v = cfg.train.global_batch, cfg.train.seq_len, cfg.model.vocab_size
    for numel, shape in run_ranks(_largest_tensor, 2, ["parallel.tp=2", f"parallel.sp={sp}"]):
        # the largest tensor any op produced, forward or backward, is the local logits
        assert numel == b * s * v // 2, shape


# ---- region functions ----------------------------------------------------------------------

def _regions(rank, world):
    mesh = ParallelMesh.build(load_config(sets=[f"parallel.tp={world}"]).parallel)
    x = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3) * (rank + 1)
    out = {}
    for name in ("copy_to_tp", "reduce_from_tp", "scatter_to_sp", "gather_from_sp",
                 "all_gather_from_sp", "reduce_scatter_to_sp"):
        xi = x.clone().requires_grad_()
        y = getattr(comm_autograd, name)(xi, mesh)
        y.backward(torch.ones_like(y) * (rank + 1))
        out[name] = (y.detach(), xi.grad)
    return out


def test_region_functions_and_their_adjoints():
    outs = run_ranks(_regions, 2)
    base = torch.arange(24, dtype=torch.float32).view(2, 4, 3)
    for r, o in enumerate(outs):
        k = r + 1
        y, g = o["copy_to_tp"]
        assert torch.equal(y, base * k) and torch.equal(g, torch.full_like(g, 3.0))
        y, g = o["reduce_from_tp"]
        assert torch.equal(y, base * 3) and torch.equal(g, torch.full_like(g, k))
        y, g = o["scatter_to_sp"]  # keep my half of the sequence; gradient gathered
        assert torch.equal(y, (base * k)[:, 2 * r:2 * r + 2])
        assert torch.equal(g, torch.cat([torch.full((2, 2, 3), 1.0),
                                         torch.full((2, 2, 3), 2.0)], 1))
        y, g = o["gather_from_sp"]  # concatenate along the sequence; gradient: my chunk
        assert torch.equal(y, torch.cat([base, base * 2], 1))
        assert torch.equal(g, torch.full_like(g, k))
        y, g = o["all_gather_from_sp"]  # gradient: reduce-scatter of everyone's gradient
        assert torch.equal(y, torch.cat([base, base * 2], 1))
        assert torch.equal(g, torch.full_like(g, 3.0))
        y, g = o["reduce_scatter_to_sp"]
        assert torch.equal(y, (base * 3)[:, 2 * r:2 * r + 2])
        assert torch.equal(g, torch.cat([torch.full((2, 2, 3), 1.0),
                                         torch.full((2, 2, 3), 2.0)], 1))


# ---- activation memory, measured against plait/plan/activations.py -------------------------

def _activation_bytes(rank, world, sets):
    res = {}
    for layers in (1, 2):
        cfg = config(*sets, f"model.n_layers={layers}")
        _, model, loss_fn, tokens, _ = _tp_model(cfg)
        with MemoryTracker(new_only=True) as live:
            loss = microbatch_loss(model, tokens, tokens[:, 1:].numel(), loss_fn)
            res[layers] = live.live_bytes()  # kept for backward when the forward is done
        loss.backward()
    return res


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True), (4, False),
                                        (4, True)])
def test_activation_memory_matches_formula(tp, sp):
    sets = [f"parallel.tp={tp}", f"parallel.sp={sp and tp > 1}"]
    cfg = config(*sets)
    b, s = cfg.train.global_batch, cfg.train.seq_len
    for measured in run_ranks(_activation_bytes, tp, sets):
        per_layer = measured[2] - measured[1]
        predicted = layer_activation_bytes(cfg.model, b, s, tp, sp)
        assert abs(per_layer - predicted) <= 0.10 * predicted, (per_layer, predicted)
        total = model_activation_bytes(config(*sets, "model.n_layers=2").model, b, s, tp, sp)
        assert abs(measured[2] - total) <= 0.10 * total, (measured[2], total)


def test_sequence_parallel_saves_activation_memory():
    cfg = config()
    b, s = cfg.train.global_batch, cfg.train.seq_len
    no_sp, with_sp = (layer_activation_bytes(cfg.model, b, s, 4, sp) for sp in (False, True))
    assert with_sp < no_sp


# ---- bad input --------------------------------------------------------------------------------

def test_bad_tensor_parallel_input_named_at_validation():
    text = "\n".join(load_config(sets=[
        "parallel.tp=3", "model.n_heads=6", "model.n_kv_heads=2", "model.dim=96",
        "model.ffn_dim=256", "parallel.sp=true", "train.seq_len=64"]).validate(3))
    assert "tp=3 does not divide model.ffn_dim=256" in text
    assert "tp=3 and model.n_kv_heads=2" in text
    assert "use a seq_len that is a multiple of 3 (e.g. 63)" in text
    assert "tp=1" in "\n".join(load_config(sets=["parallel.sp=true"]).validate(1))
    cfg = load_config(sets=["parallel.tp=4", "model.vocab_size=258", "parallel.gpus_per_node=2"])
    assert cfg.validate(4) == []
    notes = "\n".join(cfg.warnings())
    assert "padded to 260 rows (2 never used" in notes
    assert "crosses nodes" in notes or "cross nodes" in notes


# ---- composed with ZeRO on a dp x tp mesh ------------------------------------------------------

@pytest.mark.parametrize("zero", [1, 3])
def test_parity_dp_x_tp_with_zero(zero):
    _check(run_layout("parallel.dp=2", "parallel.tp=2", f"parallel.zero={zero}",
                      "parallel.microbatches=2"))


def test_parity_dp_x_tp_zero2_sp_replicated_kv():
    # the awkward corner: SP norm grads, replicated KV heads (counted once in the norm), ZeRO-2
    _check(run_layout("parallel.dp=2", "parallel.tp=4", "parallel.zero=2", "parallel.sp=true",
                      "model.n_kv_heads=2"), "model.n_kv_heads=2")
