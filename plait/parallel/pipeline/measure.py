"""Measured pipeline timelines: bubble, the simulator's prediction for them, pictures.

Every rank's runtime records each compute action's start and end (`time.perf_counter`,
CLOCK_MONOTONIC: one clock for all processes of a machine). After training the records
are gathered over the pp group (ledgered, step -1, tag "timeline") and turned into:
  * the measured bubble of a step, with the simulator's definition: idle / (pp x span),
    where span runs from the first rank entering the step to the last compute ending;
  * the mean measured duration of F, I, W, B per stage, fed to `simulate()` (the one cost
    model), whose bubble is the prediction to compare with;
  * a Chrome trace and a PNG timeline of the last step, one row per rank.
The first step is left out when there are several (allocator and thread-pool warm-up).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean

import torch

from plait import comm
from plait.mesh import ParallelMesh
from plait.parallel.pipeline.draw import draw_timeline, to_chrome_trace
from plait.parallel.pipeline.ir import Schedule
from plait.parallel.pipeline.partition import Partition
from plait.parallel.pipeline.runtime import Event, PipelineRuntime
from plait.parallel.pipeline.simulate import Durations, SimResult, simulate

_KINDS = ("F", "B", "I", "W")


def gather_events(runtime: PipelineRuntime, mesh: ParallelMesh
                  ) -> list[list[tuple[float, float, list[Event]]]]:
    """Per step, per pp rank: (step start, step end, compute events)."""
    rows = []
    for step, (events, (t0, t1)) in enumerate(zip(runtime.steps_events, runtime.steps_window,
                                                  strict=True)):
        rows.append([step, -1, -1, -1, t0, t1])  # kind -1 marks the step window
        rows += [[step, _KINDS.index(k), s, mb, a, b] for k, s, mb, a, b in events]
    mine = torch.tensor(rows, dtype=torch.float64)
    n = mesh.size("pp")
    saved, mesh.ledger.step = mesh.ledger.step, -1  # not part of any training step
    try:
        counts = torch.zeros(n, dtype=torch.float64)
        comm.all_gather(counts, torch.tensor([float(len(rows))], dtype=torch.float64), mesh,
                        "pp", tag="timeline")
        width = int(counts.max())
        padded = torch.full((width, 6), float("nan"), dtype=torch.float64)
        padded[:len(rows)] = mine
        every = torch.empty(n * width, 6, dtype=torch.float64)
        comm.all_gather(every, padded, mesh, "pp", tag="timeline")
    finally:
        mesh.ledger.step = saved
    steps = len(runtime.steps_events)
    out = [[(0.0, 0.0, []) for _ in range(n)] for _ in range(steps)]
    for r in range(n):
        for row in every[r * width:(r + 1) * width].tolist():
            if row[0] != row[0]:  # padding (nan)
                continue
            step, kind, s, mb, a, b = row
            t0, t1, evs = out[int(step)][r]
            if kind < 0:
                out[int(step)][r] = (a, b, evs)
            else:
                evs.append((_KINDS[int(kind)], int(s), int(mb), a, b))
    return out


def step_bubble(per_rank: list[tuple[float, float, list[Event]]]) -> tuple[float, float]:
    """(bubble fraction, span) of one step: idle / (ranks x span), the simulator's measure."""
    start = min(t0 for t0, _, _ in per_rank)
    end = max(max((e[4] for e in evs), default=t0) for t0, _, evs in per_rank)
    span = end - start
    busy = sum(e[4] - e[3] for _, _, evs in per_rank for e in evs)
    return 1 - busy / (len(per_rank) * span), span


def measured_durations(steps: list[list[tuple[float, float, list[Event]]]],
                       schedule: Schedule) -> Durations:
    """Mean F, I, W per stage (a stage that only ran B gets I = W = B / 2)."""
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    for per_rank in steps:
        for _, _, evs in per_rank:
            for k, s, _, a, b in evs:
                times[k, s].append(b - a)
    f, i, w = [], [], []
    for s in range(schedule.num_stages):
        f.append(mean(times["F", s]) if times["F", s] else 0.0)
        if times["I", s] and times["W", s]:
            i.append(mean(times["I", s]))
            w.append(mean(times["W", s]))
        else:
            b = mean(times["B", s]) if times["B", s] else 0.0
            i.append(b / 2)
            w.append(b / 2)
    return Durations(mean(f), mean(i), mean(w), 0.0, tuple(f), tuple(i), tuple(w))


def pipeline_report(runtime: PipelineRuntime, partition: Partition, mesh: ParallelMesh
                    ) -> dict:
    """Measured vs simulated bubble; `events` (last step, seconds from its start) for the
    pictures. Every pp rank returns the same report."""
    steps = gather_events(runtime, mesh)
    used = steps[1:] if len(steps) > 1 else steps
    bubbles = [step_bubble(s) for s in used]
    sched = runtime.schedule
    durations = measured_durations(used, sched)
    sim = simulate(sched, durations)
    last = steps[-1]
    origin = min(t0 for t0, _, _ in last)
    events = [[(k, s, mb, a - origin, b - origin) for k, s, mb, a, b in evs]
              for _, _, evs in last]
    by_kind: dict[str, list[float]] = defaultdict(list)
    for per_rank in used:
        for _, _, evs in per_rank:
            for k, _, _, a, b in evs:
                by_kind[k].append(b - a)
    summary = {
        "schedule": sched.name, "pp": sched.pp, "microbatches": sched.microbatches,
        "virtual_stages": sched.virtual_stages, "partition": partition.describe(),
        "measured_bubble": mean(b for b, _ in bubbles),
        "simulated_bubble": sim.bubble_fraction,
        "measured_span": mean(s for _, s in bubbles),
        "simulated_span": sim.step_time,
        "mean_ms": {k: 1e3 * mean(v) for k, v in sorted(by_kind.items())},
        "steps_measured": len(used),
    }
    return {"summary": summary, "events": events, "schedule": sched, "simulated": sim}


def write_trace(report: dict, path: str | Path) -> Path:
    """Chrome trace of the last step (open in Perfetto): a process per rank."""
    return to_chrome_trace(report["events"], path, time_unit=1.0)


def write_timeline(report: dict, path: str | Path) -> Path:
    """PNG of the last step's measured timeline, a row per rank (matplotlib)."""
    events = report["events"]
    step = max((e[4] for evs in events for e in evs), default=0.0)
    busy = [sum(e[4] - e[3] for e in evs) for evs in events]
    per_rank = [(step - b) / step if step else 0.0 for b in busy]
    measured = SimResult(step, sum(per_rank) / len(per_rank), per_rank, busy,
                         report["simulated"].peak_activations, events)
    return draw_timeline(measured, report["schedule"], path)
