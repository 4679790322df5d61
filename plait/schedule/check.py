"""Checks on a schedule, pure Python: `check(schedule)` lists every problem found.

1. Placement: each action's stage lives on the rank that runs it, micro-batches belong to
   the stage's chain.
2. Completeness: every (stage, micro-batch) of a chain has exactly one F and one backward:
   a B, or an I and a W.
3. Order on a rank: F before its I/B, I before its W.
4. Transfers (lowered schedules): each cross-rank edge has exactly one SEND on the
   producer's rank (after the producing compute) and one RECV on the consumer's rank
   (before the consuming compute), peers right, none inside one rank, and the sends a->b
   posted in the same order as the receives on b from a (NCCL matches in order).
5. Deadlock freedom: execute the lists under the runtime contract of `lower.py` (posting a
   transfer never blocks; a compute waits for its inputs: a local compute done, or its
   RECV posted here and the matching SEND posted by the peer). If no rank can move, each
   stuck rank is reported with what it waits for. Unlowered schedules run the same way,
   with a cross-rank input available once its producer has run.
"""

from __future__ import annotations

from collections import Counter
from operator import add

from plait.schedule.ir import Action, Schedule, without_gc
from plait.schedule.ir import peak_activations as peak_activations  # (its home)

Key = tuple[str, int, int]  # (kind, stage, microbatch)


@without_gc
def check(schedule: Schedule, execute: bool = True) -> list[str]:
    """Every problem with the schedule, as readable sentences; [] if it is valid.
    `execute=False` leaves out 5. (deadlock freedom), for a caller that executes the
    schedule anyway (`simulate` raises DeadlockError; then ask `deadlocks`)."""
    scanned = _scan(schedule)  # None: some action is misplaced
    if scanned is None:  # the rest assumes stages and ranks make sense
        return _placement(schedule)
    problems: list[str] = []
    count, order, transfers = scanned
    complete = _completeness(schedule, count)
    problems += complete + order
    if transfers and (complete or not _transfers_hold(schedule)):
        problems += _transfers(schedule)  # says what is wrong
    if not problems and execute:
        problems += deadlocks(schedule)
    return problems


def _placement(s: Schedule) -> list[str]:
    out = []
    if any(not 0 <= r < s.pp for r in s.stage_to_rank):
        out.append(f"stage_to_rank {s.stage_to_rank} names a rank outside 0..{s.pp - 1}")
        return out
    chain_mbs = [s.microbatches_of(st) for st in range(s.num_stages)]
    for r, acts in enumerate(s.actions):
        mine = {st: chain_mbs[st] for st in s.stages_on(r)}
        for a in acts:  # the common case costs a dict lookup and a range test
            kind, stage, mb, peer = a
            mbs = mine.get(stage)
            if mbs is not None and mb in mbs and (peer is None or 0 <= peer < s.pp):
                continue
            if not 0 <= stage < s.num_stages:
                out.append(f"rank {r}: {a} names stage {stage} outside 0..{s.num_stages - 1}")
            elif s.stage_to_rank[stage] != r:
                out.append(f"rank {r}: {a} runs stage {stage}, which lives on rank "
                           f"{s.stage_to_rank[stage]}")
            elif mb not in chain_mbs[stage]:
                out.append(f"rank {r}: {a}: micro-batch {mb} does not pass stage {stage}")
            elif len(kind) > 1:
                out.append(f"rank {r}: {a}: peer {peer} is not a rank")
    return out


def _completeness(s: Schedule, count: dict[str, list[int]]) -> list[str]:
    m = s.microbatches
    expected = [0] * (s.num_stages * m)
    for stage in range(s.num_stages):  # a stage's micro-batches are a contiguous range
        mbs = s.microbatches_of(stage)
        expected[stage * m + mbs.start:stage * m + mbs.stop] = [1] * len(mbs)
    f, b, i, w = (count[k] for k in "FBIW")
    if f == expected and i == w and list(map(add, b, i)) == expected:
        return []  # every forward once, one B or one I and one W: nothing to say
    out = []
    for stage in range(s.num_stages):
        for mb in s.microbatches_of(stage):
            k = stage * m + mb
            if f[k] != 1:
                out.append(f"stage {stage} micro-batch {mb}: {f[k]} forwards, expected 1")
            if not ((b[k] == 1 and i[k] == w[k] == 0) or (b[k] == 0 and i[k] == w[k] == 1)):
                out.append(f"stage {stage} micro-batch {mb}: backward is B x{b[k]}, I x{i[k]}, "
                           f"W x{w[k]}; expected one B, or one I and one W")
    return out


def _scan(s: Schedule) -> tuple[dict[str, list[int]], list[str], bool] | None:
    """One pass: None if an action is misplaced (`_placement` says how); else how many
    of each compute kind every (stage * m + mb) has, the computes that run before what
    they need on their rank (F before I/B, I before W), and whether there are transfers."""
    if any(not 0 <= r < s.pp for r in s.stage_to_rank):
        return None
    m = s.microbatches
    count = {k: [0] * (s.num_stages * m) for k in "FBIW"}
    f, b, i, w = count.values()  # placement holds: no two ranks run the same stage
    order, transfers = [], False
    chain_mbs = [s.microbatches_of(st) for st in range(s.num_stages)]
    for r, acts in enumerate(s.actions):
        mine = {st: chain_mbs[st] for st in s.stages_on(r)}
        for a in acts:  # a count seen before is an action run before, on this rank
            kind, stage, mb, peer = a
            mbs = mine.get(stage)
            if mbs is None or mb not in mbs:
                return None
            k = stage * m + mb
            if kind == "F":
                f[k] += 1
                continue
            if kind == "W":
                w[k] += 1
                need = None if i[k] else "I"
            elif kind == "I" or kind == "B":
                (i if kind == "I" else b)[k] += 1
                need = None if f[k] else "F"
            else:
                if not 0 <= peer < s.pp:
                    return None
                transfers = True
                continue
            if need:
                order.append(f"rank {r}: {a} runs before {need}{stage}.{mb}")
    return count, order, transfers


def _edges(s: Schedule) -> dict[tuple[str, int, int], tuple[int, int, str, int]]:
    """Every cross-rank transfer the schedule needs: (send kind, stage, mb) ->
    (from rank, to rank, recv kind, recv stage)."""
    out = {}
    for acts in s.actions:
        for a in acts:
            if a.kind == "F":
                dst, sk, rk = s.next_stage(a.stage), "SEND_F", "RECV_F"
            elif a.kind in ("I", "B"):
                dst, sk, rk = s.prev_stage(a.stage), "SEND_B", "RECV_B"
            else:
                continue
            if dst is not None and s.stage_to_rank[dst] != s.stage_to_rank[a.stage]:
                src_r, dst_r = s.stage_to_rank[a.stage], s.stage_to_rank[dst]
                out[(sk, a.stage, a.microbatch)] = (src_r, dst_r, rk, dst)
    return out


def _transfers(s: Schedule) -> list[str]:
    out = []
    edges = _edges(s)
    expected_recv = {
        (rk, dst, mb): (src, dst_r, sk, st) for (sk, st, mb), (src, dst_r, rk, dst) in edges.items()
    }
    sends: Counter = Counter()
    recvs: Counter = Counter()
    order: dict[tuple[str, int, int], tuple[int, int]] = {}  # comm key -> (rank, index)
    for r, acts in enumerate(s.actions):
        done: set[Key] = set()
        for i, a in enumerate(acts):
            key = (a.kind, a.stage, a.microbatch)
            if not a.is_comm:
                done.add(key)
                continue
            order[key] = (r, i)
            if a.kind.startswith("SEND"):
                sends[key] += 1
                e = edges.get(key)
                if e is None:
                    out.append(f"rank {r}: {a} has no receiver (no cross-rank consumer)")
                    continue
                if a.peer != e[1]:
                    out.append(
                        f"rank {r}: {a} goes to rank {a.peer}; stage {e[3]} is on rank {e[1]}"
                    )
                producers = ("F",) if a.kind == "SEND_F" else ("I", "B")
                if not any((k, a.stage, a.microbatch) in done for k in producers):
                    out.append(f"rank {r}: {a} comes before the compute that produces it")
            else:
                recvs[key] += 1
                e = expected_recv.get(key)
                if e is None:
                    out.append(f"rank {r}: {a} receives what no rank sends")
                    continue
                if a.peer != e[0]:
                    out.append(f"rank {r}: {a} expects rank {a.peer}; the sender is rank {e[0]}")
                consumers = ("F",) if a.kind == "RECV_F" else ("I", "B")
                if any((k, a.stage, a.microbatch) in done for k in consumers):
                    out.append(f"rank {r}: {a} comes after the compute that needs it")
    for (sk, st, mb), (src, dst_r, rk, dst) in edges.items():
        n_s, n_r = sends[(sk, st, mb)], recvs[(rk, dst, mb)]
        if n_s != 1:
            out.append(f"rank {src}: {n_s} x {sk}{st}.{mb}>{dst_r}, expected exactly 1")
        if n_r != 1:
            what = "unmatched send: " if n_s and not n_r else ""
            out.append(f"{what}rank {dst_r}: {n_r} x {rk}{dst}.{mb}<{src}, expected exactly 1")
    # in-order matching per channel (a -> b): sends on a and receives on b, same order
    chan_s: dict[tuple[int, int], list] = {}
    chan_r: dict[tuple[int, int], list] = {}
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.kind.startswith("SEND") and (a.kind, a.stage, a.microbatch) in edges:
                chan_s.setdefault((r, a.peer), []).append((a.kind[-1], a.microbatch, a.stage))
            elif a.kind.startswith("RECV") and (a.kind, a.stage, a.microbatch) in expected_recv:
                src_stage = expected_recv[(a.kind, a.stage, a.microbatch)][3]
                chan_r.setdefault((a.peer, r), []).append((a.kind[-1], a.microbatch, src_stage))
    for ch, seq in chan_s.items():
        if chan_r.get(ch, []) != seq and len(chan_r.get(ch, [])) == len(seq):
            first = next(k for k, (x, y) in enumerate(zip(seq, chan_r[ch])) if x != y)
            out.append(
                f"ranks {ch[0]}->{ch[1]}: transfer #{first} is sent as "
                f"{_fmt(seq[first])} but received as {_fmt(chan_r[ch][first])}; sends and "
                "receives between two ranks must be posted in the same order"
            )
    return out


def _transfers_hold(s: Schedule) -> bool:
    """Whether `_transfers` would find nothing, in one pass over integer arrays, for a
    complete schedule (each compute once): every send and receive on the edge it names,
    from / to the right peer, after its producer / before its consumer, exactly one of
    each per edge, and each channel's receives in its sends' order."""
    m, rank_of = s.microbatches, s.stage_to_rank
    size = s.num_stages * m
    nxt = [s.next_stage(st) for st in range(s.num_stages)]
    prv = [s.prev_stage(st) for st in range(s.num_stages)]
    # per kind: the stage a transfer's peer computes (None: no edge), and whether the
    # compute on this rank that must come first (sends) or must not (receives) is an F
    peer_stage = {"SEND_F": nxt, "RECV_F": prv, "SEND_B": prv, "RECV_B": nxt}
    done = {True: bytearray(size), False: bytearray(size)}  # F run; I or B run
    seen = {k: bytearray(size) for k in peer_stage}  # how many of each transfer
    channels: dict[tuple[int, int, bool], list[int]] = {}  # (from, to, sends?) -> order
    for r, acts in enumerate(s.actions):
        for kind, stage, mb, peer in acts:
            k = stage * m + mb
            if len(kind) == 1:
                if kind != "W":
                    done[kind == "F"][k] = 1
                continue
            other = peer_stage[kind][stage]
            if other is None or rank_of[other] == r or peer != rank_of[other]:
                return False
            is_f, sends = kind[-1] == "F", kind[0] == "S"
            if done[is_f][k] != sends or seen[kind][k]:  # produced first / consumed after
                return False
            seen[kind][k] = 1
            src_stage = stage if sends else other  # what travels: (kind, mb, src stage)
            item = (src_stage * m + mb) * 2 + is_f
            channels.setdefault((r, peer, True) if sends else (peer, r, False),
                                []).append(item)
    for st in range(s.num_stages):  # every cross-rank edge has its send and its receive
        for mb in s.microbatches_of(st):
            k = st * m + mb
            if nxt[st] is not None and rank_of[nxt[st]] != rank_of[st] and not (
                    seen["SEND_F"][k] and seen["RECV_F"][nxt[st] * m + mb]):
                return False
            if prv[st] is not None and rank_of[prv[st]] != rank_of[st] and not (
                    seen["SEND_B"][k] and seen["RECV_B"][prv[st] * m + mb]):
                return False
    return all(channels.get((a, b, False)) == items
               for (a, b, sends), items in channels.items() if sends) and all(
        (a, b, True) in channels for (a, b, sends) in channels if not sends)


def _fmt(item: tuple[str, int, int]) -> str:
    kind, mb, stage = item
    return f"{'activation' if kind == 'F' else 'gradient'} of stage {stage} mb {mb}"


@without_gc
def deadlocks(s: Schedule) -> list[str]:
    """Execute the schedule without durations (see module docstring, 5.), event-driven:
    a rank runs until an action cannot, then waits on the one thing it lacks (a compute
    run, a send posted) and is woken when that happens. Whatever order ranks run in, they
    end in the same state (running an action never stops another), so the report is the
    one a round-robin execution gives."""
    lowered = any(len(a[0]) > 1 for acts in s.actions for a in acts)
    m, size = s.microbatches, s.num_stages * s.microbatches
    # done[code * size + stage * m + mb], code: F run, G (I or B) run, W run, and each
    # transfer kind posted
    done = bytearray(7 * size)
    F, G, W, SEND_F, RECV_F, SEND_B, RECV_B = (c * size for c in range(7))
    offset = {"F": F, "G": G, "B": G, "I": G, "W": W, "SEND_F": SEND_F, "RECV_F": RECV_F,
              "SEND_B": SEND_B, "RECV_B": RECV_B}
    # per stage: the stage its F (its I/B) reads from, and whether that crosses ranks in
    # a lowered schedule (then: its own receive posted, the peer's send posted)
    ends = {"F": [s.prev_stage(st) for st in range(s.num_stages)],
            "G": [s.next_stage(st) for st in range(s.num_stages)]}
    rank_of = s.stage_to_rank
    waiting: dict[int, list[int]] = {}
    pos = [0] * s.pp
    ready = list(range(s.pp - 1, -1, -1))
    while ready:
        r = ready.pop()
        acts, i = s.actions[r], pos[r]
        while i < len(acts):
            kind, stage, mb, _ = acts[i]
            k = stage * m + mb
            if len(kind) == 1:
                if kind == "W":
                    lack = -1 if done[G + k] else G + k
                elif kind != "F" and not done[F + k]:
                    lack = F + k
                else:
                    fam = "F" if kind == "F" else "G"
                    src = ends[fam][stage]
                    if src is None:
                        lack = -1
                    else:
                        j = src * m + mb
                        if not lowered or rank_of[src] == r:
                            lack = offset[fam] + j
                        elif not done[(RECV_F if fam == "F" else RECV_B) + k]:
                            lack = (RECV_F if fam == "F" else RECV_B) + k  # never: later here
                        else:
                            lack = (SEND_F if fam == "F" else SEND_B) + j
                        if done[lack]:
                            lack = -1
                if lack >= 0:
                    waiting.setdefault(lack, []).append(r)
                    break
            code = offset[kind] + k
            done[code] = 1
            if code in waiting:
                ready += waiting.pop(code)
            i += 1
        pos[r] = i
    stuck = [r for r in range(s.pp) if pos[r] < len(s.actions[r])]
    if not stuck:
        return []
    posted = {k: done[c * size:(c + 1) * size] for k, c in (("F", 0), *((x, 3 + n) for n, x
                                                                     in enumerate(_COMM_KINDS)))}
    return ["deadlock: " + "; ".join(
        f"rank {r} blocked at {s.actions[r][pos[r]]} (action #{pos[r]}) waiting for "
        f"{_blocker(s, lowered, posted, r, s.actions[r][pos[r]])}" for r in stuck)]


_COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


def _blocker(s: Schedule, lowered: bool, done: dict[str, bytearray], r: int,
             a: Action) -> str:
    """What the stuck compute `a` on rank r waits for, in words."""
    m = s.microbatches
    if a.kind == "W":
        return f"I{a.stage}.{a.microbatch}"
    if a.kind == "F":
        src, fam, recv_kind = s.prev_stage(a.stage), "F", "RECV_F"
    else:
        if not done["F"][a.stage * m + a.microbatch]:
            return f"F{a.stage}.{a.microbatch}"
        src, fam, recv_kind = s.next_stage(a.stage), "G", "RECV_B"
    need = f"{'F' if fam == 'F' else 'I/B'}{src}.{a.microbatch}"
    src_rank = s.stage_to_rank[src]
    if src_rank == r or not lowered:
        return need + f" on rank {src_rank}"
    if not done[recv_kind][a.stage * m + a.microbatch]:
        return f"{recv_kind}{a.stage}.{a.microbatch}<{src_rank} (never posted before it)"
    send_kind = "SEND_F" if fam == "F" else "SEND_B"
    return f"{send_kind}{src}.{a.microbatch} from rank {src_rank}"
