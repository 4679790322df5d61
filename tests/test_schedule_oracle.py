"""The event-driven builders and simulator against the rescanning ones' recorded outputs.

tests/golden/schedule_oracle.json holds what the rescanning implementation (round-robin rescans
in `simulate._lay_out`, `check.deadlocks` and the list scheduler; commit b55c6cb) gave on
a grid of small cases: every registered schedule at pp 1-6 and several micro-batch counts,
list-scheduled ones built for three sets of durations, each simulated under four (equal;
uneven with p2p; per-stage with p2p; with post time, which lowers the schedule). Per case:
a digest of the compute order and of its lowering, and per simulation the step time, the
bubble fraction, the peak activations and a digest of the per-rank idle, busy and span
idle and of every event, all compared exactly (floats by repr). The zb-v cases (and
`_broken`'s reversed zb-v rank) are the event-driven scheduler's own, since zb-v's quota
counts what a W still holds (`list_schedule`'s freed_by "W"); every other case is the
rescanning one's.

Regenerate only when an output is meant to change (say why in the commit):

    .venv/bin/python tests/test_schedule_oracle.py --update
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from plait.schedule.check import check
from plait.schedule.ir import Action, Schedule
from plait.schedule.lower import lower
from plait.schedule.registry import (
    SCHEDULE_NAMES,
    SCHEDULES,
    build_schedule,
    natural_virtual_stages,
    validate_schedule_request,
)
from plait.schedule.simulate import Durations, simulate

ORACLE = Path(__file__).resolve().parent / "golden" / "schedule_oracle.json"

# list-scheduled orders are built for these (None: the builder's default, equal, free)
BUILD_DURATIONS = {
    "default": None,
    "uneven": Durations(1.0, 1.25, 0.75, 0.05),
    "slow_p2p": Durations(1.0, 2.0, 0.5, 0.3),
}


def _sim_durations(num_stages: int) -> dict[str, Durations]:
    per = tuple(1.0 + 0.25 * ((3 * s) % 5) for s in range(num_stages))
    return {
        "equal": Durations(1.0, 1.0, 1.0),
        "uneven_p2p": Durations(1.0, 1.25, 0.75, 0.05),
        "per_stage": Durations(1.0, 1.0, 1.0, 0.1, forward_per_stage=per,
                               backward_input_per_stage=tuple(reversed(per)),
                               backward_weight_per_stage=tuple(0.5 * x for x in per)),
        "post": Durations(1.0, 1.5, 0.5, 0.2, post=0.1),
    }


def cases():
    """(name, pp, microbatches, virtual stages, build-durations key), every valid one."""
    for name in SCHEDULE_NAMES:
        vs = (2, 3) if SCHEDULES[name].free_virtual_stages else (natural_virtual_stages(name,
                                                                                          None),)
        builds = BUILD_DURATIONS if SCHEDULES[name].list_scheduled else {"default": None}
        for p in (1, 2, 3, 4, 6):
            for m in (1, 2, 3, 4, 6, 8, 13):
                for v in vs:
                    if validate_schedule_request(name, p, m, v):
                        continue
                    for key in builds:
                        yield name, p, m, v, key
        yield name, 8, 16, vs[0], "default"  # one longer steady state each


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def record(name: str, p: int, m: int, v: int, key: str) -> dict:
    """What the case gives with the code as it is now."""
    s = build_schedule(name, p, m, v, durations=BUILD_DURATIONS[key])
    out = {"order": _digest(s.to_text()), "lowered": _digest(lower(s).to_text())}
    for dname, d in _sim_durations(s.num_stages).items():
        r = simulate(s, d)
        per_rank = (r.bubble_per_rank, r.busy_per_rank, r.span_idle_per_rank, r.events)
        out[dname] = [repr(r.step_time), repr(r.bubble_fraction), r.peak_activations,
                      _digest(repr(per_rank))]
    return out


def _broken() -> dict[str, Schedule]:
    """Schedules that fail their checks, each a different way."""
    def hand(rows: list[list[str]], p: int = 2, m: int = 2) -> Schedule:
        return Schedule("hand", p, m, 1, p, list(range(p)),
                        [[Action.parse(a) for a in row] for row in rows])

    cycle = hand([["F0.0", "B0.0", "F0.1", "B0.1"], ["F1.1", "F1.0", "B1.0", "B1.1"]])
    swapped = lower(build_schedule("1f1b", 4, 8))
    sends = [k for k, a in enumerate(swapped.actions[0]) if a.kind == "SEND_F"][:2]
    row = swapped.actions[0]
    row[sends[0]], row[sends[1]] = row[sends[1]], row[sends[0]]
    late_recv = lower(build_schedule("zb-v", 3, 6, 2))
    row = late_recv.actions[1]
    row.append(row.pop(next(k for k, a in enumerate(row) if a.kind == "RECV_B")))
    stuck_v = build_schedule("zb-v", 3, 6, 2)
    stuck_v.actions[2].reverse()
    return {"cycle": cycle, "cycle_lowered": lower(cycle), "swapped_sends": swapped,
            "late_recv": late_recv, "reversed_rank": stuck_v,
            "incomplete": hand([["F0.0", "F0.1", "B0.0", "I0.1"],
                                ["F1.0", "B1.0", "W1.1", "F1.1", "I1.1"]])}


def broken_record() -> dict[str, list[str]]:
    """check()'s problems, and simulate()'s complaint, for each broken schedule."""
    out = {}
    for key, s in _broken().items():
        try:
            simulate(s, Durations(1.0, 1.0, 1.0))
            complaint = "ran"
        except ValueError as e:
            complaint = f"{type(e).__name__}: {e}"
        out[key] = [*check(s), complaint]
    return out


def test_broken_schedules_are_reported_as_before():
    want = json.loads(ORACLE.read_text())["_broken"]
    assert broken_record() == want


def _case_id(case) -> str:
    return "{}-p{}-m{}-v{}-{}".format(*case)


def test_oracle_covers_the_grid():
    want = json.loads(ORACLE.read_text())
    assert sorted(want) == sorted([_case_id(c) for c in cases()] + ["_broken"])


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_builders_and_simulator_match_the_oracle(name):
    want = json.loads(ORACLE.read_text())
    for case in cases():
        if case[0] == name:
            assert record(*case) == want[_case_id(case)], _case_id(case)


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: tests/test_schedule_oracle.py --update")
    doc = {_case_id(c): record(*c) for c in cases()}
    doc["_broken"] = broken_record()
    lines = [f"{json.dumps(k)}: {json.dumps(doc[k])}" for k in sorted(doc)]
    ORACLE.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"{len(doc)} cases written to {ORACLE}")


def test_fast_transfer_verdict_agrees_with_the_full_check():
    """check() asks the one-pass `_transfers_hold` first and lists the problems only when
    it says no: both must agree, on valid lowerings and on randomly broken ones."""
    import random

    from plait.schedule import check as checks

    rng = random.Random(11)
    compared = 0
    for name, p, m in (("1f1b", 3, 4), ("zb-v", 3, 6), ("dualpipe", 4, 4),
                       ("interleaved", 2, 4)):
        v = natural_virtual_stages(name, None)
        assert checks._transfers_hold(lower(build_schedule(name, p, m, v)))
        for _ in range(60):
            s = lower(build_schedule(name, p, m, v))
            row = s.actions[rng.randrange(p)]
            i, j = rng.randrange(len(row)), rng.randrange(len(row))
            op = rng.choice(("swap", "drop", "move", "dup"))
            if op == "swap":
                row[i], row[j] = row[j], row[i]
            elif op == "drop":
                row.pop(i)
            elif op == "move":
                row.insert(j, row.pop(i))
            else:
                row.insert(j, row[i])
            scanned = checks._scan(s)
            if scanned is None or checks._completeness(s, scanned[0]):
                continue  # the full transfer check runs there anyway
            compared += 1
            assert checks._transfers_hold(s) == (checks._transfers(s) == []), (name, op)
    assert compared > 100
