"""Injected bugs in what the published GPU numbers price beyond the kernels' FLOPs and
bytes (plait/plan/zero3_gpu.py, plait/plan/overlap_slowdown.py), each caught by its tests."""

from __future__ import annotations

from tests.mutant_kit import Mutant

GPU_COSTS = "tests/test_plan_gpu_costs.py::"


def plan_zero3_copy_out_once():
    """ZeRO-3's copy-out reads the gathered buffer but writes nothing."""
    from plait.plan import zero3_gpu

    original = zero3_gpu.copy_bytes

    def read_only(train, params, gathered, gathered_bytes, n, rounds):
        return original(train, params, gathered, gathered_bytes, n, rounds) \
            - gathered_bytes * (n > 1)
    zero3_gpu.copy_bytes = read_only


def plan_overlap_slows_the_whole_collective():
    """Compute is slowed for each collective's whole time, its exposed part included."""
    from plait.plan import overlap_slowdown

    overlap_slowdown.hidden_seconds = lambda colls: sum(
        c.total for c in colls if c.dim not in overlap_slowdown.NOT_BESIDE)


MUTANTS = [
    Mutant("plan-zero3-copy-out-once",
           "plait plan counts ZeRO-3's copy-out as a read only (half its bytes)",
           plan_zero3_copy_out_once,
           [GPU_COSTS + "test_zero3_copy_bytes_count_each_kernel"]),
    Mutant("plan-overlap-whole-collective",
           "plait plan slows compute beside a collective's exposed seconds too",
           plan_overlap_slows_the_whole_collective,
           [GPU_COSTS + "test_compute_beside_hidden_collectives_runs_slower"]),
]
