"""The list scheduler behind zb-v and dualpipe (`schedules.py`): a greedy order searched for
given durations, the heuristic of Qi et al. 2023 section 3 in its simplest form.

Event-driven: what lands when is keyed by time, with a heap of those times, and
each rank keeps heaps of its ready actions, so a build costs O(n log n) in its n actions
(a rescanning scheduler costs about n^2; tests/test_schedule_oracle.py holds this one to
the rescanning one's recorded orders for dualpipe, and to its own for zb-v since zb-v's quota
counts what a W holds; tests/test_simulate_steps.py counts its work).
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections.abc import Callable
from itertools import repeat

from plait.schedule.ir import Action, Schedule
from plait.schedule.simulate import Durations

_KINDS = ("F", "I", "W")  # the list scheduler's kinds, by index
Quota = Callable[[int], tuple[object, int, str]]  # stage -> (key, limit, gate)
GATES = ("open", "room", "sure")  # a stage's F: never waits; waits at the limit; see below
Lead = Callable[[int], tuple[int, int] | None]  # stage -> (other stage, most F's ahead)


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
    freed_by: str = "I",
    lead: Lead | None = None,
) -> Schedule:
    """Greedy list scheduling, the heuristic of Qi et al. 2023 section 3 in its simplest
    form, run on the given durations (default T_F = T_I = T_W = 1, transfers free).
    An F is admitted if its memory quota allows: `quota(stage)` = (key, limit, gate),
    stages sharing a key count their activations together, +1 at F, -1 at `freed_by`:
    "I" counts a micro-batch's activations until its I; "W" also what its W still holds
    (the weight-gradient matmuls' inputs and output gradients: nearly all of it, Qi et al.
    2023, Table 1; the paper's ZB-H1, ZB-H2 and ZB-V memory bounds count this way). Gate
    "open": the F never waits; "room": it waits while the count is at `limit`; "sure":
    also while the count is at `limit` - 1 unless one of those counted is sure to be
    freed with no further F admitted anywhere (its micro-batch's F has reached the
    chain's last stage; only I's and W's remain), so that the last unit of room is never
    taken by activations that only an F this rank has no room for could free (a
    deadlock). With `lead`, stage s's F also waits while it has run `most` more F's than
    `other` (`lead(s)` = (other, most), or None): how far a V's way down may run ahead
    of its way back up on the same rank, whose F's need the room as much.
    Whenever a rank is free it runs, of the actions whose inputs have arrived, with
    freed_by "I":
      1. an I (the backward chain is the critical path; it also frees memory), oldest
         micro-batch first, then the stage nearer the loss;
      2. else the admitted F of the oldest micro-batch, then the stage nearer the loss;
      3. else a W (it fills what would be a bubble), oldest first.
    With freed_by "W", where a W is what frees the room, an admitted F first (it feeds
    the next rank), else, if some F is there but held back (quota or lead), a W (the room
    that F needs), else an I, else a W: per micro-batch and stage F, I, W back to back once the
    room is full, the pattern of the paper's ZB-V (section 6).
    The resulting order is the schedule: plain data, valid under any durations, tuned for
    the ones it was built with. `layout`, a list, receives [durations, starts, ends]:
    per rank when each action starts and ends, which is `simulate`'s lay-out of the order
    for those durations when all are positive (a rank starts an action the moment it is
    free and the inputs are there; tests/test_schedules.py), so that a caller simulating
    the same durations need not lay it out again."""
    shape = Schedule(name, p, m, v, len(stage_to_rank), stage_to_rank, [[]] * p, chains)
    scheduler = ListScheduler(shape, quota, durations or Durations(1.0, 1.0, 1.0), freed_by,
                              lead)
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

    def __init__(self, shape: Schedule, quota: Quota, d: Durations, freed_by: str = "I",
                 lead: Lead | None = None):
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
        rows = self._quotas(quota, freed_by, lead)  # per stage, what may hold its F back
        # an action's code is 3 * (mb * n + n-1-s) + kind: its key on a ready heap (oldest
        # micro-batch first, then the stage nearer the loss) and its kind; a code mod 3n
        # names (kind, stage), and the next kind of the same (s, mb) is code + 1
        self.n3 = 3 * n
        self.missing = bytearray(3 * n * m)  # inputs still missing; at 0: ready
        self.action: list[Action | None] = [None] * (3 * n * m)  # each code's Action
        self.ready_i: list[list[int]] = [[] for _ in range(p)]  # keys mb * n + n-1-s
        self.ready_w: list[list[int]] = [[] for _ in range(p)]
        self.ready_f: list[list[tuple[int, list[int], int, float, float, int, float]]] = [
            [(s, [], *rows[s]) for s in shape.stages_on(r)] for r in range(p)]
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
        self.free = [0.0] * p
        self.acts: list[list[Action]] = [[] for _ in range(p)]
        self.starts: list[list[float]] = [[] for _ in range(p)]  # per rank, each action's
        self.ends: list[list[float]] = [[] for _ in range(p)]
        self.landing: dict[float, list[int]] = {}  # time -> inputs (codes), ~rank free
        self.times: list[float] = []  # heap of the moments ahead
        self.visits = 0  # (moment, rank) looks: at most one per rank per thing landing

    def _quotas(self, quota: Quota, freed_by: str, lead: Lead | None) -> list[tuple]:
        """The counts an F is admitted by (list_schedule's docstring); per stage (its
        quota key, limit, most unsure, the stage it may run ahead of, by at most)."""
        shape, n = self.shape, self.n
        quotas = [quota(s) for s in range(n)]
        if freed_by not in ("I", "W") or any(q[2] not in GATES for q in quotas):
            raise ValueError(f"freed_by {freed_by!r} must be I or W, each gate one of {GATES}")
        ids = {key: k for k, key in enumerate(dict.fromkeys(q[0] for q in quotas))}
        self.keys = [ids[q[0]] for q in quotas]  # stages sharing a key count together
        self.live = [0] * len(ids)  # per quota key: admitted and not yet freed
        self.delta = (1, -1, 0) if freed_by == "I" else (1, 0, -1)  # per kind F, I, W
        self.f_first = freed_by == "W"  # the priorities (list_schedule's docstring)
        self.started = [0] * (n + 1)  # F's started per stage (+ a stage n that has none)
        # per quota key, those admitted whose micro-batch's F has not reached the chain's
        # last stage; an F changes these counts by on_f[its stage]: its own +1, or, the
        # last stage's, -1 for each earlier stage of its chain (they are sure now)
        self.unsure = [0] * len(ids)
        self.on_f = [[(self.keys[s], 1)] for s in range(n)]
        for s in range(n):
            if shape.next_stage(s) is None:
                back, at = [], shape.prev_stage(s)
                while at is not None:
                    back.append((self.keys[at], -1))
                    at = shape.prev_stage(at)
                self.on_f[s] = back
        inf = float("inf")
        # "sure": besides the limit, at most limit - 1 counted may be unsure to be freed
        return [(self.keys[s], q[1] if q[2] != "open" else inf,
                 q[1] - 1 if q[2] == "sure" and shape.next_stage(s) is not None else inf,
                 *((lead and lead(s)) or (n, inf))) for s, q in enumerate(quotas)]

    def _pick(self, r: int) -> tuple[int, list[int]] | None:
        """What rank r starts now, (kind, its ready heap), by the priorities of
        `freed_by` (list_schedule's docstring); None: nothing."""
        live, unsure, started, f_first = self.live, self.unsure, self.started, self.f_first
        heap, held = None, False  # the best F admitted; is one held back?
        for st, h, key, limit, most_unsure, other, most_ahead in self.ready_f[r]:
            if h:
                if live[key] < limit and unsure[key] < most_unsure and \
                        started[st] - started[other] < most_ahead:
                    if heap is None or h[0] < heap[0]:
                        heap = h
                else:
                    held = True
        if heap is not None and f_first:
            return 0, heap
        if f_first and held and self.ready_w[r]:
            return 2, self.ready_w[r]
        if self.ready_i[r]:
            return 1, self.ready_i[r]
        if heap is not None:
            return 0, heap
        return (2, self.ready_w[r]) if self.ready_w[r] else None

    def run(self) -> list[list[Action]]:
        n, n3, p, dur, live, free, todo = (self.n, self.n3, self.p, self.dur, self.live,
                                           self.free, self.todo)
        outs, missing, landing, times = (self.f_to, self.i_to), self.missing, self.landing, \
            self.times
        keys, delta, unsure, on_f, started, pick = (self.keys, self.delta, self.unsure,
                                                    self.on_f, self.started, self._pick)
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
                chosen = pick(r)
                if chosen is None:
                    continue
                kind, heap = chosen
                key = pop(heap)
                s, code = n - 1 - key % n, 3 * key + kind
                end = t + dur[kind][s]
                free[r] = end
                todo[r] -= 1
                act_at[r](action[code])
                start_at[r](t)
                end_at[r](end)
                live[keys[s]] += delta[kind]
                if not kind:
                    started[s] += 1
                    for k, change in on_f[s]:
                        unsure[k] += change
                if end > t:
                    at = landing.get(end)
                    if at is None:
                        landing[end] = at = []
                        push(times, end)
                    if kind == 2:
                        at.append(~r)  # the rank is free
                    else:  # the rank is free, and its own I (W) has this input
                        at.append(-(code + 1) - p - 1)
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
