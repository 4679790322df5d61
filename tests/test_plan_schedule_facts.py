"""The planner's schedule facts (plait/plan/schedule_facts.py) against the registry.

Every registry schedule has its planner facts and every fact set names a registry
schedule; what both tables state, or the planner states of a schedule the registry
builds, agrees: the LM head's placement, the search's rules (a build's and more), the
ranking bubble against the registry's closed forms, the first rank's in-flight
activations against the built schedule's.
"""

from __future__ import annotations

import pytest

from plait.plan.schedule_facts import FACTS, facts, planner_rules, search_schedules
from plait.schedule.ir import peak_activations
from plait.schedule.registry import (
    SCHEDULE_NAMES,
    build_schedule,
    natural_virtual_stages,
    schedule_spec,
)


def test_every_registry_schedule_has_planner_facts_and_no_other():
    assert set(FACTS) == set(SCHEDULE_NAMES)
    assert sorted(search_schedules()) == sorted(SCHEDULE_NAMES)
    orders = [facts(name).search_order for name in SCHEDULE_NAMES]
    assert sorted(orders) == list(range(len(SCHEDULE_NAMES)))  # a strict order
    with pytest.raises(ValueError, match="use one of gpipe, 1f1b"):
        facts("pipedream")


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_head_placement_is_the_built_schedules(name):
    v = natural_virtual_stages(name, None)
    s = build_schedule(name, 4, 8, v)
    last_stages = [(c + 1) * s.num_stages // s.num_chains - 1 for c in range(s.num_chains)]
    assert (0 in {s.stage_to_rank[j] for j in last_stages}) == facts(name).head_on_first_rank
    # DualPipe's F&B pairs exist only where a chain turns back onto rank 0
    assert not facts(name).pairs_forward_with_backward or facts(name).head_on_first_rank


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_the_search_asks_every_rule_a_build_does(name):
    spec, extra = schedule_spec(name), facts(name).search_rules
    assert planner_rules(name) == spec.rules + extra
    assert not set(extra) & set(spec.rules)  # an extra is not a build's rule again


# the registry's paper bubble is DeepSeek-V3's (p/2-1)(F + 2I - W), a bound with
# T_F&B = T_F + T_B: the planner ranks dualpipe below it
BOUND_ONLY = {"dualpipe"}


# the registry states no closed-form bubble for these two V-shaped schedules: their bubble
# is the simulator's
NO_CLOSED_FORM = {"zb-v", "dualpipev"}


def test_the_schedules_without_a_closed_form_are_the_v_shapes():
    assert {n for n in SCHEDULE_NAMES if schedule_spec(n).paper_bubble is None} == NO_CLOSED_FORM


@pytest.mark.parametrize("name", [n for n in SCHEDULE_NAMES if n not in NO_CLOSED_FORM])
def test_ranking_bubble_is_the_registrys_closed_form(name):
    spec, p, m = schedule_spec(name), 4, 16
    f, i, w = 1.0, 1.25, 0.75
    slots, idle = facts(name).ranking_bubble(p, f, i, w)
    ranked = max(slots, 0) * max(idle, 0)
    paper = spec.paper_bubble(p, m, f, i, w)
    if name in BOUND_ONLY:
        assert ranked <= paper
    else:
        assert ranked == pytest.approx(paper, rel=1e-12)


# the closed form is a bound where the simulated V of DualPipe overlaps its two halves
# (2p + 1 sets of half-size chunks on rank 0 against 2(p + 1)); dualpipe's counts p + 1
# stages' worth, which the simulator's per-(stage, micro-batch) count does not measure
BOUND_PEAK, OTHER_UNIT = {"dualpipev"}, {"dualpipe"}


@pytest.mark.parametrize("name", sorted(set(SCHEDULE_NAMES) - OTHER_UNIT))
@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_first_rank_peak_is_the_built_schedules(name, p, m):
    v = natural_virtual_stages(name, None)
    built = peak_activations(build_schedule(name, p, m, v), until="W")[0]
    first, _ = facts(name).peak_inflight(p, m, v, min)
    if name in BOUND_PEAK:
        assert first >= built
    else:
        assert first == built
