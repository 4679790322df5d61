"""The figures of a pipeline lay-out (`simulate.simulate`'s result): step time, bubble per
rank and overall, busy time, idle inside each rank's span, and across several steps the
steady state; and each compute's event. Bit-exact sums: the golden tests
(tests/test_schedule_oracle.py) hold them to the last bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import cycle
from operator import sub

from plait.schedule.ir import Action, Schedule, peak_activations

Event = tuple[str, int, int, float, float]  # (kind, stage, microbatch, start, end)


@dataclass
class SimResult:
    step_time: float
    bubble_fraction: float  # idle / (pp * step_time) over all ranks (mean idle fraction)
    bubble_per_rank: list[float]  # idle fraction of step_time, per rank
    busy_per_rank: list[float]  # compute time per rank
    peak_activations: list[int]  # micro-batch activations in flight per rank
    events: list[list[Event]]  # per rank: (kind, stage, mb, start, end), every step's
    # idle time between each rank's first and last action: the zero-bubble paper's and
    # the DeepSeek-V3 report's ("parallelogram") bubble, what a step costs when the next
    # step's forwards start as soon as a rank is done (Qi et al. 2023, section 4)
    span_idle_per_rank: list[float] = field(default_factory=list)
    # --- several steps (`simulate(..., steps=K)`); the fields above are the first step's
    steps: int = 1
    optimizer_sync: str = "barrier"
    step_ends: list[float] = field(default_factory=list)  # when each step's last compute ends
    # the steady state, steps 2..K: (step_ends[-1] - step_ends[0]) / (K - 1), and the
    # bubble of that per-step time (None for one step)
    steady_step_time: float | None = None
    steady_bubble_fraction: float | None = None


def events_of(queues: list[list[Action | None]], starts: list[list[float]],
            ends: list[list[float]]) -> list[list[Event]]:
    """Per rank (kind, stage, mb, start, end) of every compute, every step in turn."""
    out = []
    for q, st, en in zip(queues, starts, ends):
        # a queue's None posts a batch of transfers, a "C" is post-validation's check
        computes = [a for a in q if a is not None and a[0] != "C"]
        out.append([(k, s, mb, a, b) for (k, s, mb, _), a, b in
                    zip(cycle(computes), st, en)] if computes else [])
    return out


def result_of(schedule: Schedule, starts: list[list[float]], ends: list[list[float]],
              per_step: list[int], steps: int = 1, optimizer_sync: str = "barrier",
              step_ends: list[float] | None = None,
              events: list[list[Event]] | None = None) -> SimResult:
    """The figures of a lay-out: per rank the start and end of each compute, in order,
    `per_step` of them a step (step 1's first). Sums run in event order, as
    `sum(end - start for each event)` does, so that every figure is bit-exact."""
    first_s = starts if steps == 1 else [s[:k] for s, k in zip(starts, per_step)]
    first_e = ends if steps == 1 else [e[:k] for e, k in zip(ends, per_step)]
    step = max((e[-1] for e in first_e if e), default=0.0)
    busy = [sum(map(sub, e, s)) for s, e in zip(first_s, first_e)]
    per_rank = [(step - b) / step if step > 0 else 0.0 for b in busy]
    step_ends = step_ends or [step]
    steady = steady_bubble = None
    if steps > 1:
        steady = (step_ends[-1] - step_ends[0]) / (steps - 1)
        steady_bubble = sum((steady - b) / steady if steady > 0 else 0.0
                            for b in busy) / schedule.pp
    return SimResult(
        step_time=step,
        bubble_fraction=sum(per_rank) / schedule.pp,
        bubble_per_rank=per_rank,
        busy_per_rank=busy,
        peak_activations=peak_activations(schedule),
        events=events if events is not None else [[] for _ in starts],
        span_idle_per_rank=[(e[-1] - s[0]) - b if e else 0.0
                            for s, e, b in zip(first_s, first_e, busy)],
        steps=steps, optimizer_sync=optimizer_sync, step_ends=step_ends,
        steady_step_time=steady, steady_bubble_fraction=steady_bubble,
    )
