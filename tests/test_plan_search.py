"""Search: valid layouts only, ranked, consistent with one-layout evaluation."""

import pytest

from plait.plan import bubble
from plait.plan.calibration import EFFICIENCY
from plait.plan.comm import price
from plait.plan.estimate import Layout, Training, evaluate
from plait.plan.hardware import Cluster, get_gpu
from plait.plan.search import PlanError, layout_problems, numeric_candidates, search
from plait.plan.shape import from_preset


def _check_valid(shape, cluster, train, est):
    lay = est.layout
    assert lay.tp * lay.pp * lay.dp * lay.cp == cluster.n_gpus
    assert shape.heads % lay.tp == 0
    assert train.global_batch % (lay.dp * lay.mbs) == 0
    assert lay.tp <= cluster.gpus_per_node
    assert layout_problems(shape, cluster, train, lay) == []
    assert bool(est.fits)


def test_search_llama8b_64_h100():
    shape, cluster, train = from_preset("llama3-8b"), Cluster(get_gpu("h100-sxm"), 64), \
        Training(256)
    res = search(shape, cluster, train, EFFICIENCY, top=5)
    assert res.considered > 100 and 0 < res.feasible <= res.considered
    times = [float(e.step_time) for e in res.top]
    assert times == sorted(times) and len(res.top) == 5
    for e in res.top:
        _check_valid(shape, cluster, train, e)
        # the shown numbers are the one-layout evaluation's numbers
        again = evaluate(shape, cluster, train, e.layout, EFFICIENCY, simulate=True)
        assert float(again.step_time) == pytest.approx(float(e.step_time))
        assert float(again.memory_total) <= cluster.gpu.hbm_bytes * train.mem_limit_frac


def test_search_moe_uses_valid_ep():
    shape, cluster, train = from_preset("mixtral-8x7b", seq=4096), \
        Cluster(get_gpu("h100-sxm"), 128), Training(512)
    res = search(shape, cluster, train, EFFICIENCY, top=3)
    for e in res.top:
        _check_valid(shape, cluster, train, e)
        assert shape.experts % e.layout.ep == 0 and (e.layout.dp * e.layout.cp) % e.layout.ep == 0


def test_candidates_respect_divisibility():
    shape, cluster, train = from_preset("llama3-70b"), Cluster(get_gpu("h100-sxm"), 96), \
        Training(384)
    c = numeric_candidates(shape, cluster, train)
    assert ((c["tp"] * c["cp"] * c["pp"] * c["dp"]) == 96).all()
    assert (384 % (c["dp"] * c["mbs"]) == 0).all()
    assert (c["pp"] <= shape.layers).all() and (c["tp"] <= 8).all()


def test_405b_search_runs_and_counts():
    res = search(from_preset("llama3-405b"), Cluster(get_gpu("h100-sxm"), 16384),
                 Training(2048), EFFICIENCY, top=3)
    assert res.considered > 10_000
    assert res.top and float(res.top[0].mfu) < 0.7  # an MFU above 70 % would be a bug


def test_nothing_fits_reports_closest():
    res = search(from_preset("llama3-405b"), Cluster(get_gpu("a100-40gb"), 8), Training(8),
                 EFFICIENCY)
    assert res.top == [] and res.feasible == 0
    assert float(res.closest.memory_total) > 40e9


def test_no_divisible_layout():
    with pytest.raises(PlanError, match="no layout"):
        search(from_preset("tiny"), Cluster(get_gpu("h100-sxm"), 7), Training(1), EFFICIENCY)


def test_layout_problems_name_the_fix():
    shape, cluster, train = from_preset("llama3-8b"), Cluster(get_gpu("h100-sxm"), 64), \
        Training(64)
    probs = layout_problems(shape, cluster, train, Layout(tp=8, pp=4, dp=4))
    assert any("does not multiply to the GPU count 64" in p for p in probs)
    probs = layout_problems(shape, cluster, train, Layout(tp=8, pp=2, dp=4, schedule="interleaved",
                                                          v=1))
    assert any("interleaved needs v>=2" in p for p in probs)


def test_ring_all_reduce_and_tree():
    # 1 GB over 8 ranks at 100 GB/s, no latency: 2 * 7/8 * 10 ms
    t, tree = price.all_reduce(1e9, 8, 100e9, 0.0)
    assert float(t) == pytest.approx(2 * 7 / 8 * 1e9 / 100e9) and not bool(tree)
    # a tiny message over many ranks: tree (log n latency) beats ring (n latency)
    t, tree = price.all_reduce(1e3, 1024, 100e9, 10e-6)
    assert bool(tree) and float(t) < 2 * 1023 * 10e-6
    assert float(price.gather_like(1e9, 4, 100e9, 0.0)) == pytest.approx(3 / 4 * 1e-2)
    assert bool(price.intra_node(1, 8, 8)) and not bool(price.intra_node(8, 2, 8))


def test_closed_form_matches_simulator_for_1f1b():
    f, i, w = 1.0, 1.2, 0.8
    sim = bubble.simulate_pipeline("1f1b", 4, 16, 1, [f] * 4, [i] * 4, [w] * 4, 0.0)
    assert sim["source"] == "simulator"
    assert sim["step"] == pytest.approx(float(bubble.closed_form("1f1b", 4, 16, 1, f, i, w, 0)))
    # long runs are extrapolated from two shorter simulations: exact for 1F1B
    long = bubble.simulate_pipeline("1f1b", 32, 2048, 1, [f] * 32, [i] * 32, [w] * 32, 0.0)
    assert "extrapolated" in long["source"]
    assert long["step"] == pytest.approx(float(bubble.closed_form("1f1b", 32, 2048, 1, f, i,
                                                                  w, 0)))


def test_the_search_chooses_the_mesh_order_and_says_so():
    """Two nodes of two GPUs, a model too wide for tp (one head) and of two layers:
    pp=2 x dp=2 is best, and with dp's gradient all-reduce (1.5 B parameters' gradients)
    far larger than pp's activations (8 x 128 tokens of width 4096), dp inside a node and
    pp across beats the default order (pp inside, dp across). The search finds it, the
    shown numbers are that order's, and plait plan names the order; on one node every
    order is the same and none is tried."""
    from dataclasses import replace

    from plait.config import DEFAULT_ORDER
    from plait.plan.search import distinct_orders, order_notes

    shape = replace(from_preset("llama3-8b", 128), heads=1, kv_heads=1, layers=2)
    cluster, train = Cluster(get_gpu("h100-sxm", gpus_per_node=2), 4), Training(8)
    best = search(shape, cluster, train, EFFICIENCY, top=2).top[0]
    lay = best.layout
    assert (lay.tp, lay.pp, lay.dp) == (1, 2, 2)
    assert lay.order.index("dp") < lay.order.index("pp")  # dp inside a node
    assert float(evaluate(shape, cluster, train, lay, EFFICIENCY, simulate=True).step_time) \
        == pytest.approx(float(best.step_time))
    default = evaluate(shape, cluster, train, replace(lay, order=DEFAULT_ORDER), EFFICIENCY,
                       simulate=True)
    assert float(default.step_time) > 2 * float(best.step_time)
    assert {c.dim: bool(c.intra) for c in best.collectives}["dp"]
    note = order_notes(best)
    assert note and note[0].startswith(f"Mesh order recommended: {','.join(lay.order)}")
    assert "across nodes: pp" in note[0]
    assert order_notes(default) == []
    # orders that build the same groups count once; one node or ep > 1: the default only
    assert len(distinct_orders(Layout(tp=2, dp=2), 2)) == 2
    assert len(distinct_orders(Layout(tp=2, pp=2, dp=2), 2)) == 6
    assert distinct_orders(Layout(tp=2, dp=2), 4) == [DEFAULT_ORDER]
    assert distinct_orders(Layout(dp=4, ep=2), 2) == [DEFAULT_ORDER]
