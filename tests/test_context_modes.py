"""Context parallel's all-to-all modes: Ulysses (`a2a`) with KV heads repeated for more
ranks than KV heads, and the hierarchical mode; parity with the single-process run, the
ledger's bytes per layer against the formula and the planner's, bad input. The rows of
tests/matrix.py's LONG_CONTEXT_ROWS compose them with dp, tp + SP, pp, ZeRO-3 and MoE."""

import pytest
from helpers import ELEMENT_BYTES, config, reference, run_layout

from plait.ledger import data_bytes_by_dim
from plait.plan import estimate_config
from plait.plan.comm.rank import bytes_by_dim
from plait.testing import assert_parity, merge_ranks

KV1 = ("model.n_kv_heads=1",)  # one KV head repeated for 4 ranks


def _bytes(ledger, tag_end):
    recs = [r for r in ledger if r["tag"].startswith("cp.layers.") and r["step"] == 1
            and r["tag"].endswith(tag_end)]
    return sum(r["payload"] for r in recs), sum(r["sent"] for r in recs), len(recs)


def test_a2a_with_one_kv_head_on_four_ranks():
    """cp=4 > 1 KV head: parity with the reference every step, and per layer and
    micro-batch each all-to-all carries a rank's q and its KV head repeated 4 times
    (forward in, and its gradient back) and the output (out, and its gradient)."""
    micro = 2
    sets = ["parallel.cp=4", "parallel.cp_mode=a2a", *KV1, f"parallel.microbatches={micro}"]
    outs = run_layout(*sets)
    assert_parity(merge_ranks(outs), reference(*KV1), "fp64")
    cfg = config(*sets)
    m, cp = cfg.model, 4
    tokens = cfg.micro_batch_size() * cfg.train.seq_len // cp
    qkv = tokens * (m.n_heads * m.head_dim + 2 * cp * m.head_dim) * ELEMENT_BYTES  # KV head x4
    out = tokens * m.n_heads * m.head_dim * ELEMENT_BYTES
    calls = micro * m.n_layers
    for o in outs:
        for end, size in ((".qkv", qkv), (".qkv.grad", qkv), (".out", out),
                          (".out.grad", out)):
            payload, sent, n = _bytes(o["ledger"], end)
            assert (payload, n) == (calls * size, calls), (end, payload, n)
            assert sent == pytest.approx(calls * size * (cp - 1) / cp)
    planned = sum(float(c.size * c.count) for c in estimate_config(cfg).collectives
                  if c.dim == "cp")
    assert planned == pytest.approx(_bytes(outs[0]["ledger"], "")[0])
    print(f"\na2a cp=4, 1 KV head: {qkv} B q+K/V, {out} B output per layer and micro-batch")


def test_a2a_refused_where_heads_do_not_split():
    text = "\n".join(config("parallel.cp=4", "parallel.tp=2", "parallel.cp_mode=a2a")
                     .validate(8))
    assert "splits the 2 query heads of a tp rank" in text and "cp_mode ring" in text
    # 3 KV heads over 2 ranks: each repeated twice (6, one a query head)
    assert config("parallel.cp=2", "parallel.cp_mode=a2a", "model.n_heads=6",
                  "model.dim=96", "model.n_kv_heads=3").validate(2) == []
    assert config("parallel.cp=4", "parallel.cp_mode=a2a", *KV1).validate(4) == []


def test_hierarchical_all_to_all_pairs_and_ring_across():
    """cp=4 as 2 all-to-all groups of 2 and a ring of 2 across them, one KV head repeated
    for the groups: parity every step; the all-to-alls stay in their group (`cp_a2a`), the
    ring's K/V hops cross between groups (`cp_ring`) carrying a group's whole sequence
    share of a head group, (ring - 1) hops forward and 2 (ring - 1) backward; the planner's
    bytes per dim equal the ledger's."""
    micro, a = 2, 2
    sets = ["parallel.cp=4", "parallel.cp_mode=hierarchical", f"parallel.cp_a2a={a}", *KV1,
            f"parallel.microbatches={micro}"]
    outs = run_layout(*sets)
    assert_parity(merge_ranks(outs), reference(*KV1), "fp64")
    cfg = config(*sets)
    m, ring = cfg.model, 4 // a
    tokens = cfg.micro_batch_size() * cfg.train.seq_len // 4
    # a group's tokens, 2 KV heads / a, K+V
    kv_chunk = tokens * a * 1 * 2 * m.head_dim * ELEMENT_BYTES
    calls = micro * m.n_layers
    for o in outs:
        hops = [r for r in o["ledger"] if r["step"] == 1 and r["dim"] == "cp_ring"
                and r["op"] == "send"]
        assert sum(r["payload"] for r in hops) == calls * 3 * (ring - 1) * kv_chunk
        a2a = {r["dim"] for r in o["ledger"] if r["op"] == "all_to_all"}
        assert a2a == {"cp_a2a"}
    planned = bytes_by_dim(estimate_config(cfg).collectives, 1)
    got = data_bytes_by_dim([r for r in outs[0]["ledger"] if r["step"] == 1])
    for dim in ("cp_a2a", "cp_ring"):
        assert planned[dim] == pytest.approx(got[dim]), dim


def test_planner_prices_every_mode_and_chooses():
    """Llama 3 8B at 1M tokens, cp=16 over two nodes of 8 H100s: the hierarchical mode's
    has 2 positions (groups of 8, the all-to-all on NVLink): 1 hop across nodes where the
    ring has 15, each the same bytes (a group's 8 ranks' tokens of 1/8 of the KV heads);
    a2a is refused where the heads do not split; the choice is the fastest that fits."""
    from plait.plan.basis import Layout, Training
    from plait.plan.calibration import EFFICIENCY
    from plait.plan.hardware import GPUS, Cluster
    from plait.plan.search import search
    from plait.plan.sequence_modes import choose, price_modes
    from plait.plan.shape import from_preset

    shape, cluster = from_preset("llama3-8b", 2**20), Cluster(GPUS["h100-sxm"], 64)
    lay = search(shape, cluster, Training(4), EFFICIENCY, top=1).top[0].layout
    assert (lay.sizes["cp"], lay.sizes["tp"]) == (16, 1)
    prices = {p.mode: p for p in price_modes(shape, cluster, Training(4), lay, EFFICIENCY)}
    ring, hier = prices["ring"], prices["hierarchical"]
    assert hier.degree == 8 and ring.bytes_intra == 0 and hier.bytes_intra > 0
    assert hier.bytes_inter == pytest.approx(ring.bytes_inter / 15)
    pick = choose(list(prices.values()))
    assert pick.step_time == min(p.step_time for p in prices.values() if p.fits)
    narrow = Layout({"cp": 16, "tp": 4}, mbs=1, zero=2, recompute="full")
    a2a = next(p for p in price_modes(shape, cluster, Training(4), narrow, EFFICIENCY)
               if p.mode == "a2a")
    assert "8 heads a tp rank do not split 16 ways" in a2a.problem
