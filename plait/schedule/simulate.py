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
B takes T_I + T_W (or `backward_per_stage`). Before each compute its rank spends `gap` on
its own runtime work (the loop's Python, completing a receive that has already arrived;
`runtime_stats.runtime_gap`), idle, overlapping any wait for the input: start = max(rank free +
gap, input there). A transfer is latency `p2p` on the link, counted from the producer's
compute end: it does not occupy either rank (the runtime posts sends/receives
asynchronously). Posting does cost the rank something: `post` is the time one batch of
consecutive transfer actions of the lowered schedule keeps its rank from computing (the
runtime's `batch_isend_irecv` call; on gloo under load ~1 ms, mostly blocked, not CPU).
With post = 0 (the default) transfers are skipped and only p2p counts; with post > 0 an
unlowered schedule is lowered first. Post time is idle, not busy, in the bubble.

Several steps (`steps=K`): the same lists K times. With `optimizer_sync="barrier"` a rank
starts step k+1 at the end of the last compute of step k on any rank (the grad-norm
all-reduce and finiteness check); with "post_validation" (Qi et al. 2023, section 4) as
soon as its own step k is done; then, either way, its `between` (`between_per_rank`: each
rank its own, as measured; the update and host work). With post-validation, from the
second step on, a rank also spends `check` (idle) at its cut, where the runtime checks the
previous step's update (`lower.cut_positions`). The steady state is steps 2..K.

Replaying measured steps: `per_action` gives each action its own duration (the same in
every step), `per_action_steps` each step's actions theirs, `gap_steps` each compute its
own gap before it, `post_steps` each post its own time, `between_steps` each step's time
to the next per rank: with every one measured, what is left between the lay-out and the
measurement is these rules.

A schedule lowered with `pair_fb` (`ir.fb_pairs`): a paired F and I/B run back to back as
one unit, which starts when both inputs are there; the F's output leaves after the pair
(the runtime sends it then). The all-to-all time the pair hides is not modelled: the
durations given are the pair's own.

Not modelled: bandwidth contention between concurrent transfers, compute/communication
interference, the time of the
optimizer step and of the gradient all-reduce after the flush unless given as `between`,
the check's wait for a late stage's partial other than through the measured `check`, and
per-micro-batch jitter unless each action is given its own time (`per_action`).

Event-driven (`_Timeline`): each action is started once, a rank resumed once per output it
waited on, so a lay-out is linear in the actions (tests/test_schedule_oracle.py holds the
results to the round-robin simulator this replaced, to the last bit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter

from plait.schedule.ir import COMPUTE, Action, Schedule, without_gc
from plait.schedule.results import Event, SimResult, events_of, result_of

__all__ = ["OPTIMIZER_SYNCS", "DeadlockError", "Durations", "Event", "SimResult", "events_of",
           "result_of", "simulate"]


@dataclass(frozen=True)
class Durations:
    forward: float  # T_F per stage per micro-batch (seconds, or any unit)
    backward_input: float  # T_I  (B = I + W, unless backward_per_stage)
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
    between_per_rank: tuple[float, ...] | None = None  # per rank (length pp), else between
    # a rank's own runtime work before each compute action besides posting (the loop's
    # Python, completing a receive that is already there, the action's bookkeeping): idle
    # like post; it overlaps a wait for the input (start = max(free + gap, input there))
    gap: float = 0.0
    # post-validation, from the second step on: a rank's time at its cut checking the
    # previous step's update (waiting for the other stages' partials, dropping the copy,
    # zeroing the gradients); idle, like post. Measured: runtime_stats.check_per_rank
    check: float = 0.0
    check_per_rank: tuple[float, ...] | None = None  # per rank (length pp), else check
    # a whole B per stage where it is not I + W (measured: one autograd pass is cheaper
    # than the split's two, dualpipev runs both); None: B = I + W
    backward_per_stage: tuple[float, ...] | None = None
    # each action's own time, {(kind, stage, mb): seconds}, over the per-stage ones (a
    # measured step replayed: measure.pipeline_report's simulated_bubble_replay)
    per_action: dict[tuple[str, int, int], float] | None = field(default=None, hash=False)
    # several steps replayed: step k's own {(kind, stage, mb): seconds} (over per_action),
    # one dict a step; and the time between step k and k + 1 per rank (over between and
    # between_per_rank), one tuple for each step but the last
    per_action_steps: tuple[dict[tuple[str, int, int], float], ...] | None = field(
        default=None, hash=False)
    between_steps: tuple[tuple[float, ...], ...] | None = None
    # and step k's own gap before each compute, {(kind, stage, mb): seconds} (over gap)
    gap_steps: tuple[dict[tuple[str, int, int], float], ...] | None = field(
        default=None, hash=False)
    # and step k's own time of each post per rank, in the rank's order (over post; a rank
    # whose count differs from its runs of transfers keeps post)
    post_steps: tuple[tuple[tuple[float, ...], ...], ...] | None = None

    def of(self, kind: str, stage: int) -> float:
        """Duration of one compute action on `stage`."""
        f, i, w = (per[stage] if per else one for per, one in (
            (self.forward_per_stage, self.forward),
            (self.backward_input_per_stage, self.backward_input),
            (self.backward_weight_per_stage, self.backward_weight)))
        b = self.backward_per_stage[stage] if self.backward_per_stage else i + w
        return {"F": f, "I": i, "W": w, "B": b}[kind]


OPTIMIZER_SYNCS = ("barrier", "post_validation")  # `parallel.optimizer_sync`'s values


class DeadlockError(ValueError):
    """The schedule's order makes some rank wait for an action that can never run."""


@without_gc
def simulate(schedule: Schedule, durations: Durations, steps: int = 1,
             optimizer_sync: str = "barrier", events: bool = True) -> SimResult:
    """Lay the schedule out in time for `steps` consecutive steps, `optimizer_sync`
    between them (the module docstring has the rules). `events=False` leaves
    `SimResult.events` empty (the figures are the same): for a caller that draws nothing."""
    _check_durations(schedule, durations)
    if steps < 1 or optimizer_sync not in OPTIMIZER_SYNCS:
        raise ValueError(f"steps={steps} must be >= 1 and optimizer_sync={optimizer_sync!r} "
                         f"one of {', '.join(OPTIMIZER_SYNCS)}")
    _check_steps(schedule, durations, steps)
    schedule, queues = _queues(schedule, durations)
    if steps > 1 and optimizer_sync == "post_validation" and max(
            (durations.check, *(durations.check_per_rank or ()))) > 0:
        queues = _with_checks(schedule, queues)
    line = _Timeline(schedule, queues, durations, steps, optimizer_sync == "barrier")
    step_ends = line.run()
    return result_of(schedule, line.starts, line.ends, line.computes, steps, optimizer_sync,
                     step_ends, events=events_of(queues, line.starts, line.ends) if events
                     else [[] for _ in queues])


Queue = list[Action | None]  # a rank's compute actions; None: posting a batch of transfers


def _queues(schedule: Schedule, durations: Durations) -> tuple[Schedule, list[Queue]]:
    """Each rank's work in order: its compute actions, and with post > 0 one None per run
    of consecutive transfers (the schedule lowered first if it is not)."""
    if durations.post <= 0:  # a rank's list is its queue when it holds no transfers
        return schedule, [acts if set(map(_KIND, acts)) <= _COMPUTE else
                          [a for a in acts if len(a[0]) == 1] for acts in schedule.actions]
    if not schedule.lowered:
        from plait.schedule.lower import lower

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


_KIND, _COMPUTE = itemgetter(0), frozenset(COMPUTE)
# a queue's post-validation check at the rank's cut (from the second step on); the split
# one falls inside a run of transfers, which the runtime then posts as two batches
_CHECK, _CHECK_SPLIT = ("C", -1, -1, False), ("C", -1, -1, True)


def _with_checks(schedule: Schedule, queues: list[Queue]) -> list[Queue]:
    """Each rank's queue with its check where the runtime makes it (`lower.cut_positions`)."""
    from plait.schedule.lower import cut_positions

    out = []
    for q, at in zip(queues, cut_positions(schedule)):
        if at is not None:  # computes and runs of transfers before the cut; a split run?
            posts = None in q  # with posts, a None stands for each run of transfers
            n = at[0] + at[1] if posts else at[0]
            q = q[:n] + [_CHECK_SPLIT if posts and at[2] else _CHECK] + q[n:]
        out.append(q)
    return out


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
        # per action, index step * n * m + stage * m + mb
        self.dur = {k: [x for st in range(n) for x in [d.of(k, st)] * m] for k in "FIWB"}
        for (k, st, mb), x in (d.per_action or {}).items():
            self.dur[k][st * m + mb] = x
        self.dur = {k: v * steps for k, v in self.dur.items()}
        for step, own in enumerate(d.per_action_steps or ()):
            for (k, st, mb), x in own.items():
                self.dur[k][step * n * m + st * m + mb] = x
        self.gaps = {k: [d.gap] * (n * m * steps) for k in "FIWB"}  # the same, indexed
        for step, own in enumerate(d.gap_steps or ()):
            for (k, st, mb), x in own.items():
                self.gaps[k][step * n * m + st * m + mb] = x

        def src(stage: int | None, st: int) -> tuple[int | None, float]:
            """(offset of the input's index from this action's, its transfer time)."""
            if stage is None:
                return None, 0.0
            return (stage - st) * m, (d.p2p if rank_of[stage] != rank_of[st] else 0.0)

        self.f_src = [src(schedule.prev_stage(st), st) for st in range(n)]
        self.g_src = [src(schedule.next_stage(st), st) for st in range(n)]
        self.post = d.post
        # per rank, per step, per queue position: the time of the post there (None's)
        self.post_at = [[[d.post] * len(q)] * steps for q in queues]
        for step, per_rank in enumerate(d.post_steps or ()):
            for r, own in enumerate(per_rank):
                at = [k for k, a in enumerate(queues[r]) if a is None]
                if len(at) == len(own):
                    self.post_at[r][step] = [d.post] * len(queues[r])
                    for k, x in zip(at, own):
                        self.post_at[r][step][k] = x
        # per step, each rank's time from its end (the barrier's opening) to its next step
        one = list(d.between_per_rank or [d.between] * schedule.pp)
        self.between = [list(b) for b in d.between_steps or ()] + [one] * steps
        self.check = list(d.check_per_rank or [d.check] * schedule.pp)
        size = self.size * steps
        self.f_end: list[float | None] = [None] * size  # when F (stage, mb) of a step ends
        self.g_end: list[float | None] = [None] * size  # ... its I or B (the gradient)
        self.waiting: dict[int, list[int]] = {}  # output (g: + size) -> ranks waiting on it
        p = schedule.pp
        self.pos, self.step, self.free = [0] * p, [0] * p, [0.0] * p
        self.last = [[0.0] * p for _ in range(steps)]  # per step, each rank's last compute
        self.done_ranks = [0] * steps  # ranks through each step (the barrier)
        self.at_barrier: set[int] = set()
        self.computes = [len(q) - q.count(None) - q.count(_CHECK) - q.count(_CHECK_SPLIT)
                         for q in queues]
        self.starts: list[list[float]] = [[] for _ in range(p)]  # per rank, every compute's
        self.ends: list[list[float]] = [[] for _ in range(p)]
        # queue positions of the F's of F&B pairs (`ir.fb_pairs`: adjacent in the queue too)
        self.pairs = [{k for k, (a, b) in enumerate(zip(q, q[1:])) if a and b and a[0] == "F"
                       and b[0] in "IB" and a[2] != b[2]} if schedule.paired_fb else set()
                      for q in queues]
        self.resumed = 0  # times a rank was run (once, then once per wake-up): O(actions)

    def run(self) -> list[float]:
        """Lay out every step; when each step's last compute ends."""
        self._lay_out()
        stuck = [r for r in range(self.s.pp) if self.step[r] < self.steps]
        if stuck:
            raise DeadlockError("schedule cannot finish: " + "; ".join(
                f"rank {r} waits at {self.queues[r][self.pos[r]]}"
                if r not in self.at_barrier else
                f"rank {r} waits for the others to finish step {self.step[r] + 1}"
                for r in stuck))
        return [max(x) for x in self.last]

    def _lay_out(self) -> None:
        """Run ranks, each until it waits, lowest first, then whichever were woken."""
        ready, resumed = list(range(self.s.pp - 1, -1, -1)), 0
        while ready:
            resumed += 1
            self._resume(ready.pop(), ready)
        self.resumed += resumed

    def _resume(self, r: int, ready: list[int]) -> None:
        """Run rank r from where it waits until it waits again; the woken go on `ready`."""
        m, size, post, dur, gaps = self.m, self.size, self.post, self.dur, self.gaps
        (f_end, g_end, waiting), (dur_f, dur_w), (gap_f, gap_w) = (
            (self.f_end, self.g_end, self.waiting), (dur["F"], dur["W"]), (gaps["F"], gaps["W"]))
        f_src, g_src, gk = self.f_src, self.g_src, size * self.steps  # gk: G's waiting keys
        q, n, start_at, end_at = self.queues[r], len(self.queues[r]), self.starts[r].append, \
            self.ends[r].append
        pos, free, step, pairs = self.pos[r], self.free[r], self.step[r], self.pairs[r]
        while True:  # one step's queue, from pos
            base, post_of = step * size, self.post_at[r][step]
            for pos in range(pos, n):  # noqa: B020 (pos is where the rank waits)
                a = q[pos]
                if a is None:  # posting a batch of transfers
                    free += post_of[pos]
                    continue
                kind, st, mb, _ = a
                i = base + st * m + mb
                if kind == "F":
                    off, hop = f_src[st]
                    if off is None:
                        t = 0.0
                    else:
                        t = f_end[i + off]
                        if t is None:
                            waiting.setdefault(i + off, []).append(r)
                            break
                        t += hop
                    if pos in pairs:  # with its I/B's input; its output after both
                        tb, after = self._pair(q[pos + 1], base, r)
                        if tb is None:
                            break
                        t = tb if tb > t else t
                    free += gap_f[i]  # + 0.0 is exact: gap 0 leaves every time as it was
                    if free < t:
                        free = t
                    start_at(free)
                    free += dur_f[i]
                    end_at(free)
                    f_end[i] = free + after if pos in pairs else free
                    if i in waiting:
                        ready += waiting.pop(i)
                    continue
                if kind == "W":
                    if (t := g_end[i]) is None:
                        waiting.setdefault(gk + i, []).append(r)
                        break
                    free += gap_w[i]
                    free = t if free < t else free
                    start_at(free)
                    free += dur_w[i]
                    end_at(free)
                    continue
                if kind == "C":  # the check at the cut, from the second step on
                    free += (self.check[r] + (post if a[3] else 0.0)) if step else 0.0
                    continue
                # I or B: the next stage's gradient (after its F), else the loss's F
                off, hop = g_src[st]
                t = f_end[i] if off is None else g_end[i + off]
                if t is None:
                    waiting.setdefault(i if off is None else gk + i + off, []).append(r)
                    break
                t += hop
                free += gaps[kind][i]
                free = t if free < t else free
                start_at(free)
                free += dur[kind][i]
                end_at(free)
                g_end[i] = free
                if gk + i in waiting:
                    ready += waiting.pop(gk + i)
            else:  # the rank's step is done
                self.last[step][r] = self.ends[r][-1] if self.computes[r] else free
                pos, step = 0, step + 1
                opens = self._step_done(r, step, ready)
                if opens is not None:
                    free = max(free + self.between[step - 1][r], opens)
                    continue
            break
        self.pos[r], self.free[r], self.step[r] = pos, free, step

    def _pair(self, b: Action, base: int, r: int) -> tuple[float | None, float]:
        """A paired F's I/B `b`: when its input is there (None: not yet, rank r now waits
        on it), and its gap and duration, after which the pair's F output leaves."""
        kind, st, mb, _ = b
        i = base + st * self.m + mb
        off, hop = self.g_src[st]
        t = self.f_end[i] if off is None else self.g_end[i + off]
        if t is None:
            key = i if off is None else self.size * self.steps + i + off
            self.waiting.setdefault(key, []).append(r)
            return None, 0.0
        return t + hop, self.gaps[kind][i] + self.dur[kind][i]

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
        opens = max(self.last[step - 1])  # the last rank's last compute, then each its own
        between = self.between[step - 1]
        for other in sorted(self.at_barrier):
            self.free[other] = max(self.free[other], opens + between[other])
            woke.append(other)
        self.at_barrier.clear()
        return opens + between[r]


def _check_durations(schedule: Schedule, d: Durations) -> None:
    n, p = (schedule.num_stages, "stages"), (schedule.pp, "ranks")
    for name, (size, what) in (("forward_per_stage", n), ("backward_input_per_stage", n),
                               ("backward_weight_per_stage", n), ("backward_per_stage", n),
                               ("between_per_rank", p),
                               ("check_per_rank", p)):
        v = getattr(d, name)
        if v is not None and len(v) != size:
            raise ValueError(f"Durations.{name} has {len(v)} entries; the schedule has "
                             f"{size} {what}")
    if min(d.forward, d.backward_input, d.backward_weight, d.p2p, d.post, d.between, d.gap,
           d.check, *(d.between_per_rank or ()), *(d.check_per_rank or ()),
           *(d.backward_per_stage or ()), *(d.per_action or {}).values()) < 0:
        raise ValueError("durations must be >= 0")


def _check_steps(schedule: Schedule, d: Durations, steps: int) -> None:
    """A replay's per-step durations: at most one dict a step, one tuple of pp times
    between each step and the next, none negative."""
    own, between = (d.per_action_steps or ()) + (d.gap_steps or ()), d.between_steps or ()
    if max(len(d.per_action_steps or ()), len(d.gap_steps or ())) > steps or len(
            between) > steps - 1:
        raise ValueError(f"Durations.per_action_steps has {len(d.per_action_steps or ())} "
                         f"steps, gap_steps {len(d.gap_steps or ())} and between_steps "
                         f"{len(between)}, for {steps} steps")
    if any(len(b) != schedule.pp for b in between):
        raise ValueError(f"Durations.between_steps: each entry needs {schedule.pp} ranks")
    if min((x for o in own for x in o.values()), default=0.0) < 0 or min(
            (x for b in between for x in b), default=0.0) < 0:
        raise ValueError("durations must be >= 0")
