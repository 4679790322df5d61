"""DualPipe's F&B pairs as schedule data: the lowering's `pair_fb` mark, what it moves, and
the simulator's reading of it (a pair starts with both inputs there, its F's output
leaves after it). Pure Python, no processes."""

from __future__ import annotations

from collections import Counter

import pytest

from plait.schedule.check import check
from plait.schedule.ir import Schedule, fb_pairs, paired_share
from plait.schedule.lower import lower
from plait.schedule.registry import build_schedule
from plait.schedule.simulate import Durations, simulate

LAYOUTS = [("dualpipev", 2, 8, 2), ("dualpipev", 4, 8, 2), ("dualpipev", 4, 16, 2),
           ("dualpipe", 2, 8, 1), ("dualpipe", 4, 8, 1), ("1f1b", 4, 8, 1)]


def _computes(acts):
    return [a for a in acts if not a.is_comm]


def _expected_pairs(schedule: Schedule) -> list[set[tuple]]:
    """Per rank, the (F, I/B) of different micro-batches adjacent in the compute order."""
    return [{(a, b) for a, b in zip(c, c[1:]) if a.kind == "F" and b.kind in "IB"
             and a.microbatch != b.microbatch}
            for c in map(_computes, schedule.actions)]


@pytest.mark.parametrize("name,p,m,v", LAYOUTS)
def test_pairs_are_marked_adjacent_checked_and_round_trip(name, p, m, v):
    built = build_schedule(name, p, m, v)
    plain, paired = lower(built), lower(built, pair_fb=True)
    assert not plain.paired_fb and fb_pairs(plain) == [[] for _ in range(p)]
    assert paired.paired_fb and check(paired) == []
    assert Schedule.from_text(paired.to_text()) == paired
    found = [{(acts[i], acts[i + 1]) for i in idx}
             for acts, idx in zip(paired.actions, fb_pairs(paired), strict=True)]
    assert found == _expected_pairs(built)
    if name.startswith("dualpipe"):  # the steady phase pairs on every rank
        assert sum(map(len, found)) > 0
    # the same computes in the same order and the same transfers, only moved
    for a, b in zip(plain.actions, paired.actions, strict=True):
        assert _computes(a) == _computes(b) and Counter(a) == Counter(b)


@pytest.mark.parametrize("name,p,m,v", LAYOUTS[:4])
def test_a_pairs_backward_input_is_received_before_the_pair(name, p, m, v):
    paired = lower(build_schedule(name, p, m, v), pair_fb=True)
    for acts, idx in zip(paired.actions, fb_pairs(paired), strict=True):
        for i in idx:
            b = acts[i + 1]
            before = acts[:i]
            if b.stage != paired.num_stages - 1 and any(
                    a.kind == "RECV_B" and a[1:3] == b[1:3] for a in acts):
                assert any(a.kind == "RECV_B" and a[1:3] == b[1:3] for a in before), b


def _ends(res):
    return [{(k, s, mb): (t0, t1) for k, s, mb, t0, t1 in evs} for evs in res.events]


@pytest.mark.parametrize("post", [0.0, 0.1])
def test_simulator_starts_a_pair_with_both_inputs_and_sends_after_it(post):
    built = build_schedule("dualpipev", 2, 8, 2)
    d = Durations(1.0, 1.0, 1.0, p2p=0.25, post=post)
    paired = lower(built, pair_fb=True)
    res = simulate(paired, d)
    at = _ends(res)
    rank_of = paired.stage_to_rank
    checked = 0
    for r, (acts, idx) in enumerate(zip(paired.actions, fb_pairs(paired), strict=True)):
        for i in idx:
            f, b = acts[i], acts[i + 1]
            f_start, _ = at[r][f[:3]]
            nxt = paired.next_stage(b.stage)
            if nxt is not None and rank_of[nxt] != r:  # the B's gradient from the peer
                _, g_end = at[rank_of[nxt]][("B", nxt, b.microbatch)] if (
                    "B", nxt, b.microbatch) in at[rank_of[nxt]] else at[rank_of[nxt]][
                    ("I", nxt, b.microbatch)]
                assert f_start >= g_end + d.p2p - 1e-12
                checked += 1
            to = paired.next_stage(f.stage)
            if to is not None and rank_of[to] != r:  # F's output leaves after the pair
                assert at[rank_of[to]][("F", to, f.microbatch)][0] >= \
                    at[r][b[:3]][1] + d.p2p - 1e-12
    assert checked > 0
    # the unpaired order may start the F before the backward's input: the pair waits
    assert res.step_time > simulate(lower(built), d).step_time


@pytest.mark.parametrize("name,p,m,v", [("dualpipev", 8, 16, 2), ("dualpipe", 8, 16, 1),
                                        ("1f1b", 8, 16, 1), ("interleaved", 4, 8, 2)])
def test_paired_schedules_finish_in_the_simulator(name, p, m, v):
    paired = lower(build_schedule(name, p, m, v), pair_fb=True)
    assert check(paired) == []
    res = simulate(paired, Durations(1.0, 1.5, 0.5, p2p=0.1, post=0.05), steps=2)
    assert res.step_time > 0


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16), (8, 24)])
def test_paired_share_is_dualpipevs_steady_phase(p, m):
    """dualpipev pairs 2m - 2p of a rank's 2m forwards, and rank 0, which opens and
    closes the V, 2m - 3p + 1: the least share is rank 0's."""
    assert paired_share(build_schedule("dualpipev", p, m, 2)) == (2 * m - 3 * p + 1) / (2 * m)
    assert paired_share(build_schedule("1f1b", p, m)) == 0.0  # rank p-1 pairs none
