"""Several steps in one timeline, and the simulator's and the list scheduler's work
growing linearly with the actions. Pure Python.

The multi-step cases are small enough to check by hand; the scaling tests count what the
event-driven code does (ranks resumed, (moment, rank) looks), never time.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from plait.cli.main import main
from plait.schedule import list_schedule
from plait.schedule import simulate as simulate_mod
from plait.schedule.registry import SCHEDULE_NAMES, build_schedule, natural_virtual_stages
from plait.schedule.simulate import DeadlockError, Durations, simulate

UNIT = Durations(1.0, 1.0, 1.0)  # T_F = T_I = T_W = 1


def test_zb_h2_post_validation_removes_the_fill_between_steps():
    # zb-h2, p=2, m=3, unit times. Rank 0: F0 F1 F2 I0 W0 I1 W1 I2 W2 runs 0..9 without a
    # gap; rank 1: F0 I0 F1 I1 F2 I2 W0 W1 W2 runs 1..10 (its F0 needs rank 0's F0).
    # Step 1 ends at 10: idle 1 per rank of 2 x 10, bubble 0.1.
    s = build_schedule("zb-h2", 2, 3)
    one = simulate(s, UNIT)
    assert one.step_time == 10.0 and one.bubble_fraction == 0.1
    assert [e[3] for e in one.events[1]] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    # barrier: every step starts at the last rank's end: 10, 20, 30
    bar = simulate(s, UNIT, steps=3)
    assert bar.step_ends == [10.0, 20.0, 30.0]
    assert bar.steady_step_time == 10.0 and bar.steady_bubble_fraction == 0.1
    # post-validation: rank 0 starts step 2 at 9, its F0 lands on rank 1 at 10, just as
    # rank 1 is free: each step is the first shifted by 9 = the busy time, bubble 0
    post = simulate(s, UNIT, steps=3, optimizer_sync="post_validation")
    assert post.step_ends == [10.0, 19.0, 28.0]
    assert post.steady_step_time == 9.0 and post.steady_bubble_fraction == 0.0
    assert post.events[0][9][3] == 9.0 and post.events[1][9][3] == 10.0  # step 2's F0s
    # the first step's figures are one step's, and every step's events are there
    assert (post.step_time, post.bubble_fraction, post.busy_per_rank) == (
        one.step_time, one.bubble_fraction, one.busy_per_rank)
    assert [len(e) for e in post.events] == [27, 27]


def test_time_between_steps():
    """`Durations.between` (the optimizer update and host work, measured by
    measure.between_steps): after the last rank's end with the barrier, after the rank's
    own with post-validation. zb-h2, p=2, m=3 as above, between = 2: the barrier's step
    starts at 10 + 2; rank 0 starts step 2 at 9 + 2, its F0 lands on rank 1 at 12, when
    rank 1 (free at 10 + 2) may start: period 11, one T_F below the barrier's 12."""
    s, d = build_schedule("zb-h2", 2, 3), replace(UNIT, between=2.0)
    bar = simulate(s, d, steps=3)
    assert bar.step_ends == [10.0, 22.0, 34.0] and bar.events[0][9][3] == 12.0
    post = simulate(s, d, steps=3, optimizer_sync="post_validation")
    assert post.step_ends == [10.0, 21.0, 32.0] and post.events[0][9][3] == 11.0
    assert post.steady_bubble_fraction == pytest.approx(1 - 9 / 11)
    assert simulate(s, d).step_time == simulate(s, UNIT).step_time  # one step: no effect
    # each rank its own (measure.between_per_rank): rank 1's update takes 4, so after the
    # barrier (10) it starts at 14, not at 13 when F0's output is there
    assert bar.events[1][9][3] == 13.0
    assert simulate(s, replace(d, between_per_rank=(2.0, 2.0)), steps=3) == bar
    own = simulate(s, replace(d, between_per_rank=(2.0, 4.0)), steps=3)
    assert own.events[0][9][3] == 12.0 and own.events[1][9][3] == 14.0
    with pytest.raises(ValueError, match="between_per_rank has 1 entries"):
        simulate(s, replace(d, between_per_rank=(2.0,)), steps=3)


def test_steps_replayed_each_with_its_own_times():
    """`per_action_steps`, `gap_steps`, `post_steps` and `between_steps` (a measured run
    replayed, measure.py's simulated_steady_bubble_replay): zb-h2, p=2, m=3 as above.
    The same times in every step are the plain lay-out; rank 1's last W of the second
    step taking 3 ends that step 2 later (22), and the barrier opens the third then; a
    rank's own time between the second and third step (rank 0: 5) delays only that step."""
    s = build_schedule("zb-h2", 2, 3)
    same = {(k, st, mb): 1.0 for k in "FIW" for st in (0, 1) for mb in range(3)}
    plain = simulate(s, replace(UNIT, between=2.0), steps=3)
    assert simulate(s, replace(UNIT, per_action_steps=(same,) * 3,
                               between_steps=((2.0, 2.0),) * 2), steps=3) == plain
    slow = replace(UNIT, per_action_steps=(same, {**same, ("W", 1, 2): 3.0}))
    assert simulate(s, slow, steps=3).step_ends == [10.0, 22.0, 32.0]
    late = simulate(s, replace(UNIT, between_steps=((0.0, 0.0), (5.0, 0.0))), steps=3)
    assert late.step_ends == [10.0, 20.0, 35.0]
    # each compute's own gap, each post its own time: a gap of 2 before rank 0's F1 of
    # the first step starts it at 3 and ends rank 0 at 11; rank 1, whose I0 fills the
    # wait, also ends at 11 (its F1 at 4, then without a gap); the next steps as before
    gap = simulate(s, replace(UNIT, gap_steps=({("F", 0, 1): 2.0},)), steps=3)
    assert gap.step_ends == [11.0, 21.0, 31.0] and gap.events[0][1][3] == 3.0
    assert gap.events[1][2][3] == 4.0
    lowered = replace(UNIT, post=0.5)
    posts = [len([a for a in q if a is None])
             for q in simulate_mod._queues(s, lowered)[1]]
    own = tuple(tuple([0.5] * k) for k in posts)
    assert simulate(s, replace(lowered, post_steps=(own,) * 3), steps=3) == simulate(
        s, lowered, steps=3)
    first_late = ((2.5, *own[0][1:]), own[1])  # rank 0's first post (its F0's send)
    late_post = simulate(s, replace(lowered, post_steps=(first_late,)), steps=3)
    assert late_post.events[0][1][3] == simulate(s, lowered).events[0][1][3] + 2.0  # F1
    with pytest.raises(ValueError, match="per_action_steps has 4 steps"):
        simulate(s, replace(UNIT, per_action_steps=(same,) * 4), steps=3)
    with pytest.raises(ValueError, match="each entry needs 2 ranks"):
        simulate(s, replace(UNIT, between_steps=((1.0,),)), steps=3)


def test_1f1b_gains_nothing_from_post_validation():
    # 1f1b, p=2, m=2 (B = 2): rank 0 F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]; rank 1 F0 [1,2]
    # B0 [2,4] F1 [4,5] B1 [5,7]. Rank 0 ends last, and starts the next step first: the
    # barrier costs nothing, period 9 either way.
    s = build_schedule("1f1b", 2, 2)
    for sync in ("barrier", "post_validation"):
        r = simulate(s, UNIT, steps=2, optimizer_sync=sync)
        assert r.step_ends == [9.0, 18.0] and r.steady_step_time == 9.0, sync
        assert abs(r.steady_bubble_fraction - (1 - 6 / 9)) < 1e-12


@pytest.mark.parametrize("name", ["zb-h2", "zb-v"])
def test_zero_bubble_schedules_reach_zero_in_the_steady_state(name):
    s = build_schedule(name, 4, 16, natural_virtual_stages(name, None))
    bar = simulate(s, UNIT, steps=3)
    post = simulate(s, UNIT, steps=3, optimizer_sync="post_validation")
    assert bar.steady_bubble_fraction == bar.bubble_fraction > 0
    assert post.steady_bubble_fraction == 0.0


def test_a_deadlock_over_several_steps_and_bad_arguments():
    s = build_schedule("1f1b", 2, 2)
    s.actions[1].reverse()  # B1.1 first: it can never run
    with pytest.raises(DeadlockError, match="rank 1 waits at B1.1"):
        simulate(s, UNIT, steps=2)
    with pytest.raises(ValueError, match="optimizer_sync"):
        simulate(build_schedule("1f1b", 2, 2), UNIT, optimizer_sync="lazy")
    with pytest.raises(ValueError, match="steps=0"):
        simulate(build_schedule("1f1b", 2, 2), UNIT, steps=0)


def test_cli_steps(capsys):
    assert main(["simulate", "--schedule", "zb-h2", "--pp", "2", "--microbatches", "3",
                 "--steps", "3", "--optimizer-sync", "post_validation", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bubble_fraction"] == 0.1  # the first step, as without --steps
    assert doc["steps"] == {"steps": 3, "optimizer_sync": "post_validation",
                            "step_ends": [10.0, 19.0, 28.0], "steady_step_time": 9.0,
                            "steady_bubble_fraction": 0.0}
    assert main(["simulate", "--steps", "0"]) == 2
    assert "--steps 0 must be between 1 and 1,000" in capsys.readouterr().err


# --- linear work -----------------------------------------------------------------------------


def _recorded(monkeypatch, module, cls_name):
    """Instances of module.cls_name made while the test runs."""
    made = []
    base = getattr(module, cls_name)

    class Recording(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(module, cls_name, Recording)
    return made


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_simulator_resumes_each_rank_at_most_once_per_action(name, monkeypatch):
    """Event-driven: a rank is run once, then only when the output it waits on appears,
    so over K steps ranks are resumed at most actions + p x K times (a rescanning
    simulator's looks grow with actions x rounds)."""
    made = _recorded(monkeypatch, simulate_mod, "_Timeline")
    for p, m in ((4, 16), (8, 64)):
        s = build_schedule(name, p, m, natural_virtual_stages(name, None))
        actions = sum(map(len, s.actions))
        for sync in ("barrier", "post_validation"):
            simulate(s, UNIT, steps=2, optimizer_sync=sync)
            assert made[-1].resumed <= 2 * actions + 2 * p, (p, m, sync)


@pytest.mark.parametrize("name", ["zb-v", "dualpipe"])
def test_list_scheduler_looks_are_linear_in_actions(name, monkeypatch):
    """Each (moment, rank) look is owed to something landing (an input, the rank itself
    falling free: at most three per action) or to the first moment, so looks stay within
    4 x actions + p at every size, with durations that make many distinct moments."""
    made = _recorded(monkeypatch, list_schedule, "ListScheduler")
    for p, m in ((4, 16), (8, 64), (16, 128)):
        for d in (None, Durations(1.0, 1.3, 0.7, 0.11)):
            s = build_schedule(name, p, m, natural_virtual_stages(name, None), durations=d)
            actions = sum(map(len, s.actions))
            assert made[-1].visits <= 4 * actions + p, (p, m, d)


def test_planner_uses_the_steady_state_under_post_validation():
    from plait.plan.bubble import simulate_pipeline

    ones = [1.0] * 4
    bar = simulate_pipeline("zb-h2", 4, 16, 1, ones, ones, ones, 0.0)
    post = simulate_pipeline("zb-h2", 4, 16, 1, ones, ones, ones, 0.0, "post_validation")
    assert (bar["optimizer_sync"], bar["source"]) == ("barrier", "simulator")
    assert bar["step"] == 16 * 3 + 3 and bar["bubble"] > 0  # the fill triangle (p-1) T_F
    assert post["optimizer_sync"] == "post_validation" and "steady state" in post["source"]
    assert (post["step"], post["bubble"]) == (48.0, 0.0)


def test_the_check_at_each_rank_cut():
    """Post-validation's check (`Durations.check`, measured by runtime_stats.check_per_rank) is
    laid out at each rank's cut (lower.speculative_prefix), from the second step on, idle.
    zb-h2, p=2, m=3 as above: rank 0's cut follows its two forwards (F0.2's receive of
    the first gradient is past it), rank 1's its first forward. Check 0.5: rank 0 runs
    step 2's F0 at 9, F1 at 10, checks at 11, F2 at 11.5; rank 1 runs F0 at 10 (rank 0's
    F0 ends then), checks at 11, I0 at 11.5, F1 at 12.5 (its input was there at 11)."""
    s = build_schedule("zb-h2", 2, 3)
    plain = simulate(s, UNIT, steps=3, optimizer_sync="post_validation")
    post = simulate(s, replace(UNIT, check=0.5), steps=3, optimizer_sync="post_validation")
    assert post.events[0][:9] == plain.events[0][:9]  # step 1 has no check
    assert [e[3] for e in post.events[0][9:12]] == [9.0, 10.0, 11.5]
    assert [e[3] for e in post.events[1][9:12]] == [10.0, 11.5, 12.5]
    assert post.busy_per_rank == plain.busy_per_rank  # idle, not busy
    assert post.step_ends == [10.0, 19.5, 29.0] and post.steady_step_time == 9.5
    # per rank: only rank 1 checks for long, only its actions after the cut move
    own = simulate(s, replace(UNIT, check_per_rank=(0.0, 0.5)), steps=3,
                   optimizer_sync="post_validation")
    assert [e[3] for e in own.events[0][9:12]] == [9.0, 10.0, 11.0]
    assert [e[3] for e in own.events[1][9:12]] == [10.0, 11.5, 12.5]
    # the barrier has no check; one step neither
    assert simulate(s, replace(UNIT, check=0.5), steps=3) == simulate(s, UNIT, steps=3)
    assert simulate(s, replace(UNIT, check=0.5)) == simulate(s, UNIT)
    # with posts: rank 0's cut falls inside the run (SEND_F0.1, RECV_B0.0), which the
    # runtime then posts as two batches: F0.1 ends at 12.5, post, check, post: F2 at 13.5
    posted = simulate(s, replace(UNIT, check=0.5, post=0.25), steps=3,
                      optimizer_sync="post_validation")
    assert [e[3] for e in posted.events[0][9:12]] == [10.25, 11.5, 13.5]
    with pytest.raises(ValueError, match="check_per_rank has 3 entries"):
        simulate(s, replace(UNIT, check_per_rank=(0.0, 0.1, 0.2)), steps=3)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_check_time_zero_is_the_lay_out_without_it(name):
    """check = 0 inserts nothing: every figure and event to the bit; a positive check
    never shortens a step, and the first step is unchanged."""
    s = build_schedule(name, 4, 8, natural_virtual_stages(name, None))
    d = Durations(1.0, 1.3, 0.7, 0.11, post=0.05, gap=0.02, between=0.3)
    base = simulate(s, d, steps=3, optimizer_sync="post_validation")
    assert simulate(s, replace(d, check=0.0, check_per_rank=(0.0,) * 4), steps=3,
                    optimizer_sync="post_validation") == base
    more = simulate(s, replace(d, check=0.4), steps=3, optimizer_sync="post_validation")
    assert more.step_ends[0] == base.step_ends[0] and more.steady_step_time >= \
        base.steady_step_time
    assert [len(e) for e in more.events] == [len(e) for e in base.events]


def test_cli_check(capsys):
    assert main(["simulate", "--schedule", "zb-h2", "--pp", "2", "--microbatches", "3",
                 "--steps", "3", "--optimizer-sync", "post_validation", "--check", "0.5",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["durations"]["check"] == 0.5
    assert doc["steps"]["step_ends"] == [10.0, 19.5, 29.0]
    assert doc["steps"]["steady_step_time"] == 9.5
    assert main(["simulate", "--check", "-1"]) == 2
    assert "--check -1.0 is a duration" in capsys.readouterr().err
