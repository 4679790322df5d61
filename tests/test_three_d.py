"""3-D parallelism: tensor (+ sequence) parallel inside each pipeline stage, data parallel
over both. Parity with the single-process reference, the P2P and TP ledger, bad input."""

import pytest
import torch
from helpers import ELEMENT_BYTES, config, reference, run_layout

from plait.schedule.lower import lower
from plait.schedule.registry import build_schedule
from plait.testing import assert_parity, merge_ranks

LAYERS, STEPS = "model.n_layers=4", "train.steps=2"


def _merged(outs):
    """One replica's full parameters: the union of its pp ranks' stages (tp gathered)."""
    params = {}
    for o in outs:
        for n, p in o["params"].items():
            if n in params:  # tp ranks of one stage gather the same full tensors
                assert torch.equal(params[n], p), n
            params[n] = p
    return params


def _check(name, outs, replicas=1):
    ref = reference(LAYERS, STEPS)
    per = len(outs) // replicas
    for i in range(replicas):  # the mesh's dp is outermost: replica i is ranks [i*per, ...)
        replica = outs[i * per:(i + 1) * per]
        assert set(_merged(replica)) == set(ref.params), name
        assert_parity(merge_ranks(replica), ref, "fp64")
    for o in outs:  # every rank logs the same loss and the same mesh-wide grad norm
        assert o["losses"] == outs[0]["losses"]
        assert [m["grad_norm"] for m in o["metrics"]] == pytest.approx(
            [m["grad_norm"] for m in outs[0]["metrics"]], rel=1e-12)
    # clipping was active (max norm 0.5): a wrong norm would show in the parameters
    assert all(m["grad_norm"] > 0.5 for m in outs[0]["metrics"])


# pp2 x tp2 (+SP) under every schedule: rows of the parity matrix (tests/test_matrix.py
# pairs every schedule with tp2 and tp2+SP); here the 8-rank dp x pp x tp layout


def test_dp2_pp2_tp2_zero1_parity():
    outs = run_layout(LAYERS, STEPS, "parallel.dp=2", "parallel.pp=2", "parallel.tp=2",
                      "parallel.sp=true", "parallel.zero=1", "model.tie_embeddings=false",
                      "parallel.microbatches=2")
    _check("dp2 pp2 tp2 sp zero1", outs, replicas=2)


@pytest.mark.parametrize("sp", [False, True])
def test_ledger_p2p_and_tp_bytes(sp):
    tp, pp, m = 2, 2, 4
    sets = [LAYERS, "train.steps=1", f"parallel.pp={pp}", f"parallel.tp={tp}",
            f"parallel.sp={sp}", "parallel.schedule=1f1b", f"parallel.microbatches={m}"]
    outs = run_layout(*sets)
    cfg = config(*sets)
    b, s, h = cfg.micro_batch_size(), cfg.train.seq_len, cfg.model.dim
    # the boundary carries (mbs, seq/t, dim) with SP
    act = b * s * h * ELEMENT_BYTES // (tp if sp else 1)
    sched = lower(build_schedule("1f1b", pp, m))
    bsh = b * s * h * ELEMENT_BYTES
    ring_ar = 2 * (tp - 1) / tp * bsh
    for rank, o in enumerate(outs):
        me = rank // tp  # pp coordinate: tp is innermost
        p2p = [x for x in o["ledger"] if x["tag"] == "pp"]
        assert all(x["dim"] == "pp" for x in p2p)
        sends = sum(1 for a in sched.actions[me] if a.kind.startswith("SEND"))
        recvs = sum(1 for a in sched.actions[me] if a.kind.startswith("RECV"))
        assert sum(x["sent"] for x in p2p) == sends * act == m * act
        assert sum(x["received"] for x in p2p) == recvs * act
        recs = [r for r in o["ledger"] if r["tag"].startswith("tp.layers.")]
        held = range(2 * me, 2 * me + 2)  # 4 layers, 2 per stage
        assert {int(r["tag"].split(".")[2]) for r in recs} == set(held)
        for layer in held:
            for phase in ("fwd", "bwd"):
                mine = [r for r in recs if r["tag"].startswith(f"tp.layers.{layer}.")
                        and r["tag"].endswith(phase)]
                assert all(r["dim"] == "tp" and r["payload"] == bsh for r in mine)
                assert sorted(r["op"] for r in mine) == (
                    sorted(["all_gather", "reduce_scatter"] * 2 * m) if sp
                    else ["all_reduce"] * 2 * m)
                assert sum(r["sent"] for r in mine) == pytest.approx(2 * m * ring_ar)
        print(f"\nrank {rank}: P2P sent {sends} x {act} B = {sends * act} B/step; "
              f"TP per layer per phase {2 * m * ring_ar:.0f} B")


def test_tp_pp_bad_input_names_the_fix():
    # every problem at once: SP needs seq_len % tp == 0 (the boundary carries seq/t), and
    # ZeRO over the pipeline's stages still needs untied embeddings whatever tp is
    problems = config(LAYERS, "parallel.dp=2", "parallel.pp=2", "parallel.tp=2",
                      "parallel.sp=true", "parallel.zero=2", "train.seq_len=31",
                      "model.tie_embeddings=true", "parallel.microbatches=2").validate(8)
    assert any("seq_len" in p and "multiple of 2" in p for p in problems), problems
    assert any("tie_embeddings=false" in p for p in problems), problems
    assert not any("tensor and pipeline" in p for p in problems)
