"""Injected bugs in what the published GPU numbers price beyond the kernels' FLOPs and
bytes (plait/plan/zero3_gpu.py), each caught by its tests."""

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


MUTANTS = [
    Mutant("plan-zero3-copy-out-once",
           "plait plan counts ZeRO-3's copy-out as a read only (half its bytes)",
           plan_zero3_copy_out_once,
           [GPU_COSTS + "test_zero3_copy_bytes_count_each_kernel"]),
]
