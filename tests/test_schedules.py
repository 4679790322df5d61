"""Pipeline schedules as data: validity, deadlock freedom, text round-trip, closed forms.

Pure Python, no processes. Closed forms cite their papers in plait/schedule/
(the registry holds them, one entry per schedule).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from plait.schedule import cli
from plait.schedule.check import check, deadlocks, peak_activations
from plait.schedule.draw import format_table
from plait.schedule.ir import Action, Schedule
from plait.schedule.lower import lower
from plait.schedule.registry import (
    SCHEDULE_NAMES,
    build_schedule,
    closed_form_bubble,
    natural_virtual_stages,
    paper_bubble_time,
    validate_schedule_request,
)
from plait.schedule.simulate import DeadlockError, Durations, simulate

EXACT = 1e-9
EQUAL = Durations(1.0, 1.0, 1.0)  # T_F = T_I = T_W


def plan():
    """The test matrix: every schedule, p in {2, 4, 8}, m in {p, 2p}, its own v."""
    for name in SCHEDULE_NAMES:
        for p in (2, 4, 8):
            for m in (p, 2 * p):
                yield name, p, m, natural_virtual_stages(name, None)


def bubble_time(res) -> float:
    """Idle time per rank (all ranks do equal work in these schedules)."""
    assert max(res.busy_per_rank) - min(res.busy_per_rank) < EXACT
    return res.step_time - res.busy_per_rank[0]


# --- validity, deadlock freedom, round-trip -----------------------------------------------


@pytest.mark.parametrize("name,p,m,v", list(plan()))
def test_schedule_is_valid_lowered_and_round_trips(name, p, m, v):
    problems = validate_schedule_request(name, p, m, v)
    if problems:  # the only refusal in the matrix: dualpipev needs m >= 2p-1
        assert name == "dualpipev" and m < 2 * p - 1, problems
        with pytest.raises(ValueError, match="2\\*pp-1"):
            build_schedule(name, p, m, v)
        return
    s = build_schedule(name, p, m, v)
    assert s.num_stages == len(s.stage_to_rank) and s.pp == p
    assert check(s) == []
    low = lower(s)
    assert check(low) == []
    assert deadlocks(low) == []
    for sched in (s, low):
        assert Schedule.from_text(sched.to_text()) == sched
    # every cross-rank boundary got exactly one send and one receive; same-rank ones none
    sends = [a for acts in low.actions for a in acts if a.kind.startswith("SEND")]
    recvs = [a for acts in low.actions for a in acts if a.kind.startswith("RECV")]
    assert len(sends) == len(recvs)
    for a in sends:
        dst = low.next_stage(a.stage) if a.kind == "SEND_F" else low.prev_stage(a.stage)
        assert low.stage_to_rank[dst] == a.peer != low.stage_to_rank[a.stage]
    res = simulate(s, EQUAL)
    assert res.step_time > 0 and len(res.events) == p
    assert sum(len(e) for e in res.events) == sum(len(a) for a in s.actions)


def test_stage_placements():
    assert build_schedule("1f1b", 4, 4).stage_to_rank == [0, 1, 2, 3]
    assert build_schedule("interleaved", 4, 4, 2).stage_to_rank == [0, 1, 2, 3, 0, 1, 2, 3]
    for name in ("zb-v", "dualpipev"):
        s = build_schedule(name, 4, 8, 2)
        assert s.stage_to_rank == [0, 1, 2, 3, 3, 2, 1, 0]
        assert s.next_stage(3) == 4  # the bottom of the V: same rank, no transfer
        low = lower(s)
        assert not [a for a in low.actions[3] if a.is_comm and a.stage in (3, 4) and a.peer == 3]
    d = build_schedule("dualpipe", 4, 8)
    assert d.num_chains == 2 and d.stage_to_rank == [0, 1, 2, 3, 3, 2, 1, 0]
    assert d.next_stage(3) is None and d.prev_stage(4) is None  # two separate chains
    assert [d.model_stage(s) for s in (0, 3, 4, 7)] == [0, 3, 0, 3]
    assert list(d.microbatches_of(0)) == [0, 1, 2, 3]
    assert list(d.microbatches_of(5)) == [4, 5, 6, 7]
    # micro-batches 4..7 enter at rank 3 (stage 4) and leave at rank 0
    assert d.stage_to_rank[d.stages_of(5)[0]] == 3 and d.stage_to_rank[d.stages_of(5)[-1]] == 0


def test_peak_activations():
    p, m = 4, 8
    assert peak_activations(build_schedule("gpipe", p, m)) == [m] * p
    assert peak_activations(build_schedule("1f1b", p, m)) == [4, 3, 2, 1]
    assert peak_activations(build_schedule("zb-h1", p, m)) == [4, 3, 2, 1]  # 1F1B's memory
    assert peak_activations(build_schedule("zb-h2", p, m)) == [7, 5, 3, 1]  # 2p-1 on rank 0
    # V: stages are half a rank's layers, so 2p units = 1F1B's peak of p
    assert peak_activations(build_schedule("zb-v", p, m, 2)) == [2 * p] * p
    assert max(peak_activations(build_schedule("dualpipe", p, m))) <= p + 1  # DeepSeek: PP+1
    res = simulate(build_schedule("1f1b", p, m), EQUAL)
    assert res.peak_activations == [4, 3, 2, 1]


# --- closed forms ---------------------------------------------------------------------------

ONE_F_ONE_B_DURATIONS = [
    Durations(1.0, 1.0, 1.0),  # T_B = 2 T_F
    Durations(1.0, 0.5, 0.5),  # T_B = T_F
    Durations(0.3, 0.45, 0.35),
]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("d", ONE_F_ONE_B_DURATIONS)
def test_gpipe_1f1b_bubble(name, p, d):
    for m in (1, p, 2 * p, 3 * p + 1):
        res = simulate(build_schedule(name, p, m), d)
        expected = (p - 1) / (m + p - 1)
        assert abs(res.bubble_fraction - expected) < EXACT
        assert abs(closed_form_bubble(name, p, m, 1, d) - expected) < EXACT
        assert (
            abs(bubble_time(res) - (p - 1) * (d.forward + d.backward_input + d.backward_weight))
            < EXACT
        )


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_bubble(p, v):
    # Narayanan et al. 2021: bubble / ideal = (p-1) / (v m), in per-stage times
    for d in ONE_F_ONE_B_DURATIONS:
        for m in (p, 2 * p):
            res = simulate(build_schedule("interleaved", p, m, v), d)
            ideal = m * v * (d.forward + d.backward_input + d.backward_weight)
            assert abs(bubble_time(res) / ideal - (p - 1) / (v * m)) < EXACT
            assert abs(res.bubble_fraction - closed_form_bubble("interleaved", p, m, v, d)) < EXACT
    one = simulate(build_schedule("1f1b", p, 2 * p), EQUAL).bubble_fraction
    assert simulate(build_schedule("interleaved", p, 2 * p, v), EQUAL).bubble_fraction < one


# T_W <= T_F and T_W <= T_I: where the zero-bubble paper's forms hold (its T_B is our T_I)
ZB_DURATIONS = [
    Durations(1.0, 1.0, 1.0),
    Durations(2.0, 2.0, 1.0),
    Durations(3.0, 2.0, 1.0),
    Durations(1.0, 2.0, 1.0),
    Durations(2.0, 1.0, 1.0),
    Durations(3.0, 3.0, 2.0),
]


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("d", ZB_DURATIONS)
def test_zb_h1_bubble(p, d):
    # Qi et al. 2023, section 2.1: (p-1)(T_F + T_B - T_W), for m >= p
    for m in (p, 2 * p, 3 * p):
        res = simulate(build_schedule("zb-h1", p, m), d)
        expected = (p - 1) * (d.forward + d.backward_input - d.backward_weight)
        assert abs(bubble_time(res) - expected) < EXACT
        assert abs(max(res.span_idle_per_rank) - expected) < EXACT
        assert abs(res.bubble_fraction - closed_form_bubble("zb-h1", p, m, 1, d)) < EXACT


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("d", ZB_DURATIONS)
def test_zb_h2_bubble(p, d):
    # Qi et al. 2023, section 2.2: (p-1)(T_F + T_B - 2 T_W) for m >= 2p-1, counted as the
    # paper does: idle between a rank's first and last action (the parallelogram; a step
    # costs this once the optimizer sync is replaced by post-update validation).
    for m in (2 * p - 1, 2 * p, 3 * p):
        res = simulate(build_schedule("zb-h2", p, m), d)
        expected = (p - 1) * (d.forward + d.backward_input - 2 * d.backward_weight)
        assert abs(max(res.span_idle_per_rank) - expected) < EXACT
        assert abs(res.span_idle_per_rank[-1]) < EXACT  # the last rank never waits
        assert abs(paper_bubble_time("zb-h2", p, m, 1, d) - expected) < EXACT
        # with the synchronous flush, the fill triangle (p-1) T_F remains (T_I <= 2 T_W)
        if d.backward_input <= 2 * d.backward_weight:
            assert abs(bubble_time(res) - (p - 1) * d.forward) < EXACT
            cf = closed_form_bubble("zb-h2", p, m, 1, d)
            assert abs(res.bubble_fraction - cf) < EXACT
    # the headline: T_F = T_I = T_W gives zero bubble inside every rank's span
    res = simulate(build_schedule("zb-h2", p, 2 * p), EQUAL)
    assert max(res.span_idle_per_rank) < EXACT


def test_zb_v_and_dualpipev_beat_a_third_of_1f1b():
    p, m = 4, 8
    one = simulate(build_schedule("1f1b", p, m), EQUAL).bubble_fraction
    for name in ("zb-v", "dualpipev"):
        b = simulate(build_schedule(name, p, m, 2), EQUAL).bubble_fraction
        assert b <= one / 3, (name, b, one)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_v_zero_bubble_in_span(p):
    # Qi et al. 2023, section 6: ZB-V has no bubble at T_F = T_I = T_W with 1F1B's memory,
    # 2p stage activations per rank counted from F to W (what a W still holds counts).
    # The greedy order meets that up to p = 4; at p = 8 one rank idles one T_F inside its
    # span (its W's run out in the cool-down), the synchronous step is the paper's
    for m in (2 * p, 3 * p):
        s = build_schedule("zb-v", p, m, 2)
        res = simulate(s, EQUAL)
        assert max(res.span_idle_per_rank) < (EXACT if p <= 4 else EQUAL.forward + EXACT)
        assert abs(bubble_time(res) - (p - 1) * EQUAL.forward) < EXACT
        assert res.peak_activations == [2 * p] * p
        assert peak_activations(s, until="W") == [2 * p] * p


def test_zb_v_holds_2p_until_w_for_any_durations():
    """The quota counts what a W still holds: at most 2p per rank from F to W for every
    duration the order is built for (before, the W's ran after all I's: up to 2m)."""
    for d in (EQUAL, Durations(1.0, 1.25, 0.75, 0.05), Durations(1.0, 2.0, 0.5, 0.3),
              Durations(1.0, 3.0, 0.2, 2.0), Durations(36.0, 44.0, 38.0, 0.8)):
        for p, m in ((2, 8), (3, 7), (4, 16), (6, 12)):
            s = build_schedule("zb-v", p, m, 2, durations=d)
            assert max(peak_activations(s, until="W")) <= 2 * p, (d, p, m)
            assert check(lower(s)) == []


# DeepSeek-V3 report, Table 2: (p/2-1)(T_F&B + T_B - 3 T_W), T_B a full backward. This
# model does not overlap F with B, so F&B = T_F + T_B: the bound becomes
# (p/2-1)(T_F + 2 T_I - T_W). Worked by hand, (p, T_F, T_I, T_W) -> bound:
DUALPIPE_BOUND = {
    (4, 1.0, 1.0, 1.0): 2.0,  # 1 x (1 + 2 - 1)
    (8, 1.0, 1.0, 1.0): 6.0,  # 3 x (1 + 2 - 1)
    (4, 2.0, 3.0, 1.0): 7.0,  # 1 x (2 + 6 - 1)
    (8, 2.0, 3.0, 1.0): 21.0,  # 3 x (2 + 6 - 1)
    (8, 1.0, 0.5, 0.5): 4.5,  # 3 x (1 + 1 - 0.5)
}


@pytest.mark.parametrize("key", sorted(DUALPIPE_BOUND))
def test_dualpipe_paper_bound_by_hand(key):
    p, tf, ti, tw = key
    for m in (2 * p, 4 * p):  # the bound does not depend on m
        got = paper_bubble_time("dualpipe", p, m, 1, Durations(tf, ti, tw))
        assert abs(got - DUALPIPE_BOUND[key]) < EXACT


@pytest.mark.parametrize("p", [4, 8])
def test_dualpipe_within_deepseek_bound(p):
    # The list-scheduled order meets the bound for m >= 2p. Measured idle per rank at
    # T_F = T_I = T_W: 1.0 at p=4 (bound 2), 4.0 at p=8 (bound 6), for m = 2p and 4p.
    for m in (2 * p, 4 * p):
        d = EQUAL
        res = simulate(build_schedule("dualpipe", p, m), d)
        assert bubble_time(res) <= DUALPIPE_BOUND[(p, 1.0, 1.0, 1.0)] + EXACT
        one = simulate(build_schedule("1f1b", p, m), d).bubble_fraction
        assert res.bubble_fraction < one / 2


def test_list_schedules_use_given_durations():
    d = Durations(1.0, 2.0, 1.0)
    tuned = simulate(build_schedule("zb-v", 4, 16, 2, durations=d), d)
    generic = simulate(build_schedule("zb-v", 4, 16, 2), d)
    assert tuned.step_time <= generic.step_time
    assert check(lower(build_schedule("dualpipe", 8, 16, durations=Durations(2, 2, 1, 0.3)))) == []


def test_a_list_scheduled_order_is_laid_out_as_the_simulator_lays_it_out():
    """The list scheduler's own clock (its `layout`) is `simulate`'s lay-out of the order
    for the durations it was built for, when they are positive: `plait simulate` reuses
    it. Bit for bit, every figure and event."""
    from plait.schedule.simulate import events_of, result_of

    for name, p, m in (("zb-v", 4, 8), ("zb-v", 3, 13), ("dualpipe", 4, 8), ("dualpipe", 6, 6)):
        for d in (EQUAL, Durations(1.0, 1.25, 0.75, 0.05), Durations(1.0, 2.0, 0.5, 0.3)):
            layout: list = []
            s = build_schedule(name, p, m, 2 if name == "zb-v" else 1, d, layout=layout)
            assert layout[0] == d
            got = result_of(s, *layout[1:], [len(a) for a in s.actions],
                            events=events_of(s.actions, *layout[1:]))
            assert got == simulate(s, d), (name, p, m, d)
    for d in (Durations(1.0, 1.0, 0.0), Durations(0.0, 1.0, 1.0)):  # a zero duration:
        layout = []  # the scheduler's moments are not the simulator's times (no layout)
        s = build_schedule("zb-v", 3, 6, 2, d, layout=layout)
        assert layout == [] and check(s) == []  # it builds: never "made no progress"


# --- the simulator itself -------------------------------------------------------------------


def test_p2p_latency_gpipe():
    # each of the 2(p-1) hops of the fill and the drain adds one transfer
    p, m, c = 4, 6, 0.25
    d = Durations(1.0, 1.0, 1.0, p2p=c)
    res = simulate(build_schedule("gpipe", p, m), d)
    assert abs(res.step_time - ((m + p - 1) * 3.0 + 2 * (p - 1) * c)) < EXACT
    assert closed_form_bubble("gpipe", p, m, 1, d) is None  # no closed form with p2p


def test_post_time_occupies_the_rank():
    # gpipe p=2 m=2, rank 0 lowered: F0.0, SEND_F0.0, F0.1, SEND_F0.1, RECV_B0.1, ...:
    # posting a batch of transfers keeps the rank from its next compute for `post`
    s, c = build_schedule("gpipe", 2, 2), 0.25
    d = Durations(1.0, 1.0, 1.0, post=c)
    res = simulate(s, d)
    assert abs(res.events[0][1][3] - (1.0 + c)) < EXACT  # F0.1 starts after the post
    assert simulate(lower(s), d).events == res.events  # lowered or not, the same
    assert simulate(s, EQUAL).events[0][1][3] == 1.0
    # post time is idle, not busy
    assert res.busy_per_rank == simulate(s, EQUAL).busy_per_rank
    assert res.step_time > simulate(s, EQUAL).step_time
    assert closed_form_bubble("gpipe", 2, 2, 1, d) is None


def test_runtime_gap_before_each_compute():
    # gpipe p=2 m=2: `gap` (measure.runtime_gap) keeps a rank from each compute, and
    # overlaps a wait for the input: rank 1's F1.0 starts when F0.0's output is there
    s, c = build_schedule("gpipe", 2, 2), 0.25
    res = simulate(s, Durations(1.0, 1.0, 1.0, gap=c))
    assert [e[3] for e in res.events[0][:2]] == [c, 1.0 + 2 * c]  # F0.0, F0.1
    assert res.events[1][0][3] == 1.0 + c  # F1.0: max(0 + c, F0.0's end)
    assert res.busy_per_rank == simulate(s, EQUAL).busy_per_rank  # idle, not busy
    assert res.bubble_fraction > simulate(s, EQUAL).bubble_fraction
    assert closed_form_bubble("gpipe", 2, 2, 1, Durations(1.0, 1.0, 1.0, gap=c)) is None
    # gap 0 is the golden lay-out to the bit (tests/test_schedule_oracle.py); with p2p and
    # post too, more gap never shortens a step
    d = Durations(1.0, 1.3, 0.7, 0.11, post=0.05)
    for name in ("1f1b", "zb-v", "dualpipev"):
        sched = build_schedule(name, 4, 8, natural_virtual_stages(name, None))
        assert simulate(sched, replace(d, gap=0.0)) == simulate(sched, d)
        assert simulate(sched, replace(d, gap=0.02)).bubble_fraction > \
            simulate(sched, d).bubble_fraction


def test_a_whole_backward_of_its_own():
    """`Durations.backward_per_stage`: B takes its own time, not I + W (one autograd pass
    costs less than the split's two; dualpipev runs both). 1f1b p=2 m=1: F0 [0,1], F1
    [1,2], B1 [2,3.5], B0 [3.5,5] with B = 1.5 instead of I + W = 2; I and W unchanged."""
    s = build_schedule("1f1b", 2, 1)
    res = simulate(s, replace(EQUAL, backward_per_stage=(1.5, 1.5)))
    assert [e[3:] for e in res.events[1]] == [(1.0, 2.0), (2.0, 3.5)]
    assert res.events[0][1][3:] == (3.5, 5.0) and res.busy_per_rank == [2.5, 2.5]
    assert replace(EQUAL, backward_per_stage=(1.5, 1.5)).of("I", 0) == 1.0
    assert simulate(s, replace(EQUAL, backward_per_stage=(2.0, 2.0))) == simulate(s, EQUAL)
    assert closed_form_bubble("1f1b", 2, 1, 1, replace(EQUAL, backward_per_stage=(1.5,) * 2)) \
        is None
    with pytest.raises(ValueError, match="backward_per_stage has 1 entries"):
        simulate(s, replace(EQUAL, backward_per_stage=(1.5,)))


def test_each_action_its_own_duration():
    """`Durations.per_action` (the report's replay of a measured step): the named actions
    take their own time, the rest the per-stage one. gpipe p=2 m=2, F0.1 takes 3: rank 0
    F0.0 [0,1] F0.1 [1,4]; rank 1's F1.1 waits for it, [4,5]; B1.1 [5,7]."""
    s = build_schedule("gpipe", 2, 2)
    res = simulate(s, replace(EQUAL, per_action={("F", 0, 1): 3.0}))
    assert [e[3:] for e in res.events[0][:2]] == [(0.0, 1.0), (1.0, 4.0)]
    assert [e[3:] for e in res.events[1][1:3]] == [(4.0, 5.0), (5.0, 7.0)]
    assert simulate(s, replace(EQUAL, per_action={("F", 0, 1): 1.0})) == simulate(s, EQUAL)
    two = simulate(s, replace(EQUAL, per_action={("F", 0, 1): 3.0}), steps=2)
    assert [e[4] - e[3] for e in two.events[0][4:6]] == [1.0, 3.0]  # every step alike
    with pytest.raises(ValueError, match=">= 0"):
        simulate(s, replace(EQUAL, per_action={("F", 0, 1): -1.0}))


def test_measured_durations_keep_a_whole_backward_apart():
    """measure.measured_durations: a stage that ran B and I + W (dualpipev) gets each its
    own mean; one that ran only B, I = W = B / 2; one that never ran B, B = I + W."""
    from plait.parallel.pipeline.measure import measured_durations

    evs = [("F", 0, 0, 0.0, 1.0), ("B", 0, 0, 1.0, 2.5), ("F", 0, 1, 2.5, 3.5),
           ("I", 0, 1, 3.5, 4.5), ("W", 0, 1, 4.5, 5.5),
           ("F", 1, 0, 0.0, 1.0), ("B", 1, 0, 1.0, 2.0),
           ("F", 2, 0, 0.0, 1.0), ("I", 2, 0, 1.0, 2.25), ("W", 2, 0, 2.25, 3.0)]
    step = [(0.0, 6.0, evs, [(e[3], 0.0) for e in evs], [], [])]
    sched = Schedule("x", 1, 2, 3, 3, [0, 0, 0], [[]])
    d = measured_durations([step], sched)
    assert d.backward_input_per_stage == (1.0, 0.5, 1.25)
    assert d.backward_weight_per_stage == (1.0, 0.5, 0.75)
    assert d.backward_per_stage == (1.5, 1.0, 2.0)


def test_per_stage_durations():
    s = build_schedule("gpipe", 3, 4)
    same = Durations(
        9,
        9,
        9,
        forward_per_stage=(1, 1, 1),
        backward_input_per_stage=(1, 1, 1),
        backward_weight_per_stage=(1, 1, 1),
    )
    assert simulate(s, same).step_time == simulate(s, EQUAL).step_time
    # a slow middle stage sets the pace: GPipe's step is fill + m x slowest + drain
    slow = Durations(1, 1, 1, forward_per_stage=(1, 2, 1))
    res = simulate(s, slow)
    assert abs(res.step_time - (1 + 4 * 2 + 1 + 2 * 4 + 2 + 2)) < EXACT
    with pytest.raises(ValueError, match="3 stages"):
        simulate(s, Durations(1, 1, 1, forward_per_stage=(1, 2)))


def test_b_costs_i_plus_w():
    res = simulate(build_schedule("1f1b", 1, 3), Durations(1.0, 2.0, 0.5))
    assert res.step_time == 3 * 3.5 and res.bubble_fraction == 0.0


# --- errors ---------------------------------------------------------------------------------


def test_validation_names_the_fix():
    assert "use one of gpipe" in validate_schedule_request("pipedream", 4, 8, 1)[0]
    (msg,) = validate_schedule_request("interleaved", 4, 6, 2)
    assert "divisible by pp=4" in msg and "microbatches=8" in msg
    assert "virtual_stages=2" in validate_schedule_request("interleaved", 4, 8, 1)[0]
    assert "use virtual_stages=2" in validate_schedule_request("zb-v", 4, 8, 3)[0]
    assert "use virtual_stages=1" in validate_schedule_request("1f1b", 4, 8, 2)[0]
    assert "microbatches>=4" in validate_schedule_request("zb-h1", 4, 3, 1)[0]
    assert "microbatches>=7" in validate_schedule_request("dualpipev", 4, 6, 2)[0]
    both = validate_schedule_request("dualpipe", 3, 5, 1)
    assert len(both) == 2 and "even pp" in both[0] and "microbatches=6" in both[1]
    assert validate_schedule_request("1f1b", 0, 0, 1) == [
        "pp=0 must be >= 1",
        "microbatches=0 must be >= 1",
    ]
    for name, p, m, v in plan():
        if name != "dualpipev":
            assert validate_schedule_request(name, p, m, v) == []
    with pytest.raises(ValueError, match="even pp.*microbatches must be even"):
        build_schedule("dualpipe", 3, 5)


def test_action_and_text_errors():
    assert Action.parse("SEND_F0.3>1") == Action("SEND_F", 0, 3, 1)
    assert str(Action("RECV_B", 2, 5, 3)) == "RECV_B2.5<3"
    for bad in ("X0.1", "F0", "SEND_F0.1<1", "F0.1>2"):
        with pytest.raises(ValueError):
            Action.parse(bad)
    with pytest.raises(ValueError, match="peer"):
        Action("SEND_F", 0, 0)
    with pytest.raises(ValueError, match="header"):
        Schedule.from_text("0,F0.0\n")
    with pytest.raises(ValueError, match="already lowered"):
        lower(lower(build_schedule("1f1b", 2, 2)))


# --- the checker catches broken schedules ---------------------------------------------------


def _hand(actions: list[list[str]], p: int = 2, m: int = 2) -> Schedule:
    return Schedule(
        "hand", p, m, 1, p, list(range(p)), [[Action.parse(a) for a in acts] for acts in actions]
    )


def test_deadlock_is_detected():
    # rank 1 takes micro-batch 1 first; rank 0 sends it only after B0.0, which needs
    # rank 1's B1.0, which comes after F1.1: a cycle
    bad = _hand([["F0.0", "B0.0", "F0.1", "B0.1"], ["F1.1", "F1.0", "B1.0", "B1.1"]])
    for s in (bad, lower(bad)):
        (msg,) = check(s)
        assert msg.startswith("deadlock") and "rank 0 blocked at B0.0" in msg
        assert "rank 1 blocked at F1.1" in msg
    with pytest.raises(DeadlockError):
        simulate(bad, EQUAL)


def test_swapped_sends_are_caught():
    low = lower(build_schedule("1f1b", 4, 8))
    acts = low.actions[0]
    i, j = [k for k, a in enumerate(acts) if a.kind == "SEND_F"][:2]
    acts[i], acts[j] = acts[j], acts[i]
    problems = check(low)
    assert any("same order" in p for p in problems)
    assert any("comes before the compute that produces it" in p for p in problems)


def test_unmatched_send_is_caught():
    low = lower(build_schedule("1f1b", 2, 2))
    low.actions[1] = [a for a in low.actions[1] if str(a) != "RECV_F1.1<0"]
    assert any(p.startswith("unmatched send") and "RECV_F1.1<0" in p for p in check(low))
    low2 = lower(build_schedule("1f1b", 2, 2))
    low2.actions[0].append(Action("SEND_F", 0, 1, 1))  # a second send of the same thing
    assert any("2 x SEND_F0.1>1" in p for p in check(low2))


def test_a_recv_after_its_consumer_deadlocks():
    low = lower(build_schedule("1f1b", 2, 2))
    acts = low.actions[1]
    r = next(k for k, a in enumerate(acts) if str(a) == "RECV_F1.0<0")
    acts.append(acts.pop(r))
    problems = check(low)
    assert any("after the compute that needs it" in p for p in problems)
    assert "never posted" in deadlocks(low)[0]


def test_completeness_and_order_problems():
    s = _hand([["F0.0", "F0.1", "B0.0", "I0.1"], ["F1.0", "B1.0", "W1.1", "F1.1", "I1.1"]])
    problems = check(s)
    assert any("stage 0 micro-batch 1: backward is B x0, I x1, W x0" in p for p in problems)
    assert any("rank 1: W1.1 runs before I1.1" in p for p in problems)
    wrong_rank = _hand([["F1.0"], []])
    assert "lives on rank 1" in check(wrong_rank)[0]


# --- printing, drawing, the CLI -------------------------------------------------------------


def test_format_table():
    text = format_table(build_schedule("1f1b", 2, 2))
    lines = text.splitlines()
    assert lines[1].split() == ["rank", "0:", "F0", "F1", ".", ".", "B0", "B0", ".", "B1", "B1"]
    assert lines[2].split()[2:] == [".", "F0", "B0", "B0", "F1", "B1", "B1", ".", "."]
    assert "F0a" in format_table(build_schedule("zb-v", 2, 2, 2))


def test_draw_and_trace(tmp_path):
    pytest.importorskip("matplotlib")
    from plait.schedule.draw import draw_timeline, to_chrome_trace

    s = build_schedule("zb-h1", 4, 8)
    res = simulate(s, EQUAL)
    png = draw_timeline(res, s, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads(to_chrome_trace(res.events, tmp_path / "t.json").read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == sum(len(a) for a in s.actions) == 4 * 8 * 3
    assert {e["pid"] for e in xs} == {0, 1, 2, 3}


def _cli(*argv: str) -> int:
    ap = argparse.ArgumentParser(prog="plait")
    cli.add_parser(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["simulate", *argv])
    return args.func(args)


def test_cli(tmp_path, capsys):
    assert _cli("--schedule", "zb-v", "--pp", "4", "--microbatches", "8", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["virtual_stages"] == 2 and out["peak_activations"] == [8] * 4
    saved = tmp_path / "s.txt"
    assert (
        _cli(
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "-m",
            "8",
            "--save",
            str(saved),
            "--trace",
            str(tmp_path / "t.json"),
            "--show",
        )
        == 0
    )
    shown = capsys.readouterr().out
    assert "0.2727" in shown and "rank 3:" in shown  # (p-1)/(m+p-1) = 3/11
    assert Schedule.from_text(saved.read_text()).lowered
    assert _cli("--load", str(saved), "--json") == 0
    assert abs(json.loads(capsys.readouterr().out)["bubble_fraction"] - 3 / 11) < EXACT
    assert _cli("--schedule", "interleaved", "--pp", "4", "-m", "6") == 2
    assert "divisible by pp=4" in capsys.readouterr().err
    broken = saved.read_text().replace("RECV_F1.3<0,", "")
    (tmp_path / "b.txt").write_text(broken)
    assert _cli("--load", str(tmp_path / "b.txt")) == 2
    assert "fails its checks" in capsys.readouterr().err


def test_lowering_places_transfers():
    # sends right after their compute; receives one compute ahead, in the sender's order
    low = lower(build_schedule("1f1b", 2, 3))
    assert low.to_text().splitlines()[2:] == [
        "0,F0.0,SEND_F0.0>1,RECV_B0.0<1,F0.1,SEND_F0.1>1,B0.0,RECV_B0.1<1,F0.2,SEND_F0.2>1,"
        "RECV_B0.2<1,B0.1,B0.2",
        "1,RECV_F1.0<0,F1.0,RECV_F1.1<0,B1.0,SEND_B1.0>0,F1.1,RECV_F1.2<0,B1.1,SEND_B1.1>0,"
        "F1.2,B1.2,SEND_B1.2>0",
    ]


def test_list_scheduler_refuses_an_unknown_gate_or_freeing_kind():
    from plait.schedule.list_schedule import list_schedule

    for quota, freed_by in ((lambda s: (s, 2, True), "I"), (lambda s: (s, 2, "room"), "B")):
        with pytest.raises(ValueError, match="freed_by"):
            list_schedule("x", 2, 4, 1, [0, 1], 1, quota, freed_by=freed_by)
