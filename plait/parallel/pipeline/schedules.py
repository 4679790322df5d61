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
    """One run of `_list_schedule`, event-driven: a heap of the moments anything can change
    (each finish, and each finish + p2p), and per rank heaps of the actions whose inputs
    have arrived (I, W, and F per stage), so each action is touched O(log n) times.

    The moments and the order ranks are served in are those of a clock that, at every
    moment, lets each free rank (0, 1, ...) start its best ready action: a rank starts at
    most one action per moment, and an input that arrives at the moment it is produced
    (a zero duration) is seen by higher ranks at that moment, by lower ones at the next."""

    def __init__(self, shape: Schedule, quota: Quota, d: Durations):
        self.shape, self.quota = shape, quota
        p, self.m, n = shape.pp, shape.microbatches, shape.num_stages
        self.p2p = d.p2p
        self.dur = {k: [d.of(k, s) for s in range(n)] for k in ("F", "I", "W")}
        self.rank_of = shape.stage_to_rank
        self.quotas = [quota(s) for s in range(n)]
        # inputs still missing per (kind, stage * m + mb); at 0 the action is ready
        self.missing = {"F": [0 if shape.prev_stage(s) is None else 1 for s in range(n)],
                        "I": [1 if shape.next_stage(s) is None else 2 for s in range(n)]}
        self.waiting = {k: bytearray(n * self.m) for k in ("F", "I", "W")}
        for mb in range(self.m):
            for s in shape.stages_of(mb):
                self.waiting["F"][s * self.m + mb] = self.missing["F"][s]
                self.waiting["I"][s * self.m + mb] = self.missing["I"][s]
                self.waiting["W"][s * self.m + mb] = 1
        self.ready_i: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.ready_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.ready_f: list[list[tuple[int, list]]] = [
            [(s, []) for s in shape.stages_on(r)] for r in range(p)]
        self.ready_f_of = {s: heap for row in self.ready_f for s, heap in row}
        self.todo = [0] * p  # actions each rank has left
        for mb in range(self.m):
            for s in shape.stages_of(mb):
                self.todo[self.rank_of[s]] += 3
        self.live: dict[object, int] = {}  # quota key -> admitted and not yet freed
        self.free = [0.0] * p
        self.acts: list[list[Action]] = [[] for _ in range(p)]
        self.moments: list[float] = []
        self.arrivals: dict[float, list[tuple[str, int, int]]] = {}  # t -> inputs landing
        self.wakes: dict[float, list[int]] = {}  # t -> ranks falling free
        for mb in range(self.m):  # the forwards that need no input are ready at once
            for s in shape.stages_of(mb):
                if self.missing["F"][s] == 0:
                    heapq.heappush(self.ready_f_of[s], (mb, -s))

    def run(self) -> list[list[Action]]:
        t, due = 0.0, list(range(self.shape.pp))  # at 0 every rank looks
        while True:
            for kind, s, mb in self.arrivals.pop(t, ()):
                self._arrive(kind, s, mb, due)
            due.extend(self.wakes.pop(t, ()))
            due = self._serve(t, due)
            while self.moments and self.moments[0] <= t:
                heapq.heappop(self.moments)
            if not self.moments:
                break
            t = heapq.heappop(self.moments)
        if any(self.todo):  # cannot happen: some action is always ready eventually
            raise RuntimeError(f"list scheduler for {self.shape.name} made no progress")
        return self.acts

    def _serve(self, t: float, due: list[int]) -> list[int]:
        """Let the due ranks, lowest first, each start one action at t; the ranks to look
        again at the next moment (an input produced at t for a rank already served)."""
        heap = sorted(set(due))
        seen, later = set(heap), []
        while heap:
            r = heapq.heappop(heap)
            if self.free[r] > t or not self.todo[r]:
                continue
            for r2 in self._start_best(r, t):
                if r2 > r and r2 not in seen:
                    seen.add(r2)
                    heapq.heappush(heap, r2)
                elif r2 <= r:
                    later.append(r2)
        return later

    def _start_best(self, r: int, t: float) -> list[int]:
        """Start rank r's best ready action at t (an I, else an F its quota admits, oldest
        micro-batch first, then the stage nearer the loss, else a W); the ranks an input
        reaches at t itself."""
        if self.ready_i[r]:
            mb, neg_s = heapq.heappop(self.ready_i[r])
            return self._start(r, "I", -neg_s, mb, t)
        best = None
        for s, heap in self.ready_f[r]:
            key, limit, gated = self.quotas[s]
            if heap and not (gated and self.live.get(key, 0) >= limit) and (
                    best is None or heap[0] < best[0]):
                best = heap[0], heap
        if best is not None:
            mb, neg_s = heapq.heappop(best[1])
            return self._start(r, "F", -neg_s, mb, t)
        if self.ready_w[r]:
            mb, neg_s = heapq.heappop(self.ready_w[r])
            return self._start(r, "W", -neg_s, mb, t)
        return []

    def _start(self, r: int, kind: str, s: int, mb: int, t: float) -> list[int]:
        """Run (kind, s, mb) on rank r from t: the order, the quota, when its outputs land."""
        end = t + self.dur[kind][s]
        self.free[r] = end
        self.todo[r] -= 1
        self.acts[r].append(_act(kind, s, mb))
        if kind != "W":
            key = self.quotas[s][0]
            self.live[key] = self.live.get(key, 0) + (1 if kind == "F" else -1)
        heapq.heappush(self.moments, end)
        if self.p2p:
            heapq.heappush(self.moments, end + self.p2p)
        now: list[int] = []
        if end <= t:  # zero duration: the rank looks again at the next moment
            now.append(r)
        else:
            self.wakes.setdefault(end, []).append(r)
        if kind == "F":
            out = [("I", s, 0.0)]
            nxt = self.shape.next_stage(s)
            if nxt is not None:
                out.append(("F", nxt, self.p2p if self.rank_of[nxt] != r else 0.0))
        elif kind == "I":
            out = [("W", s, 0.0)]
            prv = self.shape.prev_stage(s)
            if prv is not None:
                out.append(("I", prv, self.p2p if self.rank_of[prv] != r else 0.0))
        else:
            out = []
        for k, dst, hop in out:
            at = end + hop
            if at <= t:
                self._arrive(k, dst, mb, now)
            else:
                self.arrivals.setdefault(at, []).append((k, dst, mb))
        return now

    def _arrive(self, kind: str, s: int, mb: int, due: list[int]) -> None:
        """One input of (kind, s, mb) is there; once all are, it is ready on its rank."""
        left = self.waiting[kind]
        i = s * self.m + mb
        left[i] -= 1
        if left[i]:
            return
        r = self.rank_of[s]
        if kind == "F":
            heap = self.ready_f_of[s]
        else:
            heap = self.ready_i[r] if kind == "I" else self.ready_w[r]
        heapq.heappush(heap, (mb, -s))
        due.append(r)
