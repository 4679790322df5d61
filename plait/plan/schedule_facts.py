"""What the planner knows of each pipeline schedule beyond what the runtime builds.

The schedule registry (plait/schedule/registry.py, `ScheduleSpec`) holds what
config validation, the runtime and the simulator need: the builder, the rules a build
asks, stage counts, chains, the backward split, the simulator's closed forms. This module
holds what only the planner's formulas read, one `ScheduleFacts` per registry name:

  search_order               the order the search scores schedules in; of layouts with
                             equal closed-form step times the earlier wins (1f1b before
                             gpipe: the same time, less memory)
  ranking_bubble             the closed-form bubble on the slowest rank (bubble.py)
  peak_inflight              activation sets alive at the peak, first and last rank
                             (memory.py's ranking; the simulator's replace them)
  search_rules               what the search asks beyond the registry's `rules`
  head_on_first_rank         a chain's last stage (the LM head) sits on rank 0 too
  pairs_forward_with_backward  DualPipe's F&B chunks hide the expert all-to-alls

tests/test_plan_schedule_facts.py holds the two tables to the same names and checks what
both state (placement, the bubbles the registry's closed forms give) against each other
and against the built schedules.

Vocabulary as the registry's: p pipeline ranks, m micro-batches per step, v stages per
rank of each chain, F, I, W one micro-batch's forward, input-gradient and weight-gradient
time on one chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plait.schedule import rules as r
from plait.schedule.registry import SCHEDULE_NAMES, schedule_spec
from plait.schedule.rules import Rule

Num = Any  # a number or a numpy array of them


def _fill_and_drain(p: Num, f: Num, i: Num, w: Num) -> tuple[Num, Num]:
    """p - 1 slots of F + I + W (GPipe, 1F1B, interleaved per chunk)."""
    return p - 1, f + i + w


def _one_rank_in_flight_up_to_p(p: Num, m: Num, v: Num, lo: Callable) -> tuple[Num, Num]:
    """1F1B: p sets on rank 0 (Narayanan et al. 2021), one on the last."""
    return lo(p, m), 1


@dataclass(frozen=True)
class ScheduleFacts:
    """The planner's facts of one schedule (the defaults are 1F1B's)."""

    search_order: int
    # (slots, idle per slot) for (p, F, I, W): the bubble is slots x idle, each clipped
    # at 0; elementwise on arrays
    ranking_bubble: Callable[[Num, Num, Num, Num], tuple[Num, Num]] = _fill_and_drain
    # peak in-flight (micro-batch x stage) activation sets on the first and the last rank
    # for (p, m, v, minimum), `minimum` elementwise (numpy's)
    peak_inflight: Callable[..., tuple[Num, Num]] = _one_rank_in_flight_up_to_p
    search_rules: tuple[Rule, ...] = ()
    head_on_first_rank: bool = False
    pairs_forward_with_backward: bool = False


FACTS: dict[str, ScheduleFacts] = {
    "gpipe": ScheduleFacts(1, peak_inflight=lambda p, m, v, lo: (m, m)),  # all m in flight
    "1f1b": ScheduleFacts(0),
    # p*v + p - 1 chunks of L/(pv) layers: the (1 + (p-1)/(pv)) penalty (Korthikanti et
    # al. 2022, sec. 4.2.3 / Megatron)
    "interleaved": ScheduleFacts(
        7, peak_inflight=lambda p, m, v, lo: (lo(p * v + p - 1, m * v),
                                              lo((v - 1) * p + 1, m * v))),
    # Qi et al. 2023 s2.1: 1F1B's memory, W's deferred
    "zb-h1": ScheduleFacts(2, ranking_bubble=lambda p, f, i, w: (p - 1, f + i - w)),
    # Qi et al. 2023 s2.2: 2p-1 activations on rank 0, the parallelogram
    "zb-h2": ScheduleFacts(3, ranking_bubble=lambda p, f, i, w: (p - 1, f + i - 2 * w),
                           peak_inflight=lambda p, m, v, lo: (lo(2 * p - 1, m), lo(p, m))),
    # Qi et al. 2024 s6: a V, 2p stage activations per rank (1F1B's peak)
    "zb-v": ScheduleFacts(4, ranking_bubble=lambda p, f, i, w: (p - 1, f + i - 2 * w),
                          peak_inflight=lambda p, m, v, lo: (lo(2 * p, 2 * m), 1),
                          head_on_first_rank=True),
    # DualPipe "cut in half" onto a V (DeepSeek), B split in the tail
    "dualpipev": ScheduleFacts(
        5, ranking_bubble=lambda p, f, i, w: (p / 2 - 1, f + 2 * i - 2 * w),
        peak_inflight=lambda p, m, v, lo: (lo(2 * (p + 1), 2 * m), 1),
        head_on_first_rank=True, pairs_forward_with_backward=True),
    # DeepSeek-V3 report s3.2.1: two copies, p+1 stages' worth in flight; the search also
    # asks m >= p, as it always has (kept so its outputs hold)
    "dualpipe": ScheduleFacts(
        6, ranking_bubble=lambda p, f, i, w: (p / 2 - 1, f + 2 * i - 2 * w),
        peak_inflight=lambda p, m, v, lo: (lo(p + 1, m), 1),
        search_rules=(r.MICROBATCHES_AT_LEAST_PP,),
        head_on_first_rank=True, pairs_forward_with_backward=True),
}


def facts(name: str) -> ScheduleFacts:
    """The planner's facts of the schedule; the registry's ValueError naming the known ones
    otherwise (the two tables name the same schedules: tests/test_plan_schedule_facts.py)."""
    schedule_spec(name)
    return FACTS[name]


def planner_rules(name: str) -> tuple[Rule, ...]:
    """What the planner's search asks of (p, m, v): every rule a build needs, and its own
    extras (never less: `plait plan` offers only what `plait train` runs)."""
    return schedule_spec(name).rules + facts(name).search_rules


def search_schedules() -> list[str]:
    """The registry's schedules in the order the search scores them."""
    return sorted(SCHEDULE_NAMES, key=lambda name: facts(name).search_order)
