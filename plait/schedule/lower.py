"""Lowering: add the point-to-point transfers a schedule needs.

Where a micro-batch crosses from stage s on rank a to stage s' on rank b != a, the
producer's rank gets a SEND right after the producing compute and the consumer's rank a
RECV somewhat before the consuming compute:
  F s on a        ->  SEND_F s >b      ...  RECV_F s' <a  before F s' on b   (s' = s+1)
  I/B s on a      ->  SEND_B s >b      ...  RECV_B s' <a  before I/B s' on b (s' = s-1)
Stage boundaries inside one rank (the bottom of a V: stages p-1 and p on rank p-1) need no
transfer, nor does the end of a chain.

The runtime contract (what `check.py` simulates):
  * consecutive transfer actions on a rank form one batch, posted together
    (`torch.distributed.batch_isend_irecv`) when the rank reaches them; posting never blocks;
  * a compute waits only for the receives carrying its own inputs;
  * sends are waited for at the end of the step;
  * transfers between one pair of ranks in one direction are matched in posting order
    (NCCL has no tags), so the receives on b from a are posted in the order a sends them.
Receives go as early as that allows, up to one compute ahead of their consumer: the
transfer then overlaps the compute before it, and at most about one extra buffer per
channel is held.
"""

from __future__ import annotations

import dataclasses

from plait.schedule.ir import Action, Schedule, pair_starts, trusted, without_gc

LOOKAHEAD = 1  # receives are posted this many computes before the one that needs them


@without_gc
def lower(schedule: Schedule, pair_fb: bool = False) -> Schedule:
    """A copy of `schedule` with SEND/RECV actions inserted (see module docstring);
    `pair_fb`: paired F&B kept adjacent, marked `paired_fb`."""
    if schedule.lowered or any(a.is_comm for acts in schedule.actions for a in acts):
        raise ValueError(f"schedule {schedule.name!r} is already lowered")
    rank_of = schedule.stage_to_rank
    p = schedule.pp
    computes = [list(acts) for acts in schedule.actions]
    # position of each compute in its rank's list, by kind
    where: dict[str, dict[tuple[int, int], int]] = {"F": {}, "I": {}, "B": {}}
    for acts in computes:
        for i, (kind, stage, mb, _) in enumerate(acts):
            if kind != "W":
                where[kind][(stage, mb)] = i
    pairs = [pair_starts(acts) if pair_fb else [] for acts in computes]
    for acts, firsts in zip(computes, pairs):
        for i in firsts:  # the pair's backward is consumed where the pair starts
            where[acts[i + 1].kind][acts[i + 1][1:3]] = i
    nxt = [schedule.next_stage(st) for st in range(schedule.num_stages)]
    prv = [schedule.prev_stage(st) for st in range(schedule.num_stages)]

    sends_after: list[dict[int, list[Action]]] = [{} for _ in range(p)]  # rank -> idx -> sends
    channel: dict[tuple[int, int], list[tuple[Action, int]]] = {}  # (a, b) -> [(recv, consumer)]
    for a_rank, acts in enumerate(computes):
        for i, act in enumerate(acts):
            kind, stage, mb, _ = act
            if kind == "F":
                dst, send_kind, recv_kind, fam = nxt[stage], "SEND_F", "RECV_F", "F"
            elif kind != "W":
                dst, send_kind, recv_kind, fam = prv[stage], "SEND_B", "RECV_B", "G"
            else:
                continue
            if dst is None or rank_of[dst] == a_rank:
                continue
            b_rank = rank_of[dst]
            sends_after[a_rank].setdefault(i, []).append(trusted(send_kind, stage, mb, b_rank))
            consumer = where[fam].get((dst, mb)) if fam == "F" else where["I"].get(
                (dst, mb), where["B"].get((dst, mb)))
            if consumer is None:
                raise ValueError(
                    f"{act} on rank {a_rank} feeds stage {dst} micro-batch {mb}, which has no "
                    f"{'F' if fam == 'F' else 'I/B'} on rank {b_rank}"
                )
            channel.setdefault((a_rank, b_rank), []).append(
                (trusted(recv_kind, dst, mb, a_rank), consumer)
            )

    recvs_before: list[dict[int, list[Action]]] = [{} for _ in range(p)]
    for (_, b_rank), items in sorted(channel.items()):
        # FIFO per channel: positions non-decreasing in send order, each before its consumer
        upper = [0] * len(items)
        bound = len(computes[b_rank])
        for k in range(len(items) - 1, -1, -1):
            bound = min(bound, items[k][1])
            upper[k] = bound
        pos = 0
        for k, (recv, consumer) in enumerate(items):
            pos = max(pos, min(max(consumer - LOOKAHEAD, 0), upper[k]))
            recvs_before[b_rank].setdefault(pos, []).append(recv)

    lowered = [_interleave(acts, recvs_before[r], sends_after[r], pairs[r])
               for r, acts in enumerate(computes)]
    return Schedule(
        schedule.name,
        schedule.pp,
        schedule.microbatches,
        schedule.virtual_stages,
        schedule.num_stages,
        list(schedule.stage_to_rank),
        lowered,
        schedule.num_chains,
        lowered=True,
        paired_fb=pair_fb,
    )


def _interleave(computes: list[Action], recvs_before: dict[int, list[Action]],
                sends_after: dict[int, list[Action]], pairs: list[int]) -> list[Action]:
    """One rank's lowered list: each compute with its receives before and sends after;
    what would sit between a pair's two computes goes after the pair."""
    for i in pairs:
        sends_after[i + 1] = sends_after.pop(i, []) + sends_after.get(i + 1, [])
        recvs_before[i + 2] = recvs_before.pop(i + 1, []) + recvs_before.get(i + 2, [])
    seq: list[Action] = []
    for i, act in enumerate(computes):
        seq += recvs_before.get(i, [])
        seq.append(act)
        seq += sends_after.get(i, [])
    return seq + recvs_before.get(len(computes), [])




def forward_only(schedule: Schedule) -> Schedule:
    """A schedule's forwards and their activation transfers, in each rank's order:
    an evaluation's step (no gradient, no backward). The order stays deadlock-free: a
    forward waits only on forwards, which the full schedule already ran in this order."""
    if not schedule.lowered:
        schedule = lower(schedule)
    keep = ("F", "SEND_F", "RECV_F")
    return dataclasses.replace(schedule, actions=[[a for a in acts if a.kind in keep]
                                                  for acts in schedule.actions])


def speculative_prefix(schedule: Schedule) -> list[int]:
    """Per rank of a lowered schedule, how many leading actions it may run on weights not
    yet validated (post-validation, plait/parallel/post_validation.py): only forwards and
    transfers (no gradient is written), and closed under matching, so that when the
    validation fails every rank can complete its prefix's transfers and run the step again
    from the start: on each channel a -> b, a's prefix sends exactly as many as b's prefix
    receives (transfers on a channel are matched in posting order). Cut at the first
    backward, then shortened until closed."""
    if not schedule.lowered:
        raise ValueError(f"schedule {schedule.name!r} is not lowered")
    acts = schedule.actions
    cut = [next((i for i, a in enumerate(seq) if a.kind in ("B", "I", "W")), len(seq))
           for seq in acts]
    changed = True
    while changed:  # each pass only moves cuts earlier: it ends
        changed = False
        for a in range(schedule.pp):
            for b in range(schedule.pp):
                sends = [i for i, x in enumerate(acts[a][:cut[a]])
                         if x.kind.startswith("SEND") and x.peer == b]
                recvs = [i for i, x in enumerate(acts[b][:cut[b]])
                         if x.kind.startswith("RECV") and x.peer == a]
                if len(sends) > len(recvs):
                    cut[a], changed = sends[len(recvs)], True
                elif len(recvs) > len(sends):
                    cut[b], changed = recvs[len(sends)], True
    return cut


def cut_positions(schedule: Schedule) -> list[tuple[int, int, bool] | None]:
    """Per rank, where the runtime checks post-validation (at its `speculative_prefix`
    cut, from the second step on): (compute actions before the cut, runs of consecutive
    transfers that start before it, whether the cut splits a run: the runtime then posts
    it as two batches); None where the cut is the list's end (never reached). For the
    simulator's queues; `schedule` is lowered first if it is not."""
    lowered = schedule if schedule.lowered else lower(schedule)
    out: list[tuple[int, int, bool] | None] = []
    for acts, cut in zip(lowered.actions, speculative_prefix(lowered), strict=True):
        if cut >= len(acts):
            out.append(None)
            continue
        comm = [a.is_comm for a in acts[:cut + 1]]
        runs = sum(c and (k == 0 or not comm[k - 1]) for k, c in enumerate(comm[:cut]))
        out.append((comm[:cut].count(False), runs, cut > 0 and comm[cut - 1] and comm[cut]))
    return out
