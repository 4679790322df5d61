"""The shared pipeline cost model: lay a schedule out in time, given durations.

Used by `plait simulate`, by the planner (`plait/plan/`) and by the validator that compares
measured timelines with this prediction: one cost model (docs/architecture.md,
"One cost model"). The closed forms it must agree with are the registry's
(`registry.closed_form_bubble`, `registry.paper_bubble_time`).

What is modelled. Each rank runs its compute actions strictly in list order, one at a time.
An action starts when its rank is free *and* its input has arrived:
  F s, mb   the output of F (s-1), mb        (+ p2p if stage s-1 is on another rank)
  I/B s, mb the gradient from I/B (s+1), mb   (+ p2p if on another rank); the last stage
            of a chain needs only its own F (the loss)
  W s, mb   its own I s, mb
B takes T_I + T_W. A transfer is latency `p2p` on the link, counted from the producer's
compute end: it does not occupy either rank (the runtime posts sends/receives
asynchronously). Posting does cost the rank something: `post` is the time one batch of
consecutive transfer actions of the lowered schedule keeps its rank from computing (the
runtime's `batch_isend_irecv` call; on gloo under load ~1 ms, mostly blocked, not CPU).
With post = 0 (the default) transfers are skipped and only p2p counts; with post > 0 an
unlowered schedule is lowered first. Post time is idle, not busy, in the bubble.

Several steps (`steps=K`): the same lists K times. With `optimizer_sync="barrier"` a rank
starts step k+1 at the end of the last compute of step k on any rank (the grad-norm
all-reduce and finiteness check); with "post_validation" (Qi et al. 2023, section 4) as
soon as its own step k is done. The steady state is steps 2..K.

Not modelled: bandwidth contention between concurrent transfers, compute/communication
interference, overlap of a forward with a backward chunk (DualPipe's F&B), the time of the
optimizer step and of the gradient all-reduce after the flush unless given as `between`,
and per-micro-batch jitter.

Event-driven (`_Timeline`): each action is started once, a rank resumed once per output it
waited on, so a lay-out is linear in the actions (tests/test_schedule_oracle.py holds the
results to the round-robin simulator this replaced, to the last bit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.parallel.pipeline.check import peak_activations
from plait.parallel.pipeline.ir import Action, Schedule, without_gc

Event = tuple[str, int, int, float, float]  # (kind, stage, microbatch, start, end)


@dataclass(frozen=True)
class Durations:
    forward: float  # T_F per stage per micro-batch (seconds, or any unit)
    backward_input: float  # T_I  (B = I + W)
    backward_weight: float  # T_W
    p2p: float = 0.0  # one activation/grad transfer between ranks
    # optional per-stage overrides: tuple of length num_stages, else None
    forward_per_stage: tuple[float, ...] | None = None
    backward_input_per_stage: tuple[float, ...] | None = None
    backward_weight_per_stage: tuple[float, ...] | None = None
    post: float = 0.0  # a rank's time to post one batch of transfers (lowered schedule)
    # several steps: a rank's time from the end of one step to the start of its next (its
    # optimizer update, the host's work); with the barrier, from the last rank's end
    between: float = 0.0

    def of(self, kind: str, stage: int) -> float:
        """Duration of one compute action on `stage`."""
        f = self.forward_per_stage[stage] if self.forward_per_stage else self.forward
        i = (
            self.backward_input_per_stage[stage]
            if self.backward_input_per_stage
            else self.backward_input
        )
        w = (
            self.backward_weight_per_stage[stage]
            if self.backward_weight_per_stage
            else self.backward_weight
        )
        return {"F": f, "I": i, "W": w, "B": i + w}[kind]


OPTIMIZER_SYNCS = ("barrier", "post_validation")  # `parallel.optimizer_sync`'s values


@dataclass
class SimResult:
    step_time: float
    bubble_fraction: float  # idle / (pp * step_time) over all ranks (mean idle fraction)
    bubble_per_rank: list[float]  # idle fraction of step_time, per rank
    busy_per_rank: list[float]  # compute time per rank
    peak_activations: list[int]  # micro-batch activations in flight per rank
    events: list[list[Event]]  # per rank: (kind, stage, mb, start, end), every step's
    # idle time between each rank's first and last action. The zero-bubble paper and the
    # DeepSeek-V3 report count this ("parallelogram") bubble: it is what a step costs when
    # the optimizer's synchronisation is removed (Qi et al. 2023, section 4, post-update
    # validation) and the next step's forwards start as soon as a rank is done.
    span_idle_per_rank: list[float] = field(default_factory=list)
    # --- several steps (`simulate(..., steps=K)`); the fields above are the first step's
    steps: int = 1
    optimizer_sync: str = "barrier"
    step_ends: list[float] = field(default_factory=list)  # when each step's last compute ends
    # the steady state, steps 2..K: (step_ends[-1] - step_ends[0]) / (K - 1), and the
    # bubble of that per-step time (None for one step)
    steady_step_time: float | None = None
    steady_bubble_fraction: float | None = None


class DeadlockError(ValueError):
    """The schedule's order makes some rank wait for an action that can never run."""


@without_gc
def simulate(schedule: Schedule, durations: Durations, steps: int = 1,
             optimizer_sync: str = "barrier") -> SimResult:
    """Lay the schedule out in time (see the module docstring for the rules), for `steps`
    consecutive steps: with `optimizer_sync="barrier"` every rank starts step k+1 when the
    last rank has finished step k; with "post_validation" (Qi et al. 2023, section 4) a
    rank starts its step k+1 as soon as its own step k is done."""
    _check_durations(schedule, durations)
    if steps < 1 or optimizer_sync not in OPTIMIZER_SYNCS:
        raise ValueError(f"steps={steps} must be >= 1 and optimizer_sync={optimizer_sync!r} "
                         f"one of {', '.join(OPTIMIZER_SYNCS)}")
    schedule, queues = _queues(schedule, durations)
    events, step_ends = _Timeline(schedule, queues, durations, steps,
                                  optimizer_sync == "barrier").run()
    per_step = [sum(1 for a in q if a is not None) for q in queues]
    first = events if steps == 1 else [ev[:k] for ev, k in zip(events, per_step)]
    step = max((ev[-1][4] for ev in first if ev), default=0.0)
    busy = [sum(e - s for _, _, _, s, e in ev) for ev in first]
    per_rank = [(step - b) / step if step > 0 else 0.0 for b in busy]
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
        events=events,
        span_idle_per_rank=[
            (ev[-1][4] - ev[0][3]) - b if ev else 0.0 for ev, b in zip(first, busy)
        ],
        steps=steps, optimizer_sync=optimizer_sync, step_ends=step_ends,
        steady_step_time=steady, steady_bubble_fraction=steady_bubble,
    )


Queue = list[Action | None]  # a rank's compute actions; None: posting a batch of transfers


def _queues(schedule: Schedule, durations: Durations) -> tuple[Schedule, list[Queue]]:
    """Each rank's work in order: its compute actions, and with post > 0 one None per run
    of consecutive transfers (the schedule lowered first if it is not)."""
    if durations.post <= 0:
        return schedule, [[a for a in acts if len(a[0]) == 1] for acts in schedule.actions]
    if not schedule.lowered:
        from plait.parallel.pipeline.lower import lower

        schedule = lower(schedule)
    queues = []
    for acts in schedule.actions:
        q: Queue = []
        for k, a in enumerate(acts):
            if len(a[0]) == 1:
                q.append(a)
            elif k == 0 or len(acts[k - 1][0]) == 1:  # the first of a run of transfers
                q.append(None)
        queues.append(q)
    return schedule, queues


class _Timeline:
    """Event-driven lay-out: each rank runs its queue until an input is missing, then
    waits on that one output (stage * m + mb, per kind) and is woken when it is produced;
    every action is started once. An action's start is max(its rank free, its input
    there), so the times do not depend on the order ranks are run in."""

    def __init__(self, schedule: Schedule, queues: list[Queue], d: Durations, steps: int,
                 barrier: bool):
        self.s, self.queues, self.steps, self.barrier = schedule, queues, steps, barrier
        n, m = schedule.num_stages, schedule.microbatches
        self.m, self.size = m, n * m  # outputs per kind per step
        rank_of = schedule.stage_to_rank
        self.dur = {k: [d.of(k, st) for st in range(n)] for k in ("F", "I", "W", "B")}

        def src(stage: int | None, st: int) -> tuple[int, float]:
            if stage is None:
                return -1, 0.0
            return stage, (d.p2p if rank_of[stage] != rank_of[st] else 0.0)

        self.f_src = [src(schedule.prev_stage(st), st) for st in range(n)]
        self.g_src = [src(schedule.next_stage(st), st) for st in range(n)]
        self.post, self.between = d.post, d.between
        size = self.size * steps
        self.f_end: list[float | None] = [None] * size  # when F (stage, mb) of a step ends
        self.g_end: list[float | None] = [None] * size  # ... its I or B (the gradient)
        self.waiting: dict[int, list[int]] = {}  # output (g: + size) -> ranks waiting on it
        p = schedule.pp
        self.pos, self.step, self.free = [0] * p, [0] * p, [0.0] * p
        self.last = [[0.0] * p for _ in range(steps)]  # per step, each rank's last compute
        self.done_ranks = [0] * steps  # ranks through each step (the barrier)
        self.at_barrier: set[int] = set()
        self.computes = [sum(1 for a in q if a is not None) for q in queues]
        self.events: list[list[Event]] = [[] for _ in range(p)]
        self.resumed = 0  # times a rank was run (once, then once per wake-up): O(actions)

    def run(self) -> tuple[list[list[Event]], list[float]]:
        self._lay_out()
        stuck = [r for r in range(self.s.pp) if self.step[r] < self.steps]
        if stuck:
            raise DeadlockError("schedule cannot finish: " + "; ".join(
                f"rank {r} waits at {self.queues[r][self.pos[r]]}"
                if r not in self.at_barrier else
                f"rank {r} waits for the others to finish step {self.step[r] + 1}"
                for r in stuck))
        return self.events, [max(x) for x in self.last]

    def _lay_out(self) -> None:
        """Run ranks, each until it waits, lowest first, then whichever were woken."""
        m, size, steps = self.m, self.size, self.steps
        f_end, g_end, dur, waiting = self.f_end, self.g_end, self.dur, self.waiting
        f_src, g_src, gk = self.f_src, self.g_src, size * steps  # gk: G's waiting keys
        ready = list(range(self.s.pp - 1, -1, -1))
        while ready:
            r = ready.pop()
            self.resumed += 1
            q, events = self.queues[r], self.events[r]
            append, n = events.append, len(q)
            pos, free, step = self.pos[r], self.free[r], self.step[r]
            base = step * size
            while True:
                if pos == n:  # the rank's step is done
                    self.last[step][r] = events[-1][4] if self.computes[r] else free
                    pos, step = 0, step + 1
                    base = step * size
                    opens = self._step_done(r, step, ready)
                    if opens is None:
                        break
                    free = max(free + self.between, opens)
                    continue
                a = q[pos]
                if a is None:  # posting a batch of transfers
                    free += self.post
                    pos += 1
                    continue
                kind, st, mb, _ = a
                i = base + st * m + mb
                if kind == "F":
                    src, hop = f_src[st]
                    if src < 0:
                        t = 0.0
                    else:
                        t = f_end[i + (src - st) * m]
                        if t is None:
                            waiting.setdefault(i + (src - st) * m, []).append(r)
                            break
                        t += hop
                elif kind == "W":
                    t = g_end[i]
                    if t is None:
                        waiting.setdefault(gk + i, []).append(r)
                        break
                else:  # I or B: its own F, and the gradient from the next stage
                    src, hop = g_src[st]
                    t = f_end[i]
                    if t is not None and src >= 0:
                        t = g_end[i + (src - st) * m]
                        if t is None:
                            waiting.setdefault(gk + i + (src - st) * m, []).append(r)
                            break
                        t += hop
                    elif t is None:
                        waiting.setdefault(i, []).append(r)
                        break
                start = free if free >= t else t
                free = start + dur[kind][st]
                append((kind, st, mb, start, free))
                if kind == "F":
                    f_end[i] = free
                    if i in waiting:
                        ready += waiting.pop(i)
                elif kind != "W":
                    g_end[i] = free
                    if gk + i in waiting:
                        ready += waiting.pop(gk + i)
                pos += 1
            self.pos[r], self.free[r], self.step[r] = pos, free, step

    def _step_done(self, r: int, step: int, woke: list[int]) -> float | None:
        """Rank r has finished step `step` - 1: when it may start `step`; None: not yet
        (the last step, or the barrier still closed: the last rank through opens it)."""
        if step == self.steps:
            return None
        if not self.barrier:
            return 0.0
        self.done_ranks[step - 1] += 1
        if self.done_ranks[step - 1] < self.s.pp:
            self.at_barrier.add(r)
            return None
        opens = max(self.last[step - 1]) + self.between  # the last rank's last compute
        for other in sorted(self.at_barrier):
            self.free[other] = max(self.free[other], opens)
            woke.append(other)
        self.at_barrier.clear()
        return opens


def _check_durations(schedule: Schedule, d: Durations) -> None:
    for name in ("forward_per_stage", "backward_input_per_stage", "backward_weight_per_stage"):
        v = getattr(d, name)
        if v is not None and len(v) != schedule.num_stages:
            raise ValueError(
                f"Durations.{name} has {len(v)} entries; the schedule has "
                f"{schedule.num_stages} stages"
            )
    if min(d.forward, d.backward_input, d.backward_weight, d.p2p, d.post, d.between) < 0:
        raise ValueError("durations must be >= 0")
