"""Float8 training (`train.precision = "fp8"`, plait/model/fp8.py, plait/parallel/fp8.py):
the numerics against their formulas and torch's float8 kernel, which layers turn float8,
the loss against bf16 over 100 steps, and the refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import config, run_layout

from plait.config import load_config
from plait.ledger import data_bytes_by_dim
from plait.model.fp8 import (
    E4M3,
    E5M2,
    emulated_scaled_mm,
    float8_linear,
    scale_for,
    to_fp8,
)
from plait.model.transformer import build_model
from plait.parallel.fp8 import AMAX_TAG, apply_float8, float8_linears, is_float8
from plait.plan import estimate_config
from plait.plan.comm.rank import bytes_by_dim, rank_bytes_by_dim
from plait.testing import FP8_LOSS_RTOL, loss_gap

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 24, 64, generator=gen) * 3).bfloat16()
    w = (torch.randn(48, 64, generator=gen) * 0.02).bfloat16()
    g = (torch.randn(2, 24, 48, generator=gen) * 1e-4).bfloat16()
    return x, w, g


@pytest.mark.parametrize("b_dtype", [E4M3, E5M2])
def test_emulation_equals_the_cpu_kernel(b_dtype):
    """The emulated GEMM against torch._scaled_mm on CPU (fp32 out: only the order of the
    fp32 sums may differ; bf16 out: the same values)."""
    x, w, _ = _inputs()
    a = to_fp8(x.reshape(-1, 64), scale_for(x.abs().amax(), b_dtype), b_dtype)
    sw = scale_for(w.abs().amax(), E4M3)
    b = to_fp8(w, sw, E4M3).t()
    ai, bi = torch.tensor(0.37), 1 / sw
    for out in (torch.float32, torch.bfloat16):
        kernel = torch._scaled_mm(a, b, scale_a=ai, scale_b=bi, out_dtype=out)
        emulated = emulated_scaled_mm(a, b, ai, bi, out)
        tol = 1e-6 if out == torch.float32 else 4e-3
        assert (kernel.float() - emulated.float()).abs().max() <= tol * kernel.abs().max()


def test_float8_linear_is_the_recipe():
    """Forward: E4M3 x and w, each scaled so its amax lands on 448; backward: the output
    gradient in E5M2 scaled to 57344, times the same E4M3 w and x. Against the formulas
    written out, and within float8's error of the bf16 linear."""
    x, w, g = _inputs()
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = float8_linear(xl, wl)
    y.backward(g)
    sx, sw, sg = 448 / x.float().abs().max(), 448 / w.float().abs().max(), \
        57344 / g.float().abs().max()
    xq = (x.float() * sx).to(E4M3).float() / sx
    wq = (w.float() * sw).to(E4M3).float() / sw
    gq = (g.float() * sg).to(E5M2).float() / sg
    assert torch.equal(y, (xq @ wq.t()).bfloat16())
    assert torch.allclose(xl.grad.float(), (gq @ wq).bfloat16().float(), rtol=0, atol=0)
    dw = torch.einsum("bsn,bsk->nk", gq, xq)
    assert (wl.grad.float() - dw).abs().max() <= 1e-2 * dw.abs().max()
    exact = x.float() @ w.float().t()
    assert (y.float() - exact).norm() / exact.norm() < 0.08  # E4M3: 3 mantissa bits


def test_block_linears_turn_float8_and_the_rest_stays():
    """Every linear of every block turns float8 (names and parameters kept); the embedding,
    the LM head and the norms do not."""
    model = build_model(config().model, seed=0)
    names = dict(model.named_parameters())
    assert apply_float8([model], mesh=_one_rank()) == 7 * config().model.n_layers
    swapped = {n for n, m in model.named_modules() if is_float8(m)}
    assert swapped == {f"layers.{i}.{s}" for i in range(config().model.n_layers)
                       for s in ("attn.wq", "attn.wk", "attn.wv", "attn.wo",
                                 "mlp.w1", "mlp.w2", "mlp.w3")}
    assert dict(model.named_parameters()) == names
    assert isinstance(model.layers[0].attn.wq, torch.nn.Linear)


def _one_rank():
    class _Mesh:  # the one-rank mesh: every dim of size 1, no group needed
        @staticmethod
        def size(dim: str) -> int:
            return 1
    return _Mesh()


def test_fp8_refuses_moe_and_names_the_fix():
    problems = load_config(sets=["model_name=tiny-moe", "train.precision=fp8"]).validate(1)
    assert any("not built for MoE" in p and "--precision bf16" in p for p in problems)


@pytest.mark.slow  # 200 steps in one process: a measurement held to its bound
def test_loss_within_the_bound_of_bf16_over_100_steps():
    """100 steps of the tiny model in one process: fp8's loss against bf16's at every step
    within FP8_LOSS_RTOL (measured by benchmarks/fp8_loss.py, docs/parity.md)."""
    from fp8_loss import FP8_LOSS_RUN

    losses = {p: run_layout(*FP8_LOSS_RUN, "train.steps=100", f"train.precision={p}")[0]
              ["losses"] for p in ("bf16", "fp8")}
    worst, step, _ = loss_gap(losses["fp8"], losses["bf16"])
    assert 0 < worst <= FP8_LOSS_RTOL, (worst, step)
    assert losses["fp8"][-1] < 0.75 * losses["fp8"][0]  # it learns


def test_zero3_gathers_the_block_weights_in_float8():
    """ZeRO-3 under fp8: the block linears' weights all-gathered at one byte an element
    (half of bf16's two), the rest (embedding, head, norms) at two; each step's amaxes are
    a control collective of a few floats. The planner's bytes (plait plan --precision
    fp8) are the ledger's, byte for byte, every dim."""
    sets = ("model.tie_embeddings=false", "parallel.dp=2", "parallel.zero=3",
            "train.steps=2", "parallel.microbatches=2", "train.precision=fp8")
    step = [r for r in run_layout(*sets)[0]["ledger"] if r["step"] == 1]
    cfg = config(*sets)
    planned = bytes_by_dim(estimate_config(cfg).collectives, 1)
    assert planned == data_bytes_by_dim(step) == rank_bytes_by_dim(cfg, 0)
    model = build_model(config(*sets).model, seed=0, device="meta")
    linear = sum(m.weight.numel() for m in float8_linears(model))
    rest = sum(p.numel() for p in model.parameters()) - linear
    gathered = sum(r["payload"] for r in step if r["tag"].startswith("params"))
    assert gathered == 2 * 2 * (linear * 1 + rest * 2)  # (forward + backward) x 2 micro
    amax = [r for r in step if r["tag"] == AMAX_TAG]
    assert amax and sum(r["payload"] for r in amax) < 1e-3 * gathered
