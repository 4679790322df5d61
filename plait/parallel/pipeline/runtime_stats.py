"""Statistics of the pipeline runtime's gathered records (`measure.gather_events`): one
step's bubble and where its idle went, the steady state across steps, the time between
steps, the p2p latency of cross-rank dependencies and the runtime's own gap before each
compute: what `measure.pipeline_report` compares with, and feeds to, `simulate()`.

A rank's record of one step (`Rank`): its runtime step's start and end, its compute events
(kind, stage, micro-batch, start, end), per compute (when it began waiting for its input,
thread CPU seconds), each post of a batch of transfers (start, end, thread CPU), and the
window (start, end) of the post-validation check at its cut, where the step had one, all
seconds on the ranks' one clock.
"""

from __future__ import annotations

from statistics import mean

from plait.parallel.pipeline.runtime import Detail, Event
from plait.schedule.ir import Schedule

# a consumer that waited longer than this for its input saw the transfer. Completing a
# receive that has already arrived costs a wait() call too: 50-150 us with gloo at pp = 2
# on this CPU (more when the rank is time-sliced), so a 20 us threshold took those for
# waits and their latency, the time the input sat unused, for a transfer's (interleaved's
# p2p read 61 ms against a true 1 ms; docs/pipeline_runtime.md). A real wait at pp = 2 there
# was 9-244 ms. One millisecond between the two; a shorter real wait is then a bound.
_WAITED = 1e-3
# step start, step end, compute events, their details, (start, end, CPU) of each post,
# (start, end) of the check at the cut (post-validation; none, or one)
Rank = tuple[float, float, list[Event], list[Detail], list[tuple[float, float, float]],
             list[tuple[float, float]]]


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


def between_per_rank(steps: list[list[Rank]], optimizer_sync: str) -> tuple[float, ...]:
    """`Durations.between_per_rank`, measured: per rank, the mean time from the last
    compute of a step (the last rank's, with the barrier, which every rank waits for; its
    own, with post-validation) to the start of its next runtime step, over the steps after
    the first: with the barrier, ranks whose updates differ (the last stage's head) start
    the next step at different times, which one `between` cannot say."""
    if len(steps) < 3:
        return tuple(0.0 for _ in steps[0]) if steps else ()
    per: list[list[float]] = [[] for _ in steps[0]]
    for k in range(1, len(steps) - 1):
        ends = [r[2][-1][4] if r[2] else r[1] for r in steps[k]]
        last = max(ends)
        for j, nxt in enumerate(steps[k + 1]):
            per[j].append(nxt[0] - (last if optimizer_sync == "barrier" else ends[j]))
    return tuple(max(mean(x), 0.0) for x in per)


def between_each_step(steps: list[list[Rank]], optimizer_sync: str
                      ) -> tuple[tuple[float, ...], ...]:
    """`Durations.between_steps`, measured: `between_per_rank`'s time for each step but the
    last on its own (the first included), not averaged: what a replay of the steps lays
    out between each step and the next."""
    out = []
    for k in range(len(steps) - 1):
        ends = [r[2][-1][4] if r[2] else r[1] for r in steps[k]]
        last = max(ends)
        out.append(tuple(max(nxt[0] - (last if optimizer_sync == "barrier" else ends[j]), 0.0)
                         for j, nxt in enumerate(steps[k + 1])))
    return tuple(out)


def idle_breakdown(per_rank: list[Rank]) -> dict[str, float]:
    """Where one step's idle went, each as a fraction of pp x span (they sum to the bubble):
    `wait` for an input to arrive, `between` computes doing runtime work (posting and
    reaping transfers, hooks, Python), `check`, post-validation's at the cut (out of
    `lead` or `between`, wherever it fell), `lead` before a rank's first compute, `tail`
    after its last, until the step's last compute ends."""
    start = min(r[0] for r in per_rank)
    end = max(max((e[4] for e in r[2]), default=r[0]) for r in per_rank)
    total = len(per_rank) * (end - start)
    out = dict.fromkeys(("wait", "between", "check", "lead", "tail"), 0.0)
    for _, _, evs, det, _, checks in per_rank:
        if not evs:
            out["lead"] += end - start
            continue
        waits = [e[3] - w for e, (w, _) in zip(evs, det, strict=True)]
        out["lead"] += evs[0][3] - waits[0] - start
        out["wait"] += sum(waits)
        out["between"] += sum(evs[k + 1][3] - waits[k + 1] - evs[k][4]
                              for k in range(len(evs) - 1))
        out["tail"] += end - evs[-1][4]
        for a, b in checks:  # before the first compute's wait began: in the lead
            out["check"] += b - a
            out["lead" if b <= evs[0][3] - waits[0] else "between"] -= b - a
    return {k: v / total for k, v in out.items()}


def p2p_samples(per_rank: list[Rank], schedule: Schedule) -> list[tuple[float, bool]]:
    """Per cross-rank dependency, (latency, exact): the time from the producer's compute end
    until the input was there on the consumer. Exact (the consumer's start) when the
    consumer waited for it; otherwise only a bound: it arrived before the consumer began to
    wait (latency <= wait start - producer end)."""
    rank_of, end_of = schedule.stage_to_rank, {}
    for _, _, evs, *_ in per_rank:
        for k, s, mb, _, b in evs:
            end_of["G" if k in ("I", "B") else k, s, mb] = b
    out = []
    for _, _, evs, det, *_ in per_rank:
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
    its start, less the posts and the post-validation check in between: the simulator
    lays those out itself, `Durations.post` and `.check`): the loop's Python, reaping
    sends, completing a receive that had already arrived, and the time slices the OS took
    there. The mean over every such compute of every rank, so that gap x computes is the
    idle it accounts for. Computes that waited are left out: their runtime work
    overlapped the wait."""
    gaps: list[float] = []
    for per_rank in steps:
        for t0, _, evs, det, posts, checks in per_rank:
            marks = sorted([(a, b) for a, b, _ in posts] + checks)  # in time order, as
            k = 0  # computes are
            prev = t0
            for (_, _, _, a, b), (w, _) in zip(evs, det, strict=True):
                own = 0.0
                while k < len(marks) and marks[k][0] < a:
                    own += marks[k][1] - marks[k][0]
                    k += 1
                if a - w <= _WAITED:
                    gaps.append(max(a - prev - own, 0.0))
                prev = b
    return mean(gaps) if gaps else 0.0


def gap_each_compute(per_rank: list[Rank]) -> dict[tuple[str, int, int], float]:
    """`Durations.gap_steps` for one step, measured: each compute's own `runtime_gap`
    (from the previous compute's end, or the step's start, to its start, less the posts
    and the check between), where it waited for its input up to that wait's start: the
    runtime's work before it, which a replay lays out as the compute's own gap."""
    out = {}
    for t0, _, evs, det, posts, checks in per_rank:
        marks = sorted([(a, b) for a, b, _ in posts] + checks)
        k, prev = 0, t0
        for (kind, s, mb, a, b), (w, _) in zip(evs, det, strict=True):
            ready = a if a - w <= _WAITED else w
            own = 0.0
            while k < len(marks) and marks[k][0] < ready:
                own += marks[k][1] - marks[k][0]
                k += 1
            out[kind, s, mb] = max(ready - prev - own, 0.0)
            prev = b
    return out


def check_per_rank(steps: list[list[Rank]]) -> tuple[float, ...]:
    """`Durations.check_per_rank`, measured: per rank, the mean window of the
    post-validation check at its cut (the wait for the other stages' partials, dropping
    the update's copy, zeroing the gradients) over the steps that had one; 0 for none."""
    out = []
    for r in range(len(steps[0]) if steps else 0):
        windows = [b - a for per_rank in steps for a, b in per_rank[r][5]]
        out.append(mean(windows) if windows else 0.0)
    return tuple(out)
