"""`plait plan --precision fp8` (plait/plan/fp8.py): the block weight GEMMs at the float8
peak and curve, the rest at bf16's; the casts as memory-bound bytes; bf16's states; ZeRO-3's
gathers and buffers with the block linears at one byte; the refusals."""

from dataclasses import replace

import numpy as np
import pytest
from test_plan_cli import plan

from plait.plan import fp8, memory_bound
from plait.plan.basis import Layout, Training, basis_of
from plait.plan.compute import gemm_time, gemm_weights, layer_gemms
from plait.plan.estimate import MEMORY_BOUND_TERM, evaluate
from plait.plan.gpu_data import published
from plait.plan.hardware import GPUS, Cluster
from plait.plan.shape import Shape, from_preset


@pytest.mark.parametrize("name", ["llama3-8b", "deepseek-v3", "tiny-mla"])
@pytest.mark.parametrize("tp", [1, 4])
def test_gemm_sides_are_the_layer_gemms(name, tp):
    """Each weight GEMM's input x output width is its weight: 2 x their sum is the layer's
    GEMM FLOPs a token (GQA and MLA, whole and split over tp)."""
    s = from_preset(name, 4096)
    if s.moe:  # the dense version of an MLA model: float8 is not built for MoE
        s = s.dense_version()
    sides = fp8.weight_gemm_sides(s, tp)
    flops = sum(f for _, f in layer_gemms(s, 1, tp))
    assert 2 * sum(k * o for _, k, o in sides) == pytest.approx(flops, rel=1e-12)
    assert gemm_weights(s, tp) == pytest.approx(flops / 2, rel=1e-12)


def _h100(gpus: int = 8):
    pub = published(GPUS["h100-sxm"])
    return pub, Cluster(pub.gpu, gpus)


def test_weight_gemms_at_the_float8_peak_the_rest_at_bf16s():
    """The layer's weight GEMMs at 1,979 TFLOP/s on the float8 curve (77.0 % isolated, times
    the training rate; half at 1.12e10 FLOPs); the attention core and the head as under
    bf16."""
    s = from_preset("llama3-8b", 4096)
    pub, cluster = _h100()
    lay = Layout(dp=8, zero=1)
    b16 = basis_of(s, cluster, Training(8), lay, pub.eff)
    b8 = basis_of(s, cluster, Training(8, "fp8"), lay, pub.eff)
    assert pub.gpu.peak_flops * pub.gpu.fp8_peak_ratio == pytest.approx(1979e12)
    curve = replace(pub.eff, gemm_max=0.770 * pub.training_rate, gemm_half=1.12e10)
    want = sum(gemm_time(f, pub.gpu, curve, 1979 / 989) for _, f in layer_gemms(s, 4096, 1))
    assert float(b8.lt.gemm_fwd) == pytest.approx(want, rel=1e-12)
    assert 0.45 < float(b8.lt.gemm_fwd / b16.lt.gemm_fwd) < 0.55
    assert float(b8.lt.attn_fwd) == float(b16.lt.attn_fwd)
    e16 = evaluate(s, cluster, Training(8), lay, pub.eff)
    e8 = evaluate(s, cluster, Training(8, "fp8"), lay, pub.eff)
    assert float(e8.step_time) < float(e16.step_time)
    assert float(e8.mfu / e16.mfu) == pytest.approx(float(e16.step_time / e8.step_time))


def test_casts_are_memory_bound_bytes():
    """Per weight GEMM: forward the input and weight (amax reads 2 bytes, the cast reads 2
    and writes 1), backward the output gradient (the same) and the input and weight again
    (a cast: 3); under ZeRO-3 the weights come gathered in float8. The step's
    memory-bound term grows by exactly those bytes over the measured bandwidth."""
    s = from_preset("llama3-8b", 4096)
    t, h, f, kv = 4096, s.hidden, s.ffn, s.kv_dim
    x = t * (h + h + h + f)
    g = t * ((h + 2 * kv) + h + 2 * f + h)
    w = h * (h + 2 * kv) + h * h + 3 * h * f
    k = fp8.cast_kernel(s, t, 1, 2, zero=1)
    assert (k.fwd_bytes, k.bwd_bytes) == (5 * (x + w), 5 * g + 3 * (x + w))
    k3 = fp8.cast_kernel(s, t, 1, 2, zero=3)
    assert (k3.fwd_bytes, k3.bwd_bytes) == (5 * x, 5 * g + 3 * x)
    pub, cluster = _h100()
    lay = Layout(dp=8, zero=1)
    extra = s.layers * (k.fwd_bytes + k.bwd_bytes) / memory_bound.achievable_bw(pub.gpu,
                                                                                pub.eff)
    e16 = evaluate(s, cluster, Training(8), lay, pub.eff)
    e8 = evaluate(s, cluster, Training(8, "fp8"), lay, pub.eff)
    assert float(e8.time[MEMORY_BOUND_TERM] - e16.time[MEMORY_BOUND_TERM]) == \
        pytest.approx(extra, rel=1e-9)


def test_states_are_bf16s_and_zero3_gathers_the_linears_at_one_byte():
    """Memory: the same parameters, gradients, optimizer states and activations as bf16;
    ZeRO-3's gathered-layer buffers (current and prefetched) smaller by the block
    linears' second byte; its parameter all-gathers move one byte a block-linear weight,
    two for the rest (embedding, head, norms); the gradients' reduce-scatters are bf16's."""
    s = from_preset("llama3-8b", 4096)
    pub, cluster = _h100()
    lay = Layout(dp=8, zero=3)
    e16 = evaluate(s, cluster, Training(8), lay, pub.eff)
    e8 = evaluate(s, cluster, Training(8, "fp8"), lay, pub.eff)
    for cat in ("parameters", "gradients", "optimizer states", "activations", "logits"):
        assert float(e8.memory[cat]) == float(e16.memory[cat]), cat
    linear = gemm_weights(s, 1)
    assert float(e16.memory["communication buffers"] - e8.memory["communication buffers"]) \
        == pytest.approx(2 * linear)
    ops = {e: {c.op: float(c.size * c.count) for c in x.collectives if c.dim == "dp"}
           for e, x in (("bf16", e16), ("fp8", e8))}
    gather = "all-gather (params, fwd+bwd)"
    gathers = 2  # the forward and the backward of its one micro-batch
    assert ops["bf16"][gather] - ops["fp8"][gather] == pytest.approx(
        gathers * s.layers * linear)
    assert ops["fp8"]["reduce-scatter (grads)"] == ops["bf16"]["reduce-scatter (grads)"]


def test_refusals_name_the_fix():
    """An A100 (no float8 tensor cores), the fitted constants, a MoE model: each refused
    with --precision bf16 named; an H100 plans, and prints its float8 numbers and terms."""
    base = ("--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--layout",
            "tp=1,pp=1,dp=8", "--seq", "1024", "--precision", "fp8")
    rc, out = plan(*base, "--gpu", "a100-80gb")
    assert rc == 2 and "no float8 tensor cores" in out and "--precision bf16" in out
    rc, out = plan(*base, "--gpu", "h100-sxm", "--efficiency", "fitted")
    assert rc == 2 and "--efficiency fitted" in out and "--precision bf16" in out
    rc, out = plan("--model", "mixtral-8x7b", "--gpus", "8", "--global-batch", "8",
                   "--seq", "1024", "--precision", "fp8")
    assert rc == 2 and "not built for MoE" in out and "--precision bf16" in out
    rc, out = plan(*base, "--gpu", "h100-sxm", "--explain")
    assert rc == 0 and "Float8 (--precision fp8)" in out and "1,979 TFLOP/s" in out
    assert "of the float8 peak" in out and "float8 amax + casts" in out  # --explain


def test_config_precision_fp8_plans_fp8():
    """A plait config's train.precision fp8 is planned as fp8 (from_config), not bf16."""
    from helpers import config

    from plait.plan.from_config import config_inputs

    assert config_inputs(config("train.precision=fp8"))[2].precision == "fp8"


def test_a_shape_without_mla_has_no_latent_gemms():
    s = Shape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=128, seq=16)
    assert [n for n, _, _ in fp8.weight_gemm_sides(s, 1)] == ["qkv", "out", "mlp in",
                                                               "mlp out"]
    assert np.isclose(2 * gemm_weights(s, 1), sum(f for _, f in layer_gemms(s, 1, 1)))
