"""Data parallel (naive and bucketed): parity with the single-process reference, ledger."""

import pytest
import torch
from helpers import ELEMENT_BYTES, initial_params, reference, run_layout, shared_run

from plait.testing import PARITY_TOLERANCES, assert_parity, merge_ranks

# bucketed at dp=4 (with full recompute): tests/test_matrix.py's `dp4 rc` row
LAYOUTS = [("naive", 2), ("bucketed", 2), ("naive", 4)]


def _run(mode: str, dp: int) -> list[dict]:
    """One run per layout, read by the parity, ledger and overlap tests: 8 sequences (dp=2:
    2 micro-batches of 2 per replica; dp=4: 2 micro-batches of 1), 50 KiB buckets (several
    over the ~0.2 MB model)."""
    return shared_run(f"parallel.dp={dp}", f"parallel.data_parallel={mode}",
                      "parallel.microbatches=2", "parallel.bucket_mb=0.05")


@pytest.mark.parametrize("mode, dp", LAYOUTS)
def test_parity_with_accumulation_and_clipping(mode, dp):
    outs = _run(mode, dp)
    assert_parity(merge_ranks(outs), reference())  # every replica's losses and norms
    # clipping was active (max norm 0.5), so the clipped path is what parity checked
    assert all(m["grad_norm"] > 0.5 for m in outs[0]["metrics"])
    # every replica ends with the same weights, bit for bit
    for other in outs[1:]:
        for name, p in outs[0]["params"].items():
            assert torch.equal(p, other["params"][name]), name
    assert outs[0]["losses"][-1] < outs[0]["losses"][0]


def test_single_rank_plait_equals_reference():
    outs = run_layout("parallel.microbatches=4")
    assert_parity(merge_ranks(outs), reference())


def test_bf16_close_to_fp32_reference():
    outs = run_layout("parallel.dp=2", "train.precision=bf16")
    ref = reference()
    assert_parity(merge_ranks(outs), ref, "bf16", init=initial_params())
    tol = PARITY_TOLERANCES["fp64"]["loss_rtol"]
    # bf16 really ran: its losses are not float64-exact
    assert any(abs(a - b) > tol * abs(b) for a, b in zip(outs[0]["losses"], ref.losses))


@pytest.mark.parametrize("mode, dp", LAYOUTS)
def test_ledger_one_step_moves_ring_all_reduce_of_gradients(mode, dp):
    outs = _run(mode, dp)
    n_params = sum(p.numel() for p in outs[0]["params"].values())
    grad_bytes = n_params * ELEMENT_BYTES
    for rank_out in outs:
        for step in range(4):
            grads = [r for r in rank_out["ledger"] if r["step"] == step and r["tag"] == "grads"]
            assert all(r["op"] == "all_reduce" and r["group_size"] == dp for r in grads)
            assert sum(r["payload"] for r in grads) == grad_bytes
            sent = sum(r["sent"] for r in grads)
            assert sent == pytest.approx(2 * (dp - 1) / dp * grad_bytes, rel=1e-12)
            assert sum(r["received"] for r in grads) == pytest.approx(sent, rel=1e-12)
            if mode == "naive":
                assert len(grads) == len(outs[0]["params"])
            else:  # 50 KiB buckets over a ~0.2 MB model: several buckets, each launched once
                assert 1 < len(grads) < len(outs[0]["params"])


def test_bucketed_overlaps_backward():
    """A bucket is still in flight (issued, not yet complete) when the next one is issued:
    communication overlaps the rest of backward. A naive (synchronous) run fails this: each
    of its all-reduces ends before the next begins (checked below)."""
    def in_flight_at_next_issue(outs):
        recs = sorted((r for r in outs[0]["ledger"] if r["step"] == 1 and r["tag"] == "grads"),
                      key=lambda r: r["start"])
        return sum(1 for a, b in zip(recs, recs[1:]) if b["start"] < a["end"]), len(recs)

    overlapped, n = in_flight_at_next_issue(_run("bucketed", 2))
    assert n > 2 and overlapped == n - 1  # every bucket but the last overlaps the next issue
    naive, _ = in_flight_at_next_issue(_run("naive", 2))
    assert naive == 0


# ---- scale-sensitive parity: plain SGD with clipping on, every strategy --------------------
# Adam is invariant to a constant gradient factor, so a gradient "summed instead of averaged"
# or a wrong clip coefficient can pass an AdamW check on the loss alone. With SGD the update
# is lr x coefficient x gradient: a factor k on the gradient shows in the grad norm (compared
# before clipping, at every step), and a wrong clip coefficient (clipping is active at every
# step: the norm stays above grad_clip) moves every parameter by it.
SGD = ("train.optimizer=sgd", "train.weight_decay=0", "train.grad_clip=0.5", "train.lr=1.0",
       "train.min_lr_ratio=1.0")
MOE = ("model.n_experts=4", "model.top_k=2", "model.expert_ffn_dim=32",
       "model.aux_loss_coef=0.01")
SGD_LAYOUTS = {
    "dp2": ("parallel.dp=2", "parallel.microbatches=2"),
    "dp4-naive": ("parallel.dp=4", "parallel.data_parallel=naive"),
    "dp2-zero1": ("parallel.dp=2", "parallel.zero=1"),
    "dp2-zero2": ("parallel.dp=2", "parallel.zero=2", "parallel.microbatches=2"),
    "dp2-zero3": ("parallel.dp=2", "parallel.zero=3"),
    "dp2-tp2-sp": ("parallel.dp=2", "parallel.tp=2", "parallel.sp=true"),
    "pp2": ("parallel.pp=2", "parallel.microbatches=4", "model.n_layers=4"),
    "cp2": ("parallel.cp=2",),
    "dp2-ep2": ("parallel.dp=2", "parallel.ep=2", *MOE),
}


@pytest.mark.parametrize("layout", SGD_LAYOUTS.values(), ids=SGD_LAYOUTS)
def test_sgd_with_clipping_parity(layout):
    outs = run_layout(*SGD, *layout)
    model = [s for s in layout if s.startswith("model.")]
    ref = reference(*SGD, *model)
    assert_parity(merge_ranks(outs), ref)
    assert min(ref.grad_norms) > 0.5  # clipping was active at every step
    assert ref.losses[-1] < ref.losses[0] - 0.05  # the updates are large enough to matter
