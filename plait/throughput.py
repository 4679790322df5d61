"""Throughput: the one definition of tokens/s behind every number plait prints.

    tokens/s = (global batch tokens per step x steps timed) / (sum of their step times)

- **Which tokens**: the global batch's, `global_batch x seq_len` per optimizer step: every
  input position of every sequence of the step, over all data-parallel replicas, counted
  once whatever the layout (a rank that holds a share of the model or of the sequence
  does not count its share; the extra target token each window reads is not counted).
  So one run's tokens/s reads the same on every rank, and two layouts of one job compare directly.
- **Which time**: the step time, the device's timer from the step's first micro-batch to
  its metrics (plait/train/loop.py); the total over the steps timed, so a slow step weighs
  what it cost (the harmonic mean of the per-step rates, not their arithmetic mean).
- **Warm-up**: a run's first step (allocator, caches, lazy initialisation) is left out when
  any other step exists (`warmup=1`); a one-step run is timed as it is. A per-step rate
  (a metrics row, a planner's predicted step) is the single step itself. Benchmarks that
  time many steps may leave out more (`warmup=`, their own constant, stated in each).

Used by: the metrics rows and the run summary (plait/train/loop.py), the final line and
the summary table (plait/train/progress.py), the planner's predicted tokens/s
(plait/plan/estimate.py) and the benchmarks' mean step times (benchmarks/common.py).
Standard library only, so that every layer may use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

WARMUP_STEPS = 1  # a run's first step is not timed when there are others


def tokens_per_step(global_batch: int, seq_len: int) -> int:
    """The tokens one optimizer step trains on: every position of the global batch."""
    return global_batch * seq_len


def timed_steps(step_times: Sequence[Any], warmup: int = WARMUP_STEPS) -> list[Any]:
    """The step times that count: all but the first `warmup`, unless that leaves none."""
    times = list(step_times)
    return times[warmup:] or times


def mean_step_time(step_times: Sequence[Any], warmup: int = WARMUP_STEPS) -> Any:
    """Mean of the timed steps (None without any)."""
    times = timed_steps(step_times, warmup)
    return sum(times) / len(times) if times else None


def tokens_per_second(tokens: int | Any, step_times: Sequence[Any],
                      warmup: int = WARMUP_STEPS) -> Any:
    """Tokens per second over the timed steps, `tokens` per step (None without any).
    Works on numbers and on the planner's arrays of step times alike."""
    times = timed_steps(step_times, warmup)
    return tokens * len(times) / sum(times) if times else None
