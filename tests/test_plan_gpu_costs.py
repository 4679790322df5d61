"""What a GPU step pays that the published GPU numbers price beyond GEMMs, attention and
the memory-bound kernels: ZeRO-3's copy kernels and its exposed first gather and last
reduce-scatter (plait/plan/zero3_gpu.py), compute slowed beside the collectives it hides
(plait/plan/overlap_slowdown.py), a node-spanning group's NICs (plait/plan/comm/price.py),
fused attention's forward and backward rates (plait/plan/gpu_data.py) and the math
kernel's roofline (plait/plan/compute.py)."""

from dataclasses import replace

import pytest

from plait.plan import overlap_slowdown, zero3_gpu
from plait.plan.basis import Layout, Training
from plait.plan.calibration import EFFICIENCY
from plait.plan.comm import price
from plait.plan.estimate import evaluate
from plait.plan.gpu_data import published
from plait.plan.hardware import GPUS, Cluster
from plait.plan.shape import from_preset


def test_zero3_copy_bytes_count_each_kernel():
    """1000 parameters gathered twice (2 bytes each) over 4 ranks, one reduce-scatter: the
    copy-in reads the fp32 shard and writes it cast (2000 / 4 x (4 + 2)), the copy-out
    reads and writes the gathered buffer (2 x 4000), the reduce-scatter's copy-in reads
    the bf16 gradient and writes the reduce dtype (1000 x (2 + 2); fp32 reduce: 2 + 4),
    its shard is divided and added into the fp32 gradient (250 x (3 x 2 + 4)); one rank
    moves nothing."""
    train = Training(8)
    assert zero3_gpu.copy_bytes(train, 1000, 2000, 4000, 4, 1) == 3000 + 8000 + 4000 + 2500
    fp32_reduce = Training(8, precision="bf16-fp32grad")
    assert zero3_gpu.copy_bytes(fp32_reduce, 1000, 2000, 4000, 4, 1) == \
        3000 + 8000 + 6000 + 250 * 16
    assert zero3_gpu.copy_bytes(train, 1000, 2000, 4000, 1, 1) == 0


def test_published_zero3_step_pays_its_copies_and_its_exposed_ends():
    """llama3-8b on one H100 node, ZeRO-3 over 8, two micro-batches: the copies term is
    copy_bytes of the rank's parameters gathered before each forward and backward over
    the measured HBM bandwidth, and the embedding's first all-gather and last
    reduce-scatter are listed wholly exposed; ZeRO-1 and the fitted constants have
    neither."""
    s = from_preset("llama3-8b", 8192)
    pub = published(GPUS["h100-sxm"])
    cluster, train = Cluster(pub.gpu, 8), Training(16)
    est = evaluate(s, cluster, train, Layout(dp=8, mbs=1, zero=3), pub.eff)
    u, m = float(est.extra["rank_params"]), 2
    bw = pub.gpu.hbm_bw * pub.eff.hbm_fraction
    want = zero3_gpu.copy_bytes(train, u, 2 * m * u, 2 * m * u * 2, 8, m) / bw
    assert float(est.time[zero3_gpu.COPIES_TERM]) == pytest.approx(want, rel=1e-9)
    ends = [c for c in est.collectives if "unit" in c.op]
    assert [c.op for c in ends] == ["all-gather (first unit, params)",
                                    "reduce-scatter (last unit, grads)"]
    emb = s.embedding_params()
    t_ag = price.gather_like(emb * 2, 8, pub.gpu.nvlink_bw, pub.gpu.nvlink_alpha)
    assert float(ends[0].exposed) == pytest.approx(float(t_ag), rel=1e-9)
    assert float(ends[0].size) == emb * 2
    for lay, eff in ((Layout(dp=8, mbs=1, zero=1), pub.eff),
                     (Layout(dp=8, mbs=1, zero=3), EFFICIENCY)):
        other = evaluate(s, cluster, train, lay, eff)
        assert zero3_gpu.COPIES_TERM not in other.time
        assert not any("unit" in c.op for c in other.collectives)


def _collective(dim, total, exposed):
    return price.Collective(dim, "all-gather", 1.0, 1.0, 8, True, total, exposed, "")


def test_compute_beside_hidden_collectives_runs_slower():
    """Hidden seconds are each collective's time less its exposed time, the pipeline's
    sends left out; compute slowed by s does 1 / (1 + s) of its work in them, so the step
    grows by hidden x s / (1 + s), at most the compute's."""
    colls = [_collective("dp", 0.5, 0.1), _collective("tp", 0.2, 0.2),
             _collective("pp", 0.3, 0.0), _collective("cp", 0.1, 0.0)]
    assert float(overlap_slowdown.hidden_seconds(colls)) == pytest.approx(0.5)
    assert float(overlap_slowdown.slowdown_seconds(colls, 10.0, 0.25)) == pytest.approx(0.1)
    assert float(overlap_slowdown.slowdown_seconds(colls, 0.2, 0.25)) == pytest.approx(0.04)


def test_published_step_slows_compute_beside_its_hidden_collectives():
    """llama3-8b on one H100 node, ZeRO-1 over 8: the term is the hidden dp seconds x
    0.189 / 1.189 (the data file's measured mean); the fitted constants leave it out."""
    s = from_preset("llama3-8b", 8192)
    pub = published(GPUS["h100-sxm"])
    assert pub.eff.overlap_slowdown == 0.189
    cluster, train = Cluster(pub.gpu, 8), Training(16)
    est = evaluate(s, cluster, train, Layout(dp=8, mbs=1, zero=1), pub.eff)
    hidden = sum(float(c.total - c.exposed) for c in est.collectives if c.dim == "dp")
    assert hidden > 0
    assert float(est.time[overlap_slowdown.TERM]) == pytest.approx(hidden * 0.189 / 1.189)
    fitted = evaluate(s, cluster, train, Layout(dp=8, mbs=1, zero=1), EFFICIENCY)
    assert overlap_slowdown.TERM not in fitted.time


def test_a_node_spanning_group_crosses_on_its_ranks_nics():
    """ZeRO over 64 H100s (8 nodes): the group holds 8 ranks of each node, whose 8 NICs
    carry its rings (8 x 46 GB/s, at most NVLink's 370); with tp=8 inside each node the
    group holds 1 rank a node and crosses on 1 NIC; a node with one NIC for all its GPUs
    (--nics-per-node 1) crosses on 1 either way."""
    assert list(price.rails([64, 8, 2, 8], [64, 64, 16, 4], 8)) == [8, 1, 1, 8]
    assert list(price.rails([64, 32], [64, 64], 8, nics_per_node=2)) == [2, 2]
    s, pub = from_preset("llama3-8b", 8192), published(GPUS["h100-sxm"])
    nic, nvl = pub.gpu.internode_bw, pub.gpu.nvlink_bw

    def dp_bandwidth(gpu, lay):
        est = evaluate(s, Cluster(gpu, 64), Training(64), lay, pub.eff)
        (c,) = [c for c in est.collectives if c.op == "reduce-scatter (grads)"]
        assert not c.intra
        return c.size * (c.group - 1) / c.group / (c.time_each - (c.group - 1) * 1e-5)

    assert dp_bandwidth(pub.gpu, Layout(dp=64, zero=3)) == pytest.approx(min(8 * nic, nvl))
    assert dp_bandwidth(pub.gpu, Layout(tp=8, dp=8, zero=3)) == pytest.approx(nic)
    one_nic = replace(pub.gpu, nics_per_node=1)
    assert dp_bandwidth(one_nic, Layout(dp=64, zero=3)) == pytest.approx(nic)


def test_fused_attention_prices_forward_and_backward_at_their_rates():
    """A kernel's fraction of peak makes three forward times (the planner's forward +
    backward) equal the measured forward plus a backward of 2.5 x its FLOPs at the
    measured backward rate: cuDNN on an H100 at sequence 2048, 484 and 465 TFLOP/s of
    989; FlashAttention-2's 298 and 291. A fraction-of-peak sweep counted 1 + 2.5 (the
    A100's) scales by 3 / 3.5. An unknown kernel for a GPU is refused."""
    from plait.plan.gpu_data import attention_points

    cudnn = dict(attention_points("h100", "cudnn"))[2048.0]
    assert cudnn == pytest.approx(3 / (1 / 484 + 2.5 / 465) / 989, rel=1e-12)
    assert dict(attention_points("h100", "fa2"))[2048.0] == pytest.approx(
        3 / (1 / 298 + 2.5 / 291) / 989, rel=1e-12)
    assert attention_points("h100") == attention_points("h100", "cudnn")  # Hopper's default
    assert attention_points("h200", "fa3") == attention_points("h100", "fa3")
    assert dict(attention_points("a100"))[512.0] == pytest.approx(0.5 * 3 / 3.5, rel=1e-12)
    with pytest.raises(ValueError, match="no published fa3 sweep for the A100"):
        attention_points("a100", "fa3")


def test_math_attention_gemms_meet_the_hbm_roofline():
    """The math kernel's QK^T and PV on an A100 with head dim 96 (22B of Korthikanti et
    al.: 48 heads of 64 at width 6144, tp 8): FLOPs per byte about the head dim, under the
    A100's ridge (271 TFLOP/s over 1.61 TB/s, 168), so their time is their bytes over the
    achievable bandwidth; the fitted constants keep the GEMM curve."""
    from plait.plan.compute import attention_core_flops, layer_times, math_attention_bytes
    from plait.plan.shape import gpt_shape

    s = gpt_shape(48, 6144, 64, 2048)
    pub = published(GPUS["a100-80gb"])
    tokens = 4 * 2048
    moved = math_attention_bytes(s, tokens, 8)
    assert moved == 2 * (64 / 8) * (2 * tokens * 2048 + 2 * tokens * 2 * 96)
    assert attention_core_flops(s, tokens, 8, "math") / moved == pytest.approx(96, rel=0.1)
    lt = layer_times(s, tokens, 8, pub.gpu, pub.eff, 0.0, attention="math")
    assert lt.attn_fwd == pytest.approx(moved / (pub.gpu.hbm_bw * pub.eff.hbm_fraction))
    fitted = layer_times(s, tokens, 8, pub.gpu, EFFICIENCY, 0.0, attention="math")
    assert fitted.attn_fwd < lt.attn_fwd
