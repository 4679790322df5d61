"""The schedule registry is the only list of schedules, and its facts are the builders'.

Every place that offers a schedule by name (config validation, `plait train --schedule`,
`plait simulate --schedule`, `plait plan --schedule`, the planner's search and layout
check) offers exactly the registry's names; each entry's stage counts, chains and
backward split agree with the schedule its builder makes; the planner's vectorised use of
the rules agrees with validation's.
"""

from __future__ import annotations

import argparse
import importlib

import numpy as np
import pytest

from plait.cli.main import build_parser
from plait.config import load_config
from plait.plan.estimate import Layout, Training
from plait.plan.hardware import Cluster, get_gpu
from plait.plan.schedule_facts import planner_rules
from plait.plan.shape import from_preset
from plait.schedule.registry import (
    SCHEDULE_NAMES,
    SCHEDULES,
    build_schedule,
    natural_virtual_stages,
    num_model_stages,
    schedule_spec,
    validate_schedule_request,
)

search = importlib.import_module("plait.plan.search")  # plait.plan re-exports a function


def _schedule_choices(command: str) -> tuple[str, ...]:
    """The `--schedule` choices of `plait <command>`."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    (flag,) = [a for a in sub.choices[command]._actions if "--schedule" in a.option_strings]
    return tuple(flag.choices)


# --- one list -----------------------------------------------------------------------------


def test_names_are_unique_and_keyed_by_their_own_name():
    assert SCHEDULE_NAMES == tuple(spec.name for spec in SCHEDULES.values())
    assert len(set(SCHEDULE_NAMES)) == len(SCHEDULE_NAMES) >= 8


def test_config_accepts_exactly_the_registry():
    for name in SCHEDULE_NAMES:
        problems = load_config(sets=[f"parallel.schedule={name}"]).validate()
        assert not [p for p in problems if p.startswith("parallel.schedule=")], problems
    (problem,) = load_config(sets=["parallel.schedule=pipedream"]).validate()
    assert problem == f"parallel.schedule='pipedream'; use one of {', '.join(SCHEDULE_NAMES)}"


def test_clis_offer_exactly_the_registry():
    for command in ("train", "simulate", "plan"):
        assert _schedule_choices(command) == SCHEDULE_NAMES, command


def test_planner_searches_and_accepts_exactly_the_registry():
    variants = search.schedule_variants()
    assert {name for name, _ in variants} == set(SCHEDULE_NAMES)
    for name, v in variants:
        assert v == schedule_spec(name).virtual_stages or schedule_spec(name).free_virtual_stages
    shape, cluster, train = from_preset("llama3-8b"), Cluster(get_gpu("h100-sxm"), 64), \
        Training(64)
    (problem,) = search.layout_problems(shape, cluster, train,
                                        Layout(tp=8, pp=2, dp=4, schedule="pipedream"))
    assert problem.endswith(f"use one of {', '.join(SCHEDULE_NAMES)}")


def test_unknown_names_say_the_known_ones():
    with pytest.raises(ValueError, match="use one of gpipe, 1f1b"):
        schedule_spec("pipedream")
    assert "use one of gpipe" in validate_schedule_request("pipedream", 4, 8)[0]


# --- the entries' facts are the builders' -------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_entry_facts_match_the_built_schedule(name):
    spec, p, m = schedule_spec(name), 4, 8
    v = natural_virtual_stages(name, None)
    s = build_schedule(name, p, m, v)
    assert s.num_chains == spec.chains
    assert s.num_stages == spec.chains * num_model_stages(name, p, v)
    assert all(len(s.stages_on(r)) == spec.stages_per_rank(v) for r in range(p))
    kinds = {a.kind for acts in s.actions for a in acts}
    assert ("I" in kinds and "W" in kinds) == spec.split_backward
    if spec.free_virtual_stages:  # any v its rules accept builds with that many per rank
        s3 = build_schedule(name, p, m, 3)
        assert s3.num_stages == num_model_stages(name, p, 3) == 3 * p


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_rules_hold_elementwise_as_they_do_one_by_one(name):
    """The planner evaluates each rule on arrays of layouts: the same verdicts."""
    p = np.array([1, 2, 3, 4, 4, 5, 8, 8])
    m = np.array([1, 8, 6, 4, 3, 10, 16, 14])
    spec = schedule_spec(name)
    for v in (1, 2, 3):
        for rule in spec.rules + planner_rules(name):
            together = np.broadcast_to(rule.holds(p, m, v), p.shape)
            one_by_one = [bool(rule.holds(int(a), int(b), v)) for a, b in zip(p, m)]
            assert together.tolist() == one_by_one


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_what_the_planner_searches_can_be_built(name):
    # every layout the search may try must build (e.g. no dualpipev at p <= m < 2p-1)
    for p in (2, 3, 4, 8):
        for m in range(1, 3 * p):
            for v in (1, 2, 3):
                if all(bool(rule.holds(p, m, v)) for rule in planner_rules(name)):
                    assert validate_schedule_request(name, p, m, v) == [], (p, m, v)
