"""The memory-bound kernels the published GPU numbers price (plait/plan/memory_bound.py):
bytes counted from the shape, the step's term built from them, the launch bound."""

from dataclasses import replace

import pytest

from plait.plan import memory_bound
from plait.plan.basis import Layout, Training
from plait.plan.calibration import EFFICIENCY
from plait.plan.estimate import MEMORY_BOUND_TERM, evaluate
from plait.plan.gpu_data import published
from plait.plan.hardware import GPUS, Cluster
from plait.plan.shape import from_preset


def test_layer_bytes_are_counted_from_the_shape():
    """llama3-8b, 4096 tokens, bf16: the norms read and write the hidden state (backward
    reads two, writes one), the residual adds read two and write one, RoPE reads and
    writes q and k, SwiGLU reads gate and up and writes one (backward reads three, writes
    two); sequence parallel runs the norms and adds on a tp-th of the tokens."""
    s = from_preset("llama3-8b", 4096)
    t, h, e, f, kv = 4096, s.hidden, 2, s.ffn, s.kv_dim
    x = t * h * e
    ks = memory_bound.layer_kernels(s, t, 1, False, e, "flash")
    assert sum(k.fwd_bytes for k in ks) == 4 * x + 6 * x + 2 * t * (h + kv) * e + 3 * t * f * e
    assert sum(k.bwd_bytes for k in ks) == 6 * x + 6 * x + 2 * t * (h + kv) * e + 5 * t * f * e
    ks = memory_bound.layer_kernels(s, t, 4, True, e, "flash")
    assert sum(k.fwd_bytes for k in ks) == pytest.approx(
        (4 * x + 6 * x) / 4 + (2 * t * (h + kv) * e + 3 * t * f * e) / 4)
    assert memory_bound.optimizer_bytes_per_param("bf16", "adam") == 24 + 2 + 2 + 2
    assert memory_bound.optimizer_bytes_per_param("fp32", "adam") == 16 + 4 + 4


def test_published_step_carries_the_memory_bound_term_and_fitted_does_not():
    """One H100 node, dp 8, one micro-batch: the term is the layers' kernels (forward and
    backward, each with its own bytes) and the loss's over the measured bandwidth; the
    fitted constants (and CPU profiles: hbm_fraction 0) keep their own pricing."""
    s = from_preset("llama3-8b", 8192)
    pub = published(GPUS["h100-sxm"])
    cluster, train = Cluster(pub.gpu, 8), Training(8)
    est = evaluate(s, cluster, train, Layout(dp=8, mbs=1, zero=1), pub.eff)
    bw = pub.gpu.hbm_bw * pub.eff.hbm_fraction
    assert bw == pytest.approx(2.90e12 * pub.training_rate, rel=1e-3)  # a streaming copy's
    ks = memory_bound.layer_kernels(s, 8192, 1, True, 2, "flash")
    loss = memory_bound.loss_kernels(s, 8192, 1, True, 2)
    want = (s.layers * sum(k.fwd_bytes + k.bwd_bytes for k in ks)
            + loss.fwd_bytes + loss.bwd_bytes) / bw
    assert float(est.time[MEMORY_BOUND_TERM]) == pytest.approx(want, rel=1e-9)
    fitted = evaluate(s, Cluster(GPUS["h100-sxm"], 8), train, Layout(dp=8, mbs=1, zero=1),
                      EFFICIENCY)
    assert MEMORY_BOUND_TERM not in fitted.time and not memory_bound.priced(EFFICIENCY)


def test_eager_launches_bound_a_small_pass_only():
    """16 tokens: the CPU issues an eager layer's kernels slower than the GPU runs them,
    so the eager stack's pass is longer than the fused one's; at 8192 tokens the GPU is
    the bound and both are their bytes over the bandwidth: the eager stack's longer by
    its operators' extra bytes (RMSNorm, RoPE, SwiGLU, the loss), every layer."""
    s = from_preset("llama3-8b", 8192)
    pub = published(GPUS["h100-sxm"])
    times = {}
    for tokens in (16, 8192):
        for fused in (True, False):
            train = Training(8, stack=replace(Training(8).stack, fused_kernels=fused))
            lay = Layout(dp=8, mbs=tokens / 8192, zero=1)
            est = evaluate(s, Cluster(pub.gpu, 8), train, lay, pub.eff)
            times[tokens, fused] = float(est.time[MEMORY_BOUND_TERM])
    assert times[16, False] > 1.5 * times[16, True]
    layer = memory_bound.layer_kernels(s, 8192, 1, False, 2, "flash")
    loss = memory_bound.loss_kernels(s, 8192, 1, False, 2)
    extra = s.layers * sum(sum(k.bytes(False)) - sum(k.bytes(True)) for k in layer) \
        + sum(loss.bytes(False)) - sum(loss.bytes(True))
    assert {k.name for k in layer if k.eager_bytes is not None} == {"norms (2)", "rope",
                                                                    "swiglu"}
    bw = memory_bound.achievable_bw(pub.gpu, pub.eff)
    assert times[8192, False] - times[8192, True] == pytest.approx(extra / bw, rel=1e-9)
    assert times[8192, False] > 2 * times[8192, True]
