"""Goodput under failures (plait/plan/goodput.py) against a failure-injection simulation.

The simulation is written here from the model's assumptions alone (exponential failures
at rate 1/M; a segment of tau work + C checkpoint is lost when a failure lands in it; a
restart of R seconds, which a failure can interrupt too) and knows nothing of the closed
form. Seeded numpy draws: deterministic. 100,000 segments keep the estimate's relative
standard error near 0.3 %, so the 1.5 % tolerance is about five of them.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import plan_cli as plan

from plait.model.presets import PRESETS
from plait.plan.goodput import daly_interval, goodput, young_interval


def simulate(tau: float, c: float, m: float, r: float, segments: int, seed: int) -> float:
    """Useful share of wall time over `segments` checkpointed segments."""
    rng = np.random.default_rng(seed)

    def times_to_failure():  # exponential draws, a block at a time
        while True:
            yield from rng.exponential(m, size=65536).tolist()

    draw = times_to_failure()
    t, a = 0.0, tau + c
    for _ in range(segments):
        while (x := next(draw)) < a:
            t += x  # the failure: work since the last checkpoint lost, then a restart
            while (y := next(draw)) < r:
                t += y  # the restart failed too: again
            t += r
        t += a
    return segments * tau / t


CASES = [  # (C, M, R) in one unit of time; failures frequent enough to matter
    (0.05, 1.0, 0.1), (0.01, 1.0, 0.0), (0.2, 1.0, 0.3), (30.0, 3 * 3600.0, 600.0)]


@pytest.mark.parametrize("c,m,r", CASES)
def test_goodput_matches_the_simulation(c, m, r):
    for scale in (0.5, 1.0, 2.0):
        tau = scale * float(young_interval(c, m))
        sim = simulate(tau, c, m, r, 100_000, seed=27)
        assert sim == pytest.approx(float(goodput(tau, c, m, r)), rel=0.015), (scale, sim)


@pytest.mark.parametrize("c,m,r", CASES)
def test_young_and_daly_are_near_the_optimum(c, m, r):
    """The closed form peaks near Young's interval; Daly's is at least as good, and the best
    of a fine grid of intervals beats neither by more than 0.5 % of goodput."""
    ty, td = float(young_interval(c, m)), daly_interval(c, m)
    grid = np.linspace(0.05, 5, 2000) * ty
    best = float(np.max(goodput(grid, c, m, r)))
    gy, gd = float(goodput(ty, c, m, r)), float(goodput(td, c, m, r))
    assert gd >= gy - 1e-12
    assert best - gy < 0.005 and best - gd < 0.005
    assert gy > float(goodput(ty / 2, c, m, r)) and gy > float(goodput(2 * ty, c, m, r))


def test_simulation_prefers_young_over_far_intervals():
    c, m, r = 0.05, 1.0, 0.1
    ty = float(young_interval(c, m))
    at = {k: simulate(k * ty, c, m, r, 100_000, seed=5) for k in (0.25, 1.0, 4.0)}
    assert at[1.0] > at[0.25] and at[1.0] > at[4.0]


def test_first_order_waste():
    """Small C/M: waste ~ 2 sqrt(C / 2M) + R/M at Young's interval (Young 1974)."""
    c, m, r = 1e-4, 1.0, 1e-3
    g = float(goodput(young_interval(c, m), c, m, r))
    assert 1 - g == pytest.approx(2 * math.sqrt(c / (2 * m)) + r / m, rel=0.02)




BASE = ("--model", "llama3-8b", "--gpus", "64", "--global-batch", "512")


def test_plan_goodput_of_one_layout():
    """The checkpoint the planner sizes is plait's (docs/checkpoint.md: fp32 master + two
    Adam moments, 12 bytes per parameter, each element once); ZeRO-1 over dp = 8: each
    rank of a tp x pp slice writes 1/8 of the slice's states. MTBF per GPU x 64 GPUs is
    the same job as MTBF per job."""
    lay = ("--layout", "tp=4,pp=2,dp=8", "--zero", "1", "--ckpt-write-gbs", "0.5", "--json")
    rc, out = plan(*BASE, *lay, "--mtbf-hours", str(64 * 2.0))
    assert rc == 0, out
    doc = json.loads(out)
    gp = doc["layouts"][0]["goodput"]
    assert gp["checkpoint_bytes_total"] == 12 * doc["params"]
    assert gp["job_mtbf_s"] == pytest.approx(2 * 3600)
    cfg = PRESETS["llama3-8b"]  # the last pipeline rank: 16 layers, final norm, LM head
    h, kv = cfg.dim, cfg.n_kv_heads * cfg.head_dim
    layer = (2 * h * h + 2 * h * kv + 3 * h * cfg.ffn_dim) / 4 + 2 * h  # tp = 4; the
    last_rank = 16 * layer + h + cfg.vocab_size * h / 4  # norm gains whole on every tp rank
    assert gp["checkpoint_bytes_per_rank"] == pytest.approx(12 * last_rank / 8, rel=1e-12)
    assert gp["checkpoint_s"] == pytest.approx(gp["checkpoint_bytes_per_rank"] / 0.5e9)
    step = doc["layouts"][0]["step_time_s"]
    assert gp["interval_s"] == pytest.approx(gp["interval_steps"] * step)
    assert abs(gp["interval_s"] - gp["young_interval_s"]) <= step / 2 + 1e-9
    assert gp["goodput"] == pytest.approx(
        float(goodput(gp["interval_s"], gp["checkpoint_s"], 7200, 600)), rel=1e-12)
    rc, out2 = plan(*BASE, *lay, "--mtbf-hours", "2", "--mtbf-per", "job")
    assert json.loads(out2)["layouts"][0]["goodput"] == gp


def test_rank_by_goodput_orders_by_useful_tokens():
    """A slow writer (0.01 GB/s), failures every hour and a slow network (2 GB/s a NIC):
    ranked by throughput, a llama3-8b layout hybrid-sharded (ZeRO inside each node) comes
    first, with a checkpoint slower to write than ZeRO over 32's; ranked by goodput, the
    shown layouts are in order of useful tokens/s and the first has more of them than the
    fastest layout."""
    base = ("--model", "llama3-8b", "--gpus", "64", "--global-batch", "512", "--mtbf-hours",
            "1", "--mtbf-per", "job", "--ckpt-write-gbs", "0.01", "--internode-gbs", "2",
            "--top", "5", "--json")
    rc, out = plan(*base, "--rank-by", "goodput")
    assert rc == 0, out
    doc = json.loads(out)
    assert doc["ranked_by"] == "goodput"
    useful = [d["goodput"]["effective_tokens_per_s"] for d in doc["layouts"]]
    assert useful == sorted(useful, reverse=True)
    rc, out = plan(*base)
    by_speed = json.loads(out)
    assert "ranked_by" not in by_speed
    useful_by_speed = [d["goodput"]["effective_tokens_per_s"] for d in by_speed["layouts"]]
    # the ranking matters: the fastest gives way to one with more useful tokens/s
    assert useful[0] > useful_by_speed[0] and useful[0] >= max(useful_by_speed)
    assert doc["layouts"][0]["layout"] != by_speed["layouts"][0]["layout"]
