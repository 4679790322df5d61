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
    transfers;
  * the CPU share of compute wall time (thread CPU / wall): below 1 when ranks outnumber
    cores and the OS time-slices them, which inflates every duration;
  * a Chrome trace and a PNG timeline of the last step, one row per rank.
The first step is left out when there are several (allocator and thread-pool warm-up).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from statistics import mean

import torch

from plait import comm
from plait.mesh import ParallelMesh
from plait.parallel.pipeline.draw import draw_timeline, to_chrome_trace
from plait.parallel.pipeline.ir import Schedule
from plait.parallel.pipeline.partition import Partition
from plait.parallel.pipeline.runtime import Detail, Event, PipelineRuntime
from plait.parallel.pipeline.simulate import Durations, SimResult, simulate

_KINDS = ("F", "B", "I", "W")
# a consumer that waited longer than this for its input saw the transfer. Completing a
# receive that has already arrived costs a wait() call too: 50-150 us with gloo at pp = 2
# on this CPU (more when the rank is time-sliced), so a 20 us threshold took those for
# waits and their latency, the time the input sat unused, for a transfer's (interleaved's
# p2p read 61 ms against a true 1 ms; docs/performance.md). A real wait at pp = 2 there
# was 9-244 ms. One millisecond between the two; a shorter real wait is then a bound.
_WAITED = 1e-3
# step start, step end, compute events, their details, (start, end, CPU) of each post
Rank = tuple[float, float, list[Event], list[Detail], list[tuple[float, float, float]]]


def gather_events(runtime: PipelineRuntime, mesh: ParallelMesh) -> list[list[Rank]]:
    """Per step, per pp rank: (step start, step end, compute events, their details, posts)."""
    rows = []
    for step, (events, detail, posts, (t0, t1)) in enumerate(zip(
            runtime.steps_events, runtime.steps_detail, runtime.steps_posts,
            runtime.steps_window, strict=True)):
        rows.append([step, -1, -1, -1, t0, t1, 0.0, 0.0])  # kind -1 marks the step window
        rows += [[step, -2, -1, -1, a, b, 0.0, c] for a, b, c in posts]  # -2: a post
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
    out: list[list[Rank]] = [[(0.0, 0.0, [], [], []) for _ in range(n)]
                             for _ in range(steps)]
    for r in range(n):
        for row in every[r * width:(r + 1) * width].tolist():
            if row[0] != row[0]:  # padding (nan)
                continue
            step, kind, s, mb, a, b, w, c = row
            t0, t1, evs, det, posts = out[int(step)][r]
            if kind == -1:
                out[int(step)][r] = (a, b, evs, det, posts)
            elif kind == -2:
                posts.append((a, b, c))
            else:
                evs.append((_KINDS[int(kind)], int(s), int(mb), a, b))
                det.append((w, c))
    return out


def step_bubble(per_rank: list[Rank]) -> tuple[float, float]:
    """(bubble fraction, span) of one step: idle / (ranks x span), the simulator's measure."""
    start = min(r[0] for r in per_rank)
    end = max(max((e[4] for e in r[2]), default=r[0]) for r in per_rank)
    span = end - start
    busy = sum(e[4] - e[3] for r in per_rank for e in r[2])
    return 1 - busy / (len(per_rank) * span), span


def steady_state(steps: list[list[Rank]]) -> tuple[float, float, float] | None:
    """(bubble, period, overlap) across consecutive steps: the period is the mean time
    from one step's last compute (over all ranks) to the next one's, the bubble 1 - busy
    / (pp x period) with busy the computes of a step summed over ranks; the overlap is
    the mean of (a step's last compute end - the next step's first compute start): > 0
    when some rank started the next step's forwards before the last rank had finished
    (post-validation), < 0 the gap a barrier leaves. Unlike `step_bubble`, whatever runs
    between the computes of two steps (optimizer, the check, the barrier) is idle here.
    None with fewer than three steps (the first is warm-up)."""
    if len(steps) < 3:
        return None
    ends = [max(max((e[4] for e in r[2]), default=r[0]) for r in per_rank)
            for per_rank in steps]
    starts = [min(min((e[3] for e in r[2]), default=r[1]) for r in per_rank)
              for per_rank in steps]
    period = (ends[-1] - ends[0]) / (len(steps) - 1)
    busy = mean(sum(e[4] - e[3] for r in per_rank for e in r[2]) for per_rank in steps[1:])
    overlap = mean(ends[j] - starts[j + 1] for j in range(len(steps) - 1))
    return 1 - busy / (len(steps[0]) * period), period, overlap


def step_periods(steps: list[list[Rank]]) -> list[float]:
    """The time from each step's last compute (over all ranks) to the next one's."""
    ends = [max(max((e[4] for e in r[2]), default=r[0]) for r in per_rank)
            for per_rank in steps]
    return [b - a for a, b in zip(ends, ends[1:])]


def between_steps(steps: list[list[Rank]], optimizer_sync: str) -> float:
    """The simulator's `Durations.between`, measured: the mean time from a rank's last
    compute of a step to the start of its next runtime step (the step's end: its sends
    completed; gradient sync, norm, optimizer update, the loop's host work), over the steps
    after the first; the next step's time to its first compute is `runtime_gap`'s and the
    posts'. With the barrier, the rank whose last compute ended last (it waits for nobody:
    the rest of the others' gap is the barrier the simulator lays out); with
    post-validation, every rank's own."""
    gaps: list[float] = []
    for k in range(1, len(steps) - 1):
        pairs = [(r[2][-1][4] if r[2] else r[1], nxt[0])
                 for r, nxt in zip(steps[k], steps[k + 1], strict=True)]
        if optimizer_sync == "barrier":
            end, start = max(pairs)
            gaps.append(start - end)
        else:
            gaps += [start - end for end, start in pairs]
    return max(mean(gaps), 0.0) if gaps else 0.0


def idle_breakdown(per_rank: list[Rank]) -> dict[str, float]:
    """Where one step's idle went, each as a fraction of pp x span (they sum to the bubble):
    `wait` for an input to arrive, `between` computes doing runtime work (posting and
    reaping transfers, hooks, Python), `lead` before a rank's first compute, `tail` after
    its last, until the step's last compute ends."""
    start = min(r[0] for r in per_rank)
    end = max(max((e[4] for e in r[2]), default=r[0]) for r in per_rank)
    total = len(per_rank) * (end - start)
    out = dict.fromkeys(("wait", "between", "lead", "tail"), 0.0)
    for _, _, evs, det, _ in per_rank:
        if not evs:
            out["lead"] += end - start
            continue
        waits = [e[3] - w for e, (w, _) in zip(evs, det, strict=True)]
        out["lead"] += evs[0][3] - waits[0] - start
        out["wait"] += sum(waits)
        out["between"] += sum(evs[k + 1][3] - waits[k + 1] - evs[k][4]
                              for k in range(len(evs) - 1))
        out["tail"] += end - evs[-1][4]
    return {k: v / total for k, v in out.items()}


def p2p_samples(per_rank: list[Rank], schedule: Schedule) -> list[tuple[float, bool]]:
    """Per cross-rank dependency, (latency, exact): the time from the producer's compute end
    until the input was there on the consumer. Exact (the consumer's start) when the
    consumer waited for it; otherwise only a bound: it arrived before the consumer began to
    wait (latency <= wait start - producer end)."""
    rank_of, end_of = schedule.stage_to_rank, {}
    for _, _, evs, _, _ in per_rank:
        for k, s, mb, _, b in evs:
            end_of["G" if k in ("I", "B") else k, s, mb] = b
    out = []
    for _, _, evs, det, _ in per_rank:
        for (k, s, mb, a, _), (w, _) in zip(evs, det, strict=True):
            src = (schedule.prev_stage(s) if k == "F" else
                   schedule.next_stage(s) if k in ("I", "B") else None)
            if src is None or rank_of[src] == rank_of[s]:
                continue
            produced = end_of.get(("F" if k == "F" else "G", src, mb))
            if produced is not None:
                waited = a - w > _WAITED
                out.append(((a if waited else w) - produced, waited))
    return out


def p2p_median(samples: list[tuple[float, bool]]) -> float:
    """Median latency from exact values and upper bounds (left-censored data): Kaplan-Meier
    on -latency. Averaging only the exact ones would over-estimate, since a consumer waits
    precisely when a transfer was slow. Where the estimate never falls to one half, more
    than half the latencies lie below the smallest value seen (P(latency < it) > 1/2): that
    smallest value, the tightest upper bound the data give (the median of all values,
    used before, is a looser one where outputs are produced long before they are used)."""
    if not samples:
        return 0.0
    ys = sorted((-x, not exact) for x, exact in samples)  # exact first on ties
    survive, at_risk = 1.0, len(ys)
    for y, censored in ys:
        if not censored:
            survive *= 1 - 1 / at_risk
            if survive <= 0.5:
                return max(-y, 0.0)
        at_risk -= 1
    return max(min(x for x, _ in samples), 0.0)


def runtime_gap(steps: list[list[Rank]]) -> float:
    """The simulator's `Durations.gap`, measured: a rank's own time before a compute that
    did not wait for its input (from its previous compute's end, or the step's start, to
    its start, less the posts in between): the loop's Python, reaping sends, completing a
    receive that had already arrived, and the time slices the OS took there. The mean over
    every such compute of every rank, so that gap x computes is the idle it accounts for.
    Computes that waited are left out: their runtime work overlapped the wait."""
    gaps: list[float] = []
    for per_rank in steps:
        for t0, _, evs, det, posts in per_rank:
            k = 0  # posts are in time order, as computes are
            prev = t0
            for (_, _, _, a, b), (w, _) in zip(evs, det, strict=True):
                posted = 0.0
                while k < len(posts) and posts[k][0] < a:
                    posted += posts[k][1] - posts[k][0]
                    k += 1
                if a - w <= _WAITED:
                    gaps.append(max(a - prev - posted, 0.0))
                prev = b
    return mean(gaps) if gaps else 0.0


def measured_durations(steps: list[list[Rank]], schedule: Schedule, p2p: float = 0.0,
                       post: float = 0.0, gap: float = 0.0) -> Durations:
    """Mean F, I, W per stage (a stage that only ran B gets I = W = B / 2), `p2p`, `post`,
    `gap`."""
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    for per_rank in steps:
        for r in per_rank:
            for k, s, _, a, b in r[2]:
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
    return Durations(mean(f), mean(i), mean(w), p2p, tuple(f), tuple(i), tuple(w), post,
                     gap=gap)


def pipeline_report(runtime: PipelineRuntime, partition: Partition, mesh: ParallelMesh,
                    optimizer_sync: str = "barrier") -> dict:
    """Measured vs simulated bubble; `events` (last step, seconds from its start) for the
    pictures. Every pp rank returns the same report. Summary keys:
      measured_bubble, measured_span    mean over the measured steps
      simulated_bubble, simulated_span  simulate() for `durations_ms` (per-stage F, I, W,
                                        the measured p2p, post and gap): the prediction
      simulated_bubble_no_gap           the same with gap = 0 (`runtime_gap`'s share)
      simulated_bubble_no_comm          the same with p2p = post = gap = 0: the
                                        schedule's own bubble for these compute durations
      simulated_bubble_cpu              each action's thread CPU time instead of its wall
                                        time, p2p = post = 0: as if every rank had its own
                                        core and transfers were free
      idle                              where the measured idle went (`idle_breakdown`)
      cpu_share                         thread CPU / wall over the computes, per kind
      steady_bubble, steady_period_ms,  across consecutive steps (`steady_state`; 3
      step_overlap_ms                   steps or more): with post-validation a step's
                                        forwards may overlap the previous step's end
      step_periods_ms                   each step's period (`step_periods`)
      simulated_steady_bubble,          simulate() over as many steps, `optimizer_sync`
      simulated_steady_period_ms,       as the run's, with the measured durations and
      between_ms                        `between` (`between_steps`): the prediction
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
    durations = measured_durations(used, sched, p2p, post, runtime_gap(used))
    sim = simulate(sched, durations)
    no_gap = simulate(sched, replace(durations, gap=0.0))
    ideal = simulate(sched, replace(durations, p2p=0.0, post=0.0, gap=0.0))
    cpu_steps = [[(t0, t1, [(k, s, mb, a, a + c) for (k, s, mb, a, _), (_, c) in
                            zip(evs, det, strict=True)], det, ps)
                  for t0, t1, evs, det, ps in per_rank] for per_rank in used]
    cpu_sim = simulate(sched, measured_durations(cpu_steps, sched))
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
        "simulated_bubble": sim.bubble_fraction,
        "simulated_bubble_no_comm": ideal.bubble_fraction,
        "simulated_bubble_no_gap": no_gap.bubble_fraction,
        "simulated_bubble_cpu": cpu_sim.bubble_fraction,
        "measured_span": mean(s for _, s in bubbles),
        "simulated_span": sim.step_time,
        "mean_ms": {k: 1e3 * mean(v) for k, v in sorted(by_kind.items())},
        "durations_ms": {
            "F": ms,
            "I": [1e3 * x for x in (durations.backward_input_per_stage or ())],
            "W": [1e3 * x for x in (durations.backward_weight_per_stage or ())],
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


def _wall_and_cpu_by_kind(used: list[list[Rank]]) -> tuple[dict, dict]:
    """Each compute's wall and thread CPU seconds, by kind."""
    by_kind: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    for per_rank in used:
        for _, _, evs, det, _ in per_rank:
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
    gap = between_steps(steps, optimizer_sync)
    across = simulate(runtime.schedule, replace(durations, between=gap), len(steps),
                      optimizer_sync)
    return {"steady_bubble": steady[0], "steady_period_ms": 1e3 * steady[1],
            "step_overlap_ms": 1e3 * steady[2], "restarts": sum(runtime.steps_restarts),
            "step_periods_ms": [1e3 * x for x in step_periods(steps)],
            "simulated_steady_bubble": across.steady_bubble_fraction,
            "simulated_steady_period_ms": 1e3 * across.steady_step_time,
            "between_ms": 1e3 * gap, "optimizer_sync": optimizer_sync}


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
    events = [[tuple(e) for e in evs] for evs in events]
    step = max((e[4] for evs in events for e in evs), default=0.0)
    busy = [sum(e[4] - e[3] for e in evs) for evs in events]
    per_rank = [(step - b) / step if step else 0.0 for b in busy]
    measured = SimResult(step, sum(per_rank) / len(per_rank), per_rank, busy,
                         peak_activations or [0] * len(events), events)
    return draw_timeline(measured, schedule, path)
