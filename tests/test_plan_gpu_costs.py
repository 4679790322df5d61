"""What a GPU step pays that the published GPU numbers price beyond GEMMs, attention and
the memory-bound kernels: ZeRO-3's copy kernels and its exposed first gather and last
reduce-scatter (plait/plan/zero3_gpu.py), and compute slowed beside the collectives it
hides (plait/plan/overlap_slowdown.py)."""

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
