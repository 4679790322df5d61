"""Schedule builders: name, pp, micro-batches, virtual stages -> per-rank compute actions.

Each builder takes (p, m, v) (the list-scheduled ones also `durations`) and returns an
unlowered `Schedule` (compute actions only; `lower.py` adds the transfers). A builder
trusts its request: call `registry.build_schedule`, which checks it first (the registry,
registry.py, holds every other fact about each schedule). Placement per schedule:
  gpipe, 1f1b, zb-h1, zb-h2   one stage per rank (stage s on rank s)
  interleaved                 v stages per rank, round-robin: stage s on rank s % p
  zb-v, dualpipev             2 stages per rank in a V: rank r holds stages r and 2p-1-r
  dualpipe                    two chains (see ir.py): stage j and stage p+j, rank j and
                              rank p-1-j; micro-batches 0..m/2-1 go down, m/2..m-1 go up
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from plait.parallel.pipeline.ir import Action, Schedule
from plait.parallel.pipeline.ir import trusted as _act
from plait.parallel.pipeline.simulate import Durations


def _linear(name: str, p: int, m: int, actions: list[list[Action]]) -> Schedule:
    return Schedule(name, p, m, 1, p, list(range(p)), actions)


# --- one stage per rank -------------------------------------------------------------------


def build_gpipe(p: int, m: int, v: int) -> Schedule:
    """All forwards, then all backwards (Huang et al. 2019). Peak activations m per rank."""
    acts = [
        [_act("F", r, i) for i in range(m)] + [_act("B", r, i) for i in range(m)]
        for r in range(p)
    ]
    return _linear("gpipe", p, m, acts)


def build_1f1b(p: int, m: int, v: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021): rank r runs p-1-r warm-up forwards,
    then alternates one forward, one backward; at most p-r activations alive."""
    acts = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        seq = [_act("F", r, i) for i in range(warm)]
        for k in range(m):
            if warm + k < m:
                seq.append(_act("F", r, warm + k))
            seq.append(_act("B", r, k))
        acts.append(seq)
    return _linear("1f1b", p, m, acts)


def build_zb_h1(p: int, m: int, v: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, section 2.1): 1F1B with B split into I and W, and rank r
    deferring its W's by r micro-batches. The I chain no longer waits for W's, so the
    bubble shrinks to (p-1)(T_F+T_I-T_W) while activations stay at 1F1B's p-r (the r
    deferred W's hold only weight-gradient inputs)."""
    return _split_1f1b("zb-h1", p, m, warm=lambda r: p - 1 - r, w_delay=lambda r: r)


def build_zb_h2(p: int, m: int, v: int) -> Schedule:
    """ZB-H2 (Qi et al. 2023, section 2.2): 2(p-1-r) warm-up forwards fill the time until
    the first gradient returns, and W's are deferred by 2r micro-batches to fill the tail.
    Rank 0 holds up to 2p-1 activations. Every rank then works without a gap from its first
    action to its last (a parallelogram) when m >= 2p-1 and 2 T_W <= T_F + T_I."""
    return _split_1f1b("zb-h2", p, m, warm=lambda r: 2 * (p - 1 - r), w_delay=lambda r: 2 * r)


def _split_1f1b(name: str, p: int, m: int, warm, w_delay) -> Schedule:
    """Warm-up forwards, then per micro-batch k: F (next), I k, W (k - delay)."""
    acts = []
    for r in range(p):
        w = min(warm(r), m)
        seq = [_act("F", r, i) for i in range(w)]
        next_w = 0
        for k in range(m):
            if w + k < m:
                seq.append(_act("F", r, w + k))
            seq.append(_act("I", r, k))
            if k >= w_delay(r):
                seq.append(_act("W", r, next_w))
                next_w += 1
        seq += [_act("W", r, i) for i in range(next_w, m)]
        acts.append(seq)
    return _linear(name, p, m, acts)


# --- several stages per rank --------------------------------------------------------------


def build_interleaved(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2), Megatron-LM's order: stage s on
    rank s % p; forwards go in rounds of p micro-batches per chunk (chunk 0 for mb 0..p-1,
    chunk 1 for the same mbs, ..., then mb p..2p-1), backwards in the same rounds with the
    chunks reversed; rank r warms up with 2(p-1-r) + (v-1)p forwards. Bubble time
    (p-1)(T_F+T_B) in per-stage times: 1/v of 1F1B's."""
    total = m * v  # stage-microbatch forwards per rank

    def mb_of(k: int) -> int:
        return (k // (p * v)) * p + k % p

    acts = []
    for r in range(p):

        def fwd(k: int, r: int = r) -> Action:
            return _act("F", ((k // p) % v) * p + r, mb_of(k))

        def bwd(k: int, r: int = r) -> Action:
            return _act("B", (v - 1 - (k // p) % v) * p + r, mb_of(k))

        warm = min(2 * (p - 1 - r) + (v - 1) * p, total)
        seq = [fwd(k) for k in range(warm)]
        for k in range(total - warm):
            seq += [fwd(warm + k), bwd(k)]
        seq += [bwd(k) for k in range(total - warm, total)]
        acts.append(seq)
    return Schedule("interleaved", p, m, v, p * v, [s % p for s in range(p * v)], acts)


def _v_placement(p: int) -> list[int]:
    """Rank r holds stages r and 2p-1-r: the model goes down the ranks and back up."""
    return list(range(p)) + list(range(p - 1, -1, -1))


def build_zb_v(p: int, m: int, v: int, durations: Durations | None = None) -> Schedule:
    """ZB-V (Qi et al. 2023, section 6): V placement, B split into I/W, about 2p stage
    activations per rank (= 1F1B's peak p, as each stage is half a rank's layers). The
    order comes from the list scheduler below, run with `durations` (default T_F = T_I =
    T_W). With equal durations and m >= 2p: peak exactly 2p, and every rank works without
    a gap between its first and last action. With unequal ones the peak can exceed 2p by
    a little, as the way up is never held back."""
    # both stages of a rank count against 2p, but only the way down (stage r) waits for
    # room: were the way up gated too, rank r full of micro-batches going down and rank
    # r+1 full of ones coming back up would each wait for the other (deadlock)
    return _list_schedule(
        "zb-v",
        p,
        m,
        2,
        _v_placement(p),
        1,
        lambda s: (min(s, 2 * p - 1 - s), 2 * p, s < p),
        durations,
    )


def build_dualpipe(p: int, m: int, v: int, durations: Durations | None = None) -> Schedule:
    """DualPipe (DeepSeek-V3 technical report, 2024, section 3.2.1): two chains over two
    copies of the model, micro-batches 0..m/2-1 enter at rank 0, m/2..m-1 at rank p-1, so
    each end's warm-up fills the other's bubble. Order from the list scheduler with at most
    p+1 activations per rank (the report's Table 2)."""
    placement = list(range(p)) + list(range(p - 1, -1, -1))
    # a 1F1B-like quota per chain: p - j micro-batches on the stage computing block j, so
    # rank r holds (p - r) + (r + 1) = p + 1; separate quotas keep the chains from
    # blocking each other
    return _list_schedule(
        "dualpipe", p, m, 1, placement, 2, lambda s: (s, p - s % p, True), durations
    )


def build_dualpipev(p: int, m: int, v: int) -> Schedule:
    """DualPipeV, DualPipe "cut in half" onto a V (rank r: chunk 0 = stage r, chunk 1 =
    stage 2p-1-r), written from DualPipe's published phase structure. Per rank:
      1. 2(p-1-r) forwards of chunk 0            5. p-1-r x (B chunk 1, F 1, B 0)
      2. r+1 x (F 0, F 1)                          6. r+1 x (B 1, B 0); the later half split
      3. p-1-r x (I 1, W 1, F 1)                      into I + deferred W
      4. m-2p+r+1 x (F 0, B 1, F 1, B 0)           7. p-1-r x (W, I 0)
         (DualPipe overlaps each F with the B    8. the remaining W's
         beside it; this model runs them in turn)
    Needs m >= 2p-1 so that phase 4 is not negative on rank 0."""
    acts = []
    for r in range(p):
        stage = (r, 2 * p - 1 - r)
        nxt = {"F": [0, 0], "B": [0, 0]}
        pending_w: list[Action] = []
        seq: list[Action] = []

        def f(c: int, seq=seq, nxt=nxt, stage=stage) -> None:
            seq.append(_act("F", stage[c], nxt["F"][c]))
            nxt["F"][c] += 1

        def b(c: int, split: bool, seq=seq, nxt=nxt, stage=stage, pw=pending_w) -> None:
            mb = nxt["B"][c]
            nxt["B"][c] += 1
            if split:
                seq.append(_act("I", stage[c], mb))
                pw.append(_act("W", stage[c], mb))
            else:
                seq.append(_act("B", stage[c], mb))

        for _ in range(2 * (p - 1 - r)):
            f(0)
        for _ in range(r + 1):
            f(0)
            f(1)
        for _ in range(p - 1 - r):
            b(1, True)
            seq.append(pending_w.pop(0))
            f(1)
        for _ in range(m - 2 * p + r + 1):
            f(0)
            b(1, False)
            f(1)
            b(0, False)
        for _ in range(p - 1 - r):
            b(1, False)
            f(1)
            b(0, False)
        for i in range(r + 1):
            b(1, i >= (r + 1) // 2)
            b(0, i >= (r + 1) // 2)
        for _ in range(p - 1 - r):
            if pending_w:
                seq.append(pending_w.pop(0))
            b(0, True)
        seq += pending_w
        acts.append(seq)
    return Schedule("dualpipev", p, m, 2, 2 * p, _v_placement(p), acts)


_KINDS = ("F", "I", "W")  # the list scheduler's kinds, by index
Quota = Callable[[int], tuple[object, int, bool]]  # stage -> (key, limit, gated)
Item = tuple[int, int, int, str]  # (priority, micro-batch, -stage, kind): min() picks


def _list_schedule(
    name: str,
    p: int,
    m: int,
    v: int,
    stage_to_rank: list[int],
    chains: int,
    quota: Quota,
    durations: Durations | None = None,
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
    the ones it was built with."""
    shape = Schedule(name, p, m, v, len(stage_to_rank), stage_to_rank, [[]] * p, chains)
    acts = _ListScheduler(shape, quota, durations or Durations(1.0, 1.0, 1.0)).run()
    return Schedule(name, p, m, v, len(stage_to_rank), stage_to_rank, acts, chains)


class _ListScheduler:
    """One run of `_list_schedule`, event-driven: what lands when (inputs, ranks falling
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
        self.p2p = d.p2p
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
        # inputs still missing per kind * n * m + stage * m + mb; at 0 the action is ready
        self.missing = bytearray(3 * n * m)
        self.ready_i: list[list[int]] = [[] for _ in range(p)]  # codes mb * n + n-1-s
        self.ready_w: list[list[int]] = [[] for _ in range(p)]
        self.ready_f: list[list[tuple[int, list[int], int, float]]] = [
            [(s, [], self.keys[s], limits[s]) for s in shape.stages_on(r)] for r in range(p)]
        self.ready_f_of = {row[0]: row[1] for rows in self.ready_f for row in rows}
        self.todo = [0] * p  # actions each rank has left
        for mb in range(m):
            for s in shape.stages_of(mb):
                self.todo[rank_of[s]] += 3
                i = s * m + mb
                self.missing[i] = 0 if shape.prev_stage(s) is None else 1
                self.missing[n * m + i] = 1 if self.f_to[s][0] < 0 else 2
                self.missing[2 * n * m + i] = 1
                if not self.missing[i]:
                    self.ready_f_of[s].append(mb * n + n - 1 - s)
        self.live = [0] * len(ids)  # per quota key: admitted and not yet freed
        self.free = [0.0] * p
        self.acts: list[list[Action]] = [[] for _ in range(p)]
        self.landing: dict[float, list[int]] = {}  # time -> inputs (codes), ~rank free
        self.times: list[float] = []  # heap of the moments ahead
        self.visits = 0  # (moment, rank) looks: at most one per rank per thing landing

    def run(self) -> list[list[Action]]:
        n, m, nm = self.n, self.m, self.n * self.m
        dur, live, free, todo = self.dur, self.live, self.free, self.todo
        outs = (self.f_to, self.i_to)
        missing, landing, times, acts = self.missing, self.landing, self.times, self.acts
        ready_i, ready_w, ready_f = self.ready_i, self.ready_w, self.ready_f
        keys, names, new = self.keys, _KINDS, tuple.__new__
        rank_of, ready_f_of = self.rank_of, self.ready_f_of
        phantom = self.p2p if self.zero else 0.0
        push, pop = heapq.heappush, heapq.heappop
        t, due = 0.0, list(range(self.p))  # at 0 every rank looks
        while True:
            for code in landing.pop(t, ()):
                if code < 0:
                    due.append(~code)  # the rank is free
                    continue
                missing[code] -= 1
                if missing[code]:
                    continue
                kind, rest = divmod(code, nm)  # all its inputs are there: ready
                s, mb = divmod(rest, m)
                r = rank_of[s]
                push(ready_f_of[s] if kind == 0 else ready_i[r] if kind == 1 else ready_w[r],
                     mb * n + n - 1 - s)
                due.append(r)
            ranks, due = sorted(set(due)), []
            self.visits += len(ranks)
            while ranks:  # lowest rank first; each starts at most one action
                r = pop(ranks)
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
                mb, rest = divmod(pop(heap), n)
                s = n - 1 - rest
                end = t + dur[kind][s]
                free[r] = end
                todo[r] -= 1
                acts[r].append(new(Action, (names[kind], s, mb, None)))
                if end > t:
                    at = landing.get(end)
                    if at is None:
                        landing[end] = at = []
                        push(times, end)
                    at.append(~r)  # the rank is free
                    if kind < 2:
                        live[keys[s]] += 1 - 2 * kind
                        at.append((kind + 1) * nm + s * m + mb)  # its own I (W) may run
                        dst, hop = outs[kind][s]
                        if dst >= 0:  # the peer's input
                            at = landing.get(end + hop)
                            if at is None:
                                landing[end + hop] = at = []
                                push(times, end + hop)
                            at.append(kind * nm + dst * m + mb)
                else:  # zero duration: higher ranks see it now, lower ones next moment
                    for r2 in self._zero_duration(r, kind, s, mb, end, t):
                        (push(ranks, r2) if r2 > r and r2 not in ranks else due.append(r2))
                if phantom:  # the finish + p2p moments with nothing landing
                    push(times, end + phantom)
            while times and times[0] <= t:
                pop(times)
            if not times:
                break
            t = pop(times)
        if any(todo):  # cannot happen: some action is always ready eventually
            raise RuntimeError(f"list scheduler for {self.shape.name} made no progress")
        return acts

    def _zero_duration(self, r: int, kind: int, s: int, mb: int, end: float,
                       t: float) -> list[int]:
        """What a zero-duration action lands at t itself; the ranks that may act on it."""
        nm = self.n * self.m
        out = [r]
        if kind < 2:
            self.live[self.keys[s]] += 1 - 2 * kind
            lands = [((kind + 1) * nm + s * self.m + mb, end)]
            dst, hop = (self.f_to, self.i_to)[kind][s]
            if dst >= 0:
                lands.append((kind * nm + dst * self.m + mb, end + hop))
            for code, at in lands:
                if at > t:
                    if at not in self.landing:
                        self.landing[at] = []
                        heapq.heappush(self.times, at)
                    self.landing[at].append(code)
                else:
                    self.missing[code] -= 1
                    if not self.missing[code]:
                        out.append(self._ready(code))
        return out

    def _ready(self, code: int) -> int:
        """Put the action `code` (all its inputs there) on its rank's heap; the rank."""
        kind, rest = divmod(code, self.n * self.m)
        s, mb = divmod(rest, self.m)
        r = self.rank_of[s]
        heap = self.ready_f_of[s] if kind == 0 else (self.ready_i[r] if kind == 1
                                                        else self.ready_w[r])
        heapq.heappush(heap, mb * self.n + self.n - 1 - s)
        return r
