"""Cutting a model's tensors into buckets the way backward produces their gradients: the
one rule behind bucketed data parallel's all-reduces (data.py), ZeRO-1/2's units
(zero_units.py) and the planner's eager memory model of them (plait/plan/runtime_memory_sizes.py).
Plain numbers, no torch: the planner imports it without torch."""

from __future__ import annotations

from collections.abc import Sequence


def backward_runs(sizes: Sequence[float], cap: float, first_cap: float | None = None
                  ) -> list[list[int]]:
    """Indices of `sizes` (bytes, in forward order) cut into runs walking backward, as
    torch DDP buckets gradients: a run closes once its bytes reach `cap` (`first_cap` for
    the first run to close, DDP's small first bucket); what is left is the last run. Runs
    and the indices in each are in backward order."""
    runs: list[list[int]] = []
    current: list[int] = []
    size = 0.0
    for i in reversed(range(len(sizes))):
        current.append(i)
        size += sizes[i]
        if size >= (first_cap if first_cap is not None and not runs else cap):
            runs.append(current)
            current, size = [], 0.0
    if current:
        runs.append(current)
    return runs
