"""What a schedule requires of (pp, microbatches, virtual_stages), each with its fix.

A `Rule` is read twice: by `registry.validate_schedule_request` (config validation,
`build_schedule`, `plait simulate`), which prints `problem` for each rule broken, and by
the planner's search (`plait/plan/search.py`), which evaluates `holds` on numpy arrays of
layouts at once and names the rules in its own words (`brief`). So `holds` uses only
operators that work elementwise (`==`, `>=`, `%`), never `and` / `or`.

Pure Python: this module imports nothing (tests/test_layering.py, the schedule layer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Num = Any  # an int, or a numpy array of them (the planner)


@dataclass(frozen=True)
class Rule:
    """One requirement; `problem(name, pp, microbatches, virtual_stages)` when broken."""

    holds: Callable[[Num, Num, Num], Any]  # (p, m, v) -> bool, elementwise on arrays
    problem: Callable[[str, int, int, int], str]  # the sentence, naming the fix
    brief: str  # the requirement in the planner's words, e.g. "micro-batches >= pp"


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


# --- stages per rank ---------------------------------------------------------------------


def one_stage_per_rank(what: str = "one stage", alternatives: str = "") -> Rule:
    """v = 1; `what` says what a rank holds, `alternatives` extends the fix."""
    return Rule(
        lambda p, m, v: v == 1,
        lambda name, p, m, v: f"{name} places {what} per rank (got virtual_stages={v}); "
        f"use virtual_stages=1{alternatives}",
        "v=1",
    )


SEVERAL_STAGES_ELSEWHERE = ", or schedule=interleaved / zb-v for several stages per rank"

SEVERAL_STAGES_PER_RANK = Rule(
    lambda p, m, v: v >= 2,
    lambda name, p, m, v: f"{name} needs virtual_stages >= 2 (got {v}); use virtual_stages=2, "
    "or schedule=1f1b for one stage per rank",
    "v>=2",
)

TWO_STAGES_IN_A_V = Rule(
    lambda p, m, v: v == 2,
    lambda name, p, m, v: f"{name} places exactly 2 stages per rank in a V (got "
    f"virtual_stages={v}); use virtual_stages=2",
    "v=2",
)

# --- micro-batches -------------------------------------------------------------------------

MICROBATCHES_MULTIPLE_OF_PP = Rule(
    lambda p, m, v: m % p == 0,
    lambda name, p, m, v: f"{name} needs microbatches divisible by pp={p} (got {m}); use "
    f"microbatches={_round_up(m, p)} or another multiple of {p}",
    "micro-batches divisible by pp",
)

MICROBATCHES_AT_LEAST_PP = Rule(
    lambda p, m, v: m >= p,
    lambda name, p, m, v: f"{name} needs microbatches >= pp={p} (got {m}); use "
    f"microbatches>={p}",
    "micro-batches >= pp",
)

MICROBATCHES_FILL_THE_V = Rule(  # DualPipeV's warm-up: phase 4 is not negative on rank 0
    lambda p, m, v: m >= 2 * p - 1,
    lambda name, p, m, v: f"{name} needs microbatches >= 2*pp-1 = {2 * p - 1} (got {m}) to "
    f"fill its warm-up; use microbatches>={2 * p - 1}",
    "micro-batches >= 2*pp-1",
)

HALF_THE_MICROBATCHES_EACH_WAY = Rule(  # two chains, m/2 micro-batches down each
    lambda p, m, v: m % 2 == 0,
    lambda name, p, m, v: f"{name} sends half the micro-batches each way: microbatches must "
    f"be even (got {m}); use microbatches={m + 1}",
    "an even micro-batch count",
)

# --- pipeline ranks ------------------------------------------------------------------------

EVEN_PP = Rule(  # two chains meeting in the middle: rank j and rank p-1-j pair up
    lambda p, m, v: p % 2 == 0,
    lambda name, p, m, v: (f"{name} needs an even pp (got {p}); use pp={p + 1} or pp={p - 1}"
                           if p > 1 else f"{name} needs an even pp >= 2; use pp=2"),
    "an even pp",
)
