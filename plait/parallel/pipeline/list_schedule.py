"""The list scheduler behind zb-v and dualpipe (`schedules.py`): a greedy order searched for
given durations, the heuristic of Qi et al. 2023 section 3 in its simplest form.

Event-driven (issue 11): what lands when is keyed by time, with a heap of those times, and
each rank keeps heaps of its ready actions, so a build costs O(n log n) in its n actions
(the rescanning scheduler it replaced cost about n^2; tests/test_schedule_oracle.py holds
this one to that one's orders, tests/test_simulate_steps.py counts its work).
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections.abc import Callable
from itertools import repeat

from plait.parallel.pipeline.ir import Action, Schedule
from plait.parallel.pipeline.simulate import Durations

_KINDS = ("F", "I", "W")  # the list scheduler's kinds, by index
Quota = Callable[[int], tuple[object, int, bool]]  # stage -> (key, limit, gated)


def list_schedule(
    name: str,
    p: int,
    m: int,
    v: int,
    stage_to_rank: list[int],
    chains: int,
    quota: Quota,
    durations: Durations | None = None,
    layout: list | None = None,
) -> Schedule:
    """Greedy list scheduling, the heuristic of Qi et al. 2023 section 3 in its simplest
    form, run on the given durations (default T_F = T_I = T_W = 1, transfers free).
    Whenever a rank is free it runs, of the actions whose inputs have arrived:
      1. an I (the backward chain is the critical path; it also frees memory), oldest
         micro-batch first, then the stage nearer the loss;
      2. else an F, oldest micro-batch first, if its memory quota allows:
         `quota(stage)` = (key, limit, gated): stages sharing a key count their
         activations together (+1 at F, -1 at I); a gated stage's F waits while the count
         is at `limit`;
      3. else a W (it fills what would be a bubble), oldest first.
    The resulting order is the schedule: plain data, valid under any durations, tuned for
    the ones it was built with. `layout`, a list, receives [durations, starts, ends]:
    per rank when each action starts and ends, which is `simulate`'s lay-out of the order
    for those durations when all are positive (a rank starts an action the moment it is
    free and the inputs are there; tests/test_schedules.py), so that a caller simulating
    the same durations need not lay it out again."""
    shape = Schedule(name, p, m, v, len(stage_to_rank), stage_to_rank, [[]] * p, chains)
    scheduler = ListScheduler(shape, quota, durations or Durations(1.0, 1.0, 1.0))
    acts = scheduler.run()
    if layout is not None and not scheduler.zero:
        layout += [scheduler.durations, scheduler.starts, scheduler.ends]
    return Schedule(name, p, m, v, len(stage_to_rank), stage_to_rank, acts, chains)


class ListScheduler:
    """One run of `list_schedule`, event-driven: what lands when (inputs, ranks falling
    free) keyed by time, a heap of those times, and per rank heaps of the actions whose
    inputs are all there (I, W, and F per stage), so each action costs O(log n).

    It reproduces a clock that, at every moment (each finish, and each finish + p2p),
    lets each free rank, lowest first, start its best ready action: a rank starts at most
    one action per moment, and an input that lands the moment it is produced (a zero
    duration) is seen by higher ranks at that moment, by lower ones at the next."""

    def __init__(self, shape: Schedule, quota: Quota, d: Durations):
        p, m, n = shape.pp, shape.microbatches, shape.num_stages
        self.shape, self.p, self.m, self.n = shape, p, m, n
        rank_of = self.rank_of = shape.stage_to_rank
        self.dur = [[d.of(k, s) for s in range(n)] for k in _KINDS]  # [F, I, W][stage]
        self.p2p, self.durations = d.p2p, d
        # zero durations make inputs land at the moment they are produced: then the
        # moments with nothing landing (finish + p2p of a W, ...) matter too
        self.zero = min(min(x) for x in self.dur) <= 0

        def to(stage: int | None, s: int) -> tuple[int, float]:
            if stage is None:
                return -1, 0.0
            return stage, (d.p2p if rank_of[stage] != rank_of[s] else 0.0)

        self.f_to = [to(shape.next_stage(s), s) for s in range(n)]  # F s feeds F (s+1)
        self.i_to = [to(shape.prev_stage(s), s) for s in range(n)]  # I s feeds I (s-1)
        quotas = [quota(s) for s in range(n)]
        ids = {key: k for k, key in enumerate(dict.fromkeys(q[0] for q in quotas))}
        self.keys = [ids[q[0]] for q in quotas]  # stages sharing a key count together
        limits = [q[1] if q[2] else float("inf") for q in quotas]  # ungated: no limit
        # an action's code is 3 * (mb * n + n-1-s) + kind: its key on a ready heap (oldest
        # micro-batch first, then the stage nearer the loss) and its kind; a code mod 3n
        # names (kind, stage), and the next kind of the same (s, mb) is code + 1
        self.n3 = 3 * n
        self.missing = bytearray(3 * n * m)  # inputs still missing; at 0: ready
        self.action: list[Action | None] = [None] * (3 * n * m)  # each code's Action
        self.ready_i: list[list[int]] = [[] for _ in range(p)]  # keys mb * n + n-1-s
        self.ready_w: list[list[int]] = [[] for _ in range(p)]
        self.ready_f: list[list[tuple[int, list[int], int, float]]] = [
            [(s, [], self.keys[s], limits[s]) for s in shape.stages_on(r)] for r in range(p)]
        ready_f_of = {row[0]: row[1] for rows in self.ready_f for row in rows}
        self.heap_of = [ready_f_of[n - 1 - j // 3] if j % 3 == 0 else
                        (self.ready_i, self.ready_w)[j % 3 - 1][rank_of[n - 1 - j // 3]]
                        for j in range(3 * n)]  # by code mod 3n
        self.rank_of_code = [rank_of[n - 1 - j // 3] for j in range(3 * n)]
        self.todo = [0] * p  # actions each rank has left
        for s in range(n):  # per stage, its chain's micro-batches (a contiguous range)
            mbs = shape.microbatches_of(s)
            i, first = len(mbs), shape.prev_stage(s) is None
            self.todo[rank_of[s]] += 3 * i
            for kind, need in enumerate((0 if first else 1, 1 if self.f_to[s][0] < 0 else 2,
                                         1)):
                lo = 3 * (mbs.start * n + n - 1 - s) + kind
                cut = slice(lo, lo + 3 * n * i, 3 * n)  # every mb's code, by C slicing
                self.missing[cut] = bytes([need]) * i
                self.action[cut] = list(map(tuple.__new__, repeat(Action), zip(
                    repeat(_KINDS[kind]), repeat(s), mbs, repeat(None))))
            if first:  # ready from the start, oldest first (already a heap)
                ready_f_of[s].extend(range(mbs.start * n + n - 1 - s, mbs.stop * n, n))
        self.live = [0] * len(ids)  # per quota key: admitted and not yet freed
        self.free = [0.0] * p
        self.acts: list[list[Action]] = [[] for _ in range(p)]
        self.starts: list[list[float]] = [[] for _ in range(p)]  # per rank, each action's
        self.ends: list[list[float]] = [[] for _ in range(p)]
        self.landing: dict[float, list[int]] = {}  # time -> inputs (codes), ~rank free
        self.times: list[float] = []  # heap of the moments ahead
        self.visits = 0  # (moment, rank) looks: at most one per rank per thing landing

    def run(self) -> list[list[Action]]:
        n, n3, p, dur, live, free, todo = (self.n, self.n3, self.p, self.dur, self.live,
                                           self.free, self.todo)
        outs, missing, landing, times = (self.f_to, self.i_to), self.missing, self.landing, \
            self.times
        ready_i, ready_w, ready_f, keys = self.ready_i, self.ready_w, self.ready_f, self.keys
        action, heap_of, rank_of_code = self.action, self.heap_of, self.rank_of_code
        act_at, start_at, end_at = ([x.append for x in lists]
                                    for lists in (self.acts, self.starts, self.ends))
        phantom, push, pop = self.p2p if self.zero else 0.0, heapq.heappush, heapq.heappop
        t, due = 0.0, list(range(self.p))  # at 0 every rank looks
        while True:
            for code in landing.pop(t, ()):
                if code < 0:  # a rank is free: ~r after a W, else -(next code) - p - 1
                    if code >= -p:
                        due.append(~code)
                        continue
                    code = -code - p - 1  # after an F or I: its own I or W has its input
                    due.append(rank_of_code[code % n3])
                missing[code] -= 1
                if not missing[code]:  # all its inputs are there: ready
                    j = code % n3
                    push(heap_of[j], code // 3)
                    due.append(rank_of_code[j])
            ranks, due = sorted(set(due)), []
            self.visits += len(ranks)
            for r in ranks:  # lowest rank first; each starts at most one action
                if free[r] > t or not todo[r]:
                    continue
                kind, heap = 1, ready_i[r]  # an I, else the best F its quota admits, else W
                if not heap:
                    kind, heap = 0, None
                    for _stage, h, key, limit in ready_f[r]:
                        if h and (heap is None or h[0] < heap[0]) and live[key] < limit:
                            heap = h
                    if heap is None:
                        kind, heap = 2, ready_w[r]
                        if not heap:
                            continue
                key = pop(heap)
                s, code = n - 1 - key % n, 3 * key + kind
                end = t + dur[kind][s]
                free[r] = end
                todo[r] -= 1
                act_at[r](action[code])
                start_at[r](t)
                end_at[r](end)
                if end > t:
                    at = landing.get(end)
                    if at is None:
                        landing[end] = at = []
                        push(times, end)
                    if kind == 2:
                        at.append(~r)  # the rank is free
                    else:  # the rank is free, and its own I (W) has this input
                        at.append(-(code + 1) - p - 1)
                        live[keys[s]] += 1 - 2 * kind
                        dst, hop = outs[kind][s]
                        if dst >= 0:  # the peer's input: F (s+1) is key - 1, I (s-1) + 1
                            if hop:  # (free transfers: it lands with the rest at end)
                                at = landing.get(end + hop)
                                if at is None:
                                    landing[end + hop] = at = []
                                    push(times, end + hop)
                            at.append(code + 6 * kind - 3)
                else:  # zero duration: higher ranks see it now, lower ones next moment
                    for r2 in self._zero_duration(r, kind, s, code, end, t):
                        (insort(ranks, r2) if r2 > r and r2 not in ranks else due.append(r2))
                if phantom:  # the finish + p2p moments with nothing landing
                    push(times, end + phantom)
            while times and times[0] <= t:
                pop(times)
            if not times:  # nothing lands later: a rank told to look next looks at t
                if not due:
                    break
                continue
            t = pop(times)
        if any(todo):  # cannot happen: some action is always ready eventually
            raise RuntimeError(f"list scheduler for {self.shape.name} made no progress")
        return self.acts

    def _zero_duration(self, r: int, kind: int, s: int, code: int, end: float,
                       t: float) -> list[int]:
        """What a zero-duration action lands at t itself; the ranks that may act on it."""
        out = [r]
        if kind < 2:
            self.live[self.keys[s]] += 1 - 2 * kind
            lands = [(code + 1, end)]
            dst, hop = (self.f_to, self.i_to)[kind][s]
            if dst >= 0:
                lands.append((code + 6 * kind - 3, end + hop))
            for c, at in lands:
                if at > t:
                    if at not in self.landing:
                        self.landing[at] = []
                        heapq.heappush(self.times, at)
                    self.landing[at].append(c)
                else:
                    self.missing[c] -= 1
                    if not self.missing[c]:
                        j = c % self.n3
                        heapq.heappush(self.heap_of[j], c // 3)
                        out.append(self.rank_of_code[j])
        return out
