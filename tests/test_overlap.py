"""Measured overlap: every ledger record holds how long the issuing rank was blocked by
its collective (exposed) beside issue-to-completion; the rest was hidden behind other work.

Structural facts, not timings: a synchronous call is exposed from issue to completion, so
its hidden time is exactly zero; an async one issued and waited for later was in flight
while the rank worked, so its hidden time is positive (at least the time until its wait)."""

import time

import pytest
import torch
from helpers import run_layout

from plait.comm import ops
from plait.config import ParallelConfig
from plait.mesh import ParallelMesh
from plait.testing import run_ranks


def _sync_and_async(rank, world):
    mesh = ParallelMesh.build(ParallelConfig(dp=world))
    ops.all_reduce(torch.ones(1000), mesh, "dp", tag="sync")
    handle = ops.all_reduce(torch.ones(1000), mesh, "dp", async_op=True, tag="async")
    time.sleep(0.05)  # the rank's "other work" while the collective is in flight
    handle.wait()
    return {r.tag: (r.seconds, r.blocked, r.hidden) for r in mesh.ledger.records}


def test_sync_call_is_all_exposed_async_call_hides_until_its_wait():
    for rec in run_ranks(_sync_and_async, 2):
        seconds, blocked, hidden = rec["sync"]
        assert blocked == seconds and hidden == 0.0
        seconds, blocked, hidden = rec["async"]
        assert hidden >= 0.05 and blocked < seconds
        assert hidden + blocked == pytest.approx(seconds)


def _grads(ledger):
    return [r for r in ledger if r["tag"] == "grads" and r["step"] >= 0]


def test_naive_dp_exposes_all_gradient_communication():
    out = run_layout("parallel.dp=2", "parallel.data_parallel=naive")
    for rank in out:
        recs = _grads(rank["ledger"])
        assert recs and all(r["blocked"] == r["end"] - r["start"] for r in recs)


def test_bucketed_dp_hides_buckets_behind_backward():
    out = run_layout("parallel.dp=2", "parallel.data_parallel=bucketed",
                     "parallel.bucket_mb=0.05")  # several buckets on the tiny model
    for rank in out:
        recs = [r for r in _grads(rank["ledger"]) if r["step"] == 1]
        assert len(recs) >= 3
        hidden = [r["end"] - r["start"] - r["blocked"] for r in recs]
        # every bucket but the last is issued while backward still runs, waited at the end
        assert sum(h > 0 for h in hidden) >= len(recs) - 1
        overlap = rank["summary"]["ledger"]["overlap_per_step"]["dp"]
        assert overlap["hidden"] > 0 and overlap["exposed"] > 0


def test_zero3_prefetch_gathers_are_hidden():
    out = run_layout("parallel.dp=2", "parallel.zero=3")
    for rank in out:
        gathers = [r for r in rank["ledger"]
                   if r["step"] == 1 and r["tag"].startswith("params:") and r["op"] == "all_gather"]
        hidden = [r["end"] - r["start"] - r["blocked"] for r in gathers]
        assert len(gathers) >= 4 and sum(h > 0 for h in hidden) >= len(gathers) // 2


def test_tensor_parallel_collectives_are_fully_exposed():
    out = run_layout("parallel.tp=2")
    for rank in out:
        recs = [r for r in rank["ledger"] if r["dim"] == "tp" and r["step"] >= 0]
        assert recs and all(r["blocked"] == r["end"] - r["start"] for r in recs)
        overlap = rank["summary"]["ledger"]["overlap_per_step"]["tp"]
        assert overlap["hidden"] == 0.0
        assert overlap["exposed"] == pytest.approx(overlap["seconds"])
