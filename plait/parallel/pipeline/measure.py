"""Measured pipeline timelines: bubble, the simulator's prediction for them, pictures.

Every rank's runtime records each compute action's start and end on the device's timer
(`time.perf_counter` on CPU; CUDA events on a GPU, resolved onto that clock), which is
CLOCK_MONOTONIC, one clock for all processes of a machine; when it began waiting for its
input; and its thread CPU time. After training the records are gathered over the pp group
(ledgered, step -1, tag "timeline") and turned into:
  * the measured bubble of a step, with the simulator's definition: idle / (pp x span),
    where span runs from the first rank entering the step to the last compute ending;
    and where the idle went: waiting for an input, runtime work between computes (posting
    transfers, Python), before a rank's first compute and after its last;
  * the measured durations fed to `simulate()` (the one cost model), whose bubble is the
    prediction to compare with: mean F, I, W per stage; `p2p`, the median over the
    cross-rank edges of (input there - producer's compute ended), exact where the consumer
    waited and a bound where it did not (`p2p_median`): what the simulator adds to a
    cross-rank dependency; `post`, the mean time a rank spent posting one batch of
    transfers; `gap`, the mean time a rank spent before a compute that did not wait for
    its input, less the posts and the check (`runtime_gap`): the runtime's own work
    between computes; `check`, per rank the mean window of post-validation's check at
    its cut (`check_per_rank`), which the simulator lays out there from the second step;
  * the CPU share of compute wall time (thread CPU / wall): below 1 when ranks outnumber
    cores and the OS time-slices them, which inflates every duration;
  * a Chrome trace and a PNG timeline of the last step, one row per rank.
The first step is left out when there are several (allocator and thread-pool warm-up).
The statistics of the gathered records are plait/parallel/pipeline/runtime_stats.py's.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from statistics import mean

import torch

from plait import comm
from plait.mesh import ParallelMesh
from plait.parallel.pipeline.partition import Partition
from plait.parallel.pipeline.runtime import Event, PipelineRuntime
from plait.parallel.pipeline.runtime_stats import (
    Rank,
    between_each_step,
    between_per_rank,
    between_steps,
    check_per_rank,
    gap_each_compute,
    idle_breakdown,
    p2p_median,
    p2p_samples,
    runtime_gap,
    steady_state,
    step_bubble,
    step_periods,
)
from plait.schedule.draw import draw_timeline, to_chrome_trace
from plait.schedule.ir import Schedule
from plait.schedule.simulate import Durations, SimResult, simulate

_KINDS = ("F", "B", "I", "W")


def gather_events(runtime: PipelineRuntime, mesh: ParallelMesh) -> list[list[Rank]]:
    """Per step, per pp rank: (step start, step end, compute events, their details, posts,
    the check's window)."""
    rows = []
    for step, (events, detail, posts, (t0, t1), checks) in enumerate(zip(
            runtime.steps_events, runtime.steps_detail, runtime.steps_posts,
            runtime.steps_window, runtime.steps_check, strict=True)):
        rows.append([step, -1, -1, -1, t0, t1, 0.0, 0.0])  # kind -1 marks the step window
        rows += [[step, -2, -1, -1, a, b, 0.0, c] for a, b, c in posts]  # -2: a post
        rows += [[step, -3, -1, -1, a, b, 0.0, 0.0] for a, b in checks]  # -3: the check
        rows += [[step, _KINDS.index(k), s, mb, a, b, w, c]
                 for (k, s, mb, a, b), (w, c) in zip(events, detail, strict=True)]
    dev = mesh.device.torch  # NCCL gathers device tensors
    mine = torch.tensor(rows, dtype=torch.float64, device=dev)
    n = mesh.size("pp")
    with mesh.ledger.outside_step():  # not part of any training step
        counts = torch.zeros(n, dtype=torch.float64, device=dev)
        comm.all_gather(counts, torch.tensor([float(len(rows))], dtype=torch.float64,
                                             device=dev), mesh, "pp", tag="timeline")
        width = int(counts.max())
        padded = torch.full((width, 8), float("nan"), dtype=torch.float64, device=dev)
        padded[:len(rows)] = mine
        every = torch.empty(n * width, 8, dtype=torch.float64, device=dev)
        comm.all_gather(every, padded, mesh, "pp", tag="timeline")
    steps = len(runtime.steps_events)
    out: list[list[Rank]] = [[(0.0, 0.0, [], [], [], []) for _ in range(n)]
                             for _ in range(steps)]
    for r in range(n):
        for row in every[r * width:(r + 1) * width].tolist():
            if row[0] != row[0]:  # padding (nan)
                continue
            step, kind, s, mb, a, b, w, c = row
            t0, t1, evs, det, posts, checks = out[int(step)][r]
            if kind == -1:
                out[int(step)][r] = (a, b, evs, det, posts, checks)
            elif kind == -2:
                posts.append((a, b, c))
            elif kind == -3:
                checks.append((a, b))
            else:
                evs.append((_KINDS[int(kind)], int(s), int(mb), a, b))
                det.append((w, c))
    return out


def measured_durations(steps: list[list[Rank]], schedule: Schedule, p2p: float = 0.0,
                       post: float = 0.0, gap: float = 0.0) -> Durations:
    """Mean F, I, W and B per stage (a stage that only ran B gets I = W = B / 2; one that
    never ran B, B = I + W: dualpipev runs both, and one autograd pass costs less than
    the split's two), `p2p`, `post`, `gap`."""
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    for per_rank in steps:
        for r in per_rank:
            for k, s, _, a, b in r[2]:
                times[k, s].append(b - a)
    f, i, w, whole = [], [], [], []
    for s in range(schedule.num_stages):
        f.append(mean(times["F", s]) if times["F", s] else 0.0)
        b = mean(times["B", s]) if times["B", s] else None
        if times["I", s] and times["W", s]:
            i.append(mean(times["I", s]))
            w.append(mean(times["W", s]))
        else:
            i.append((b or 0.0) / 2)
            w.append((b or 0.0) / 2)
        whole.append(i[-1] + w[-1] if b is None else b)
    return Durations(mean(f), mean(i), mean(w), p2p, tuple(f), tuple(i), tuple(w), post,
                     gap=gap, backward_per_stage=tuple(whole))


def pipeline_report(runtime: PipelineRuntime, partition: Partition, mesh: ParallelMesh,
                    optimizer_sync: str = "barrier") -> dict:
    """Measured vs simulated bubble; `events` (last step, seconds from its start) for the
    pictures. Every pp rank returns the same report. Summary keys:
      measured_bubble, measured_span    mean over the measured steps
      simulated_bubble, simulated_span  simulate() of each step's own per-stage F, I, W, B,
                                        the measured p2p, post, gap; mean over the steps
      simulated_bubble_pooled           one simulate() of `durations_ms` (all steps' means)
      simulated_bubble_no_gap           the same per step with gap = 0 (`runtime_gap`'s)
      simulated_bubble_no_comm          the same with p2p = post = gap = 0: the
                                        schedule's own bubble for these compute durations
      simulated_bubble_cpu              each action's thread CPU time instead of its wall
                                        time, p2p = post = 0: as if every rank had its own
                                        core and transfers were free
      simulated_bubble_replay           each action its own measured duration and gap
                                        before it, each post its own time: nothing
                                        averaged but the p2p latency, the model's rules
      idle                              where the measured idle went (`idle_breakdown`)
      cpu_share                         thread CPU / wall over the computes, per kind
      steady_bubble, steady_period_ms,  across consecutive steps (`steady_state`; 3
      step_overlap_ms                   steps or more): with post-validation a step's
                                        forwards may overlap the previous step's end
      step_periods_ms                   each step's period (`step_periods`)
      simulated_steady_bubble_per_step, the same steps, each its own between and means,
      simulated_steady_bubble_replay    or each action, gap, post its own (`_steady_replays`)
      simulated_steady_bubble,          simulate() over as many steps, `optimizer_sync`
      simulated_steady_period_ms,       as the run's, with the measured durations and
      between_ms, between_per_rank_ms   `between` (`between_steps`) and each rank's
                                        (`between_per_rank`), and each rank's check at
      check_per_rank_ms                 its cut (`check_per_rank`): the prediction
      restarts                          steps whose speculative prefix was run again
                                        (post-validation's failed checks), this rank
      recompute                         per pp rank, the forwards run again inside its
                                        I actions (recomputation with a split backward):
                                        count and milliseconds per step"""
    steps = gather_events(runtime, mesh)
    used = steps[1:] if len(steps) > 1 else steps
    bubbles = [step_bubble(s) for s in used]
    sched = runtime.schedule
    samples = [x for per_rank in used for x in p2p_samples(per_rank, sched)]
    p2p = p2p_median(samples)
    posts = [b - a for per_rank in used for r in per_rank for a, b, _ in r[4]]
    post_cpu = [c for per_rank in used for r in per_rank for _, _, c in r[4]]
    post = mean(posts) if posts else 0.0
    gap = runtime_gap(used)
    durations = measured_durations(used, sched, p2p, post, gap)
    sim = simulate(sched, durations)  # the pooled durations: the timeline drawn
    last = steps[-1]
    origin = min(r[0] for r in last)
    events = [[(k, s, mb, a - origin, b - origin) for k, s, mb, a, b in r[2]] for r in last]
    by_kind, cpu = _wall_and_cpu_by_kind(used)
    breakdowns = [idle_breakdown(s) for s in used]
    ms = [1e3 * x for x in (durations.forward_per_stage or ())]
    summary = {
        "schedule": sched.name, "pp": sched.pp, "microbatches": sched.microbatches,
        "virtual_stages": sched.virtual_stages, "partition": partition.describe(),
        "measured_bubble": mean(b for b, _ in bubbles),
        "measured_span": mean(s for _, s in bubbles),
        **_simulated(used, sched, p2p, post, gap),
        "simulated_bubble_pooled": sim.bubble_fraction,
        "mean_ms": {k: 1e3 * mean(v) for k, v in sorted(by_kind.items())},
        "durations_ms": {
            "F": ms,
            "I": [1e3 * x for x in (durations.backward_input_per_stage or ())],
            "W": [1e3 * x for x in (durations.backward_weight_per_stage or ())],
            "B": [1e3 * x for x in (durations.backward_per_stage or ())],
            "p2p": 1e3 * p2p, "p2p_samples": len(samples),
            "p2p_waited": sum(exact for _, exact in samples), "post": 1e3 * post,
            "gap": 1e3 * durations.gap,
            "post_cpu": 1e3 * mean(post_cpu) if post_cpu else 0.0},
        "idle": {k: mean(b[k] for b in breakdowns) for k in breakdowns[0]},
        "cpu_share": {k: sum(cpu[k]) / sum(by_kind[k]) for k in sorted(by_kind)
                      if sum(by_kind[k]) > 0},
        "steps_measured": len(used),
    }
    summary.update(_across_steps(steps, runtime, durations, optimizer_sync))
    summary["recompute"], spans = _recompute_per_rank(runtime, mesh, len(steps) - len(used))
    redone = [[(k, s, mb, a - origin, b - origin) for k, s, mb, a, b in r] for r in spans]
    return {"summary": summary, "events": events, "schedule": sched, "simulated": sim,
            "recompute_events": redone}


def _simulated(used: list[list[Rank]], schedule: Schedule, p2p: float, post: float,
               gap: float) -> dict[str, float]:
    """The summary's one-step predictions, like for like with the measured bubble, a mean
    over the steps: each step simulated from its own per-stage mean durations (a step
    slowed by load is not averaged into the others), with and without the gap, the
    transfers, from CPU times; and replayed, each action its own measured duration."""
    cpu_steps = [[(t0, t1, [(k, s, mb, a, a + c) for (k, s, mb, a, _), (_, c) in
                            zip(evs, det, strict=True)], det, ps, cs)
                  for t0, t1, evs, det, ps, cs in per_rank] for per_rank in used]

    def per_step(steps: list[list[Rank]], p2p: float, post: float, gap: float,
                 replay: bool = False) -> list[SimResult]:
        return [simulate(schedule, replace(
            measured_durations([s], schedule, p2p, post, gap), per_action={
                (k, st, mb): b - a for r in s for k, st, mb, a, b in r[2]} if replay
            else None, gap_steps=(gap_each_compute(s),) if replay else None,
            post_steps=(_posts(s),) if replay else None), events=False) for s in steps]

    sims = per_step(used, p2p, post, gap)
    out = {"simulated_bubble": mean(x.bubble_fraction for x in sims),
           "simulated_span": mean(x.step_time for x in sims)}
    for key, runs in (("no_gap", per_step(used, p2p, post, 0.0)),
                      ("no_comm", per_step(used, 0.0, 0.0, 0.0)),
                      ("cpu", per_step(cpu_steps, 0.0, 0.0, 0.0)),
                      ("replay", per_step(used, p2p, post, gap, replay=True))):
        out[f"simulated_bubble_{key}"] = mean(x.bubble_fraction for x in runs)
    return out


def _wall_and_cpu_by_kind(used: list[list[Rank]]) -> tuple[dict, dict]:
    """Each compute's wall and thread CPU seconds, by kind."""
    by_kind: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    for per_rank in used:
        for _, _, evs, det, *_ in per_rank:
            for (k, _, _, a, b), (_, c) in zip(evs, det, strict=True):
                by_kind[k].append(b - a)
                cpu[k].append(c)
    return by_kind, cpu


def _across_steps(steps: list[list[Rank]], runtime: PipelineRuntime, durations: Durations,
                  optimizer_sync: str) -> dict:
    """The summary's keys across consecutive steps (3 or more; else none): measured
    (`steady_state`, `step_periods`) and simulated for as many steps with the measured
    durations and `between_steps`."""
    steady = steady_state(steps)
    if steady is None:
        return {}
    gap, per_rank = between_steps(steps, optimizer_sync), between_per_rank(steps, optimizer_sync)
    checks = check_per_rank(steps)
    base = replace(durations, between=gap, between_per_rank=per_rank, check=mean(checks),
                   check_per_rank=checks)
    across = simulate(runtime.schedule, base, len(steps), optimizer_sync)
    return {**_steady_replays(steps, runtime.schedule, base, optimizer_sync),
            "steady_bubble": steady[0], "steady_period_ms": 1e3 * steady[1],
            "step_overlap_ms": 1e3 * steady[2], "restarts": sum(runtime.steps_restarts),
            "step_periods_ms": [1e3 * x for x in step_periods(steps)],
            "simulated_steady_bubble": across.steady_bubble_fraction,
            "simulated_steady_period_ms": 1e3 * across.steady_step_time,
            "between_ms": 1e3 * gap, "between_per_rank_ms": [1e3 * x for x in per_rank],
            "check_per_rank_ms": [1e3 * x for x in checks], "optimizer_sync": optimizer_sync}


def _steady_replays(steps: list[list[Rank]], schedule: Schedule, base: Durations,
                    optimizer_sync: str) -> dict[str, float]:
    """The steady state simulated with every step's own times between steps
    (`between_each_step`) and each step's own per-stage means ("per_step"), or each of
    its actions its own measured duration, gap before it and posts ("replay"); p2p, the
    check (and gap and post, per_step) as measured. Pooled -> per_step is what the steps'
    differences cost, per_step -> replay the spread inside a step, replay -> measured the
    simulator's rules."""
    own = [{(k, st, mb): b - a for r in per_rank for k, st, mb, a, b in r[2]}
           for per_rank in steps]
    means = [measured_durations([per_rank], schedule) for per_rank in steps]
    each_mean = tuple({key: d.of(key[0], key[1]) for key in times}
                      for d, times in zip(means, own, strict=True))
    between = between_each_step(steps, optimizer_sync)
    # the steps' busy time is the measured one (SimResult's steady bubble takes the first
    # step's, which is every step's only when they are alike)
    busy = mean(sum(own[k].values()) for k in range(1, len(steps)))
    out = {}
    gaps = tuple(gap_each_compute(per_rank) for per_rank in steps)
    posts = tuple(_posts(per_rank) for per_rank in steps)
    for key, per_action, gap, post in (("per_step", each_mean, None, None),
                                       ("replay", tuple(own), gaps, posts)):
        sim = simulate(schedule, replace(base, per_action_steps=per_action, gap_steps=gap,
                                         post_steps=post, between_steps=between), len(steps),
                       optimizer_sync, events=False)
        out[f"simulated_steady_bubble_{key}"] = 1 - busy / (schedule.pp * sim.steady_step_time)
        out[f"simulated_steady_period_{key}_ms"] = 1e3 * sim.steady_step_time
    return out


def _posts(per_rank: list[Rank]) -> tuple[tuple[float, ...], ...]:
    """Each rank's posts of one step, their wall times in order (`Durations.post_steps`)."""
    return tuple(tuple(b - a for a, b, _ in r[4]) for r in per_rank)


def _recompute_per_rank(runtime: PipelineRuntime, mesh: ParallelMesh, skip: int
                        ) -> tuple[dict, list[list[Event]]]:
    """Each pp rank's forwards run again inside I: (count, ms) per measured step, and the
    last step's spans ("R", stage, mb, start, end) per rank, on the ranks' one clock."""
    used, last = runtime.steps_recompute[skip:], runtime.steps_recompute[-1]
    n = max(len(used), 1)
    rows = [[sum(len(r) for r in used) / n, 1e3 * sum(b - a for r in used for *_, a, b in r)
             / n, 0.0, 0.0]] + [list(span) for span in last]
    dev, pp = mesh.device.torch, mesh.size("pp")
    with mesh.ledger.outside_step():
        counts = torch.zeros(pp, dtype=torch.float64, device=dev)
        comm.all_gather(counts, torch.tensor([float(len(rows))], dtype=torch.float64,
                                             device=dev), mesh, "pp", tag="timeline")
        width = int(counts.max())
        padded = torch.zeros(width, 4, dtype=torch.float64, device=dev)
        padded[:len(rows)] = torch.tensor(rows, dtype=torch.float64, device=dev)
        every = torch.empty(pp * width, 4, dtype=torch.float64, device=dev)
        comm.all_gather(every, padded, mesh, "pp", tag="timeline")
    per_rank = [every[r * width:(r * width + int(counts[r]))].tolist() for r in range(pp)]
    summary = {"count_per_step": [r[0][0] for r in per_rank],
               "ms_per_step": [r[0][1] for r in per_rank]}
    return summary, [[("R", int(s), int(mb), a, b) for s, mb, a, b in r[1:]] for r in per_rank]


def write_trace(report: dict, path: str | Path) -> Path:
    """Chrome trace of the last step (open in Perfetto): a process per rank."""
    return to_chrome_trace(report["events"], path, time_unit=1.0,
                           nested=report.get("recompute_events"))


def write_timeline(report: dict, path: str | Path) -> Path:
    """PNG of the last step's measured timeline, a row per rank (matplotlib)."""
    return draw_measured(report["events"], report["schedule"], path,
                         report["simulated"].peak_activations)


def draw_measured(events: list[list], schedule: Schedule, path: str | Path,
                  peak_activations: list[int] | None = None) -> Path:
    """PNG of measured per-rank events `(kind, stage, microbatch, start, end)`, drawn as
    the simulator's timelines are (`plait report` draws a metrics file's from here)."""
    ms = [[(k, s, mb, 1e3 * a, 1e3 * z) for k, s, mb, a, z in evs] for evs in events]
    step = max((e[4] for evs in ms for e in evs), default=0.0)
    busy = [sum(e[4] - e[3] for e in evs) for evs in ms]
    per_rank = [(step - b) / step if step else 0.0 for b in busy]
    measured = SimResult(step, last_step_bubble(events), per_rank, busy,
                         peak_activations or [0] * len(events), ms)
    return draw_timeline(measured, schedule, path, unit="ms", what="last step")


def last_step_bubble(events: list[list]) -> float:
    """The bubble of the step whose per-rank events (seconds from its start) are given:
    idle / (pp x span), `step_bubble`'s definition, so that the timeline's title and the
    report's table give one number for the step drawn."""
    return step_bubble([(0.0, 0.0, [tuple(e) for e in evs]) for evs in events])[0]
