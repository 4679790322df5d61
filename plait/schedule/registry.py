"""The schedule registry: one `ScheduleSpec` per pipeline schedule, every fact about it.

Read by config validation (`plait/config/schema.py`), the partition (`partition.py`), the runtime
build (`build_pipeline`), `plait simulate` (`cli.py`), `plait train --schedule` and the
planner (`plait/plan/`: bubble, search, memory, estimate, cli). What only the planner's
formulas read (its ranking bubble, peak in-flight activations, search order and extra
search rules, the placement facts its costs use) is its own, keyed by these names
(plait/plan/schedule_facts.py). A new schedule is one entry in `SCHEDULES` (its builder in
`schedules.py`, its rules in `rules.py` if new ones are needed), its planner facts, and
their tests; docs/pipeline_schedules.md, "Adding a schedule".

The entry points (`build_schedule`, `validate_schedule_request`, `natural_virtual_stages`,
`num_model_stages`, `closed_form_bubble`, `paper_bubble_time`) are here and not in
`schedules.py` because the table refers to the builders there.

Vocabulary: p pipeline ranks, m micro-batches per step, v stages per rank of each chain
("virtual stages"), F, I, W one micro-batch's forward, input-gradient and weight-gradient
time on one stage (B = I + W). Pure Python (the schedule layer, tests/test_layering.py):
config validation imports this without torch or numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plait.schedule import rules as r
from plait.schedule import schedules as b
from plait.schedule.ir import Schedule, without_gc
from plait.schedule.rules import Rule
from plait.schedule.simulate import Durations

Num = Any  # an int or float, or a numpy array of them (the planner)
Bubble = Callable[[int, int, float, float, float], float | None]  # (p, m, F, I, W)


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule. Placement and order are the builder's (`schedules.py`)."""

    name: str
    build: Callable[..., Schedule]  # (p, m, v), or (p, m, v, durations, layout) if
    # list_scheduled
    rules: tuple[Rule, ...]  # what it needs of (p, m, v), in the order problems are shown
    # v when not given; fixed unless free_virtual_stages (interleaved: any v >= 2)
    virtual_stages: int = 1
    free_virtual_stages: bool = False
    chains: int = 1  # copies of the model, each its own chain of stages (DualPipe: 2)
    split_backward: bool = False  # B split into I and W (recompute: F again before I)
    list_scheduled: bool = False  # order searched for the durations (list_schedule.py)
    # Closed forms, uniform stages and free transfers. `sync_bubble`: the bubble time per
    # rank `simulate` must give under a synchronous step (None where none is known or
    # its conditions fail); `paper_bubble`: the bubble time as the papers state it.
    sync_bubble: Bubble | None = None
    paper_bubble: Bubble | None = None

    def v_of(self, v: Num) -> Num:
        """The stages per rank of each chain a build really uses (fixed unless free)."""
        return v if self.free_virtual_stages else self.virtual_stages

    def stages_per_rank(self, v: Num) -> Num:
        """Stages (chunks) one rank holds: v of each chain."""
        return self.v_of(v) * self.chains

    def model_stages(self, pp: Num, v: Num) -> Num:
        """Blocks the layers are cut into, one chain's stages (DualPipe's copies share)."""
        return pp * self.v_of(v)


# --- the table ----------------------------------------------------------------------------


def _fill_and_drain(p: int, m: int, f: float, i: float, w: float) -> float:
    """(p-1)(T_F+T_B): GPipe (Huang et al. 2019), 1F1B (Narayanan et al. 2021)."""
    return (p - 1) * (f + i + w)


SCHEDULES: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec(  # Huang et al. 2019: all forwards, then all backwards
        "gpipe", b.build_gpipe, (r.one_stage_per_rank(),),
        sync_bubble=_fill_and_drain, paper_bubble=_fill_and_drain),
    ScheduleSpec(  # PipeDream-Flush, Narayanan et al. 2021
        "1f1b", b.build_1f1b, (r.one_stage_per_rank(alternatives=r.SEVERAL_STAGES_ELSEWHERE),),
        sync_bubble=_fill_and_drain, paper_bubble=_fill_and_drain),
    ScheduleSpec(  # Narayanan et al. 2021 s2.2: (p-1)/(v m) of the ideal time
        "interleaved", b.build_interleaved,
        (r.SEVERAL_STAGES_PER_RANK, r.MICROBATCHES_MULTIPLE_OF_PP),
        virtual_stages=2, free_virtual_stages=True,
        sync_bubble=_fill_and_drain, paper_bubble=_fill_and_drain),
    ScheduleSpec(  # Qi et al. 2023 s2.1: 1F1B's memory, W's deferred by r
        "zb-h1", b.build_zb_h1,
        (r.one_stage_per_rank(alternatives=r.SEVERAL_STAGES_ELSEWHERE),
         r.MICROBATCHES_AT_LEAST_PP), split_backward=True,
        # needs T_W <= T_F, T_I
        sync_bubble=lambda p, m, f, i, w: (p - 1) * (f + i - w)
        if m >= p and w <= f and w <= i else None,
        paper_bubble=lambda p, m, f, i, w: (p - 1) * (f + i - w) if m >= p else None),
    ScheduleSpec(  # Qi et al. 2023 s2.2: 2p-1 activations on rank 0, the parallelogram
        "zb-h2", b.build_zb_h2,
        (r.one_stage_per_rank(alternatives=r.SEVERAL_STAGES_ELSEWHERE),
         r.MICROBATCHES_AT_LEAST_PP), split_backward=True,
        # the fill triangle the paper's parallelogram leaves under a synchronous step
        # (derived here, checked by tests/test_schedules.py)
        sync_bubble=lambda p, m, f, i, w: (p - 1) * f
        if m >= 2 * p - 1 and w <= f and w <= i <= 2 * w else None,
        paper_bubble=lambda p, m, f, i, w: (p - 1) * (f + i - 2 * w)
        if m >= 2 * p - 1 else None),
    ScheduleSpec(  # Qi et al. 2024 s6: a V, 2p stage activations per rank (1F1B's peak)
        "zb-v", b.build_zb_v, (r.TWO_STAGES_IN_A_V, r.MICROBATCHES_AT_LEAST_PP),
        virtual_stages=2, split_backward=True, list_scheduled=True),
    ScheduleSpec(  # DualPipe "cut in half" onto a V (DeepSeek), B split in the tail
        "dualpipev", b.build_dualpipev, (r.TWO_STAGES_IN_A_V, r.MICROBATCHES_FILL_THE_V),
        virtual_stages=2, split_backward=True),
    ScheduleSpec(  # DeepSeek-V3 report s3.2.1: two copies, m/2 micro-batches each way
        "dualpipe", b.build_dualpipe,
        (r.one_stage_per_rank("one stage of each of its two model copies"), r.EVEN_PP,
         r.HALF_THE_MICROBATCHES_EACH_WAY), chains=2, split_backward=True,
        list_scheduled=True,
        # Table 2 with T_F&B = T_F + T_B (no F/B overlap modelled): a bound, not an identity
        paper_bubble=lambda p, m, f, i, w: (p / 2 - 1) * (f + 2 * i - w)),
)}

SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULES)


# --- lookups ------------------------------------------------------------------------------


def schedule_spec(name: str) -> ScheduleSpec:
    """The registry entry; ValueError naming the known schedules otherwise."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; use one of "
                         f"{', '.join(SCHEDULE_NAMES)}") from None


def natural_virtual_stages(schedule: str, virtual_stages: int | None) -> int:
    """Stages per rank: as given, else what the schedule is built for (2 for V/interleaved)."""
    if virtual_stages is not None:
        return virtual_stages
    return schedule_spec(schedule).virtual_stages


def num_model_stages(schedule: str, pp: int, virtual_stages: int) -> int:
    """How many blocks the layers are cut into (DualPipe's two copies share the blocks)."""
    if pp == 1:
        return 1
    return schedule_spec(schedule).model_stages(pp, virtual_stages)


def validate_schedule_request(
    name: str, pp: int, microbatches: int, virtual_stages: int = 1,
    n_layers: int | None = None,
) -> list[str]:
    """Every problem with the request, each naming the fix; [] when it can be built. With
    `n_layers`, also whether the model has a layer for every stage (config validation)."""
    p, m, v = pp, microbatches, virtual_stages
    if name not in SCHEDULES:
        return [f"schedule={name!r} is unknown; use one of {', '.join(SCHEDULE_NAMES)}"]
    problems = [f"{what}={x} must be >= 1" for what, x in
                (("pp", p), ("microbatches", m), ("virtual_stages", v)) if x < 1]
    if problems:
        return problems
    spec = SCHEDULES[name]
    problems = [rule.problem(name, p, m, v) for rule in spec.rules if not rule.holds(p, m, v)]
    if not problems and n_layers is not None:
        problems = _stage_count_problems(spec, p, v, n_layers)
    return problems


def _stage_count_problems(spec: ScheduleSpec, pp: int, v: int, n_layers: int) -> list[str]:
    """Problems cutting n_layers for this schedule, each naming the options that work."""
    if pp <= 1:
        return []
    stages = spec.model_stages(pp, v)
    if stages <= n_layers:
        return []
    per_rank = stages // pp
    ok_pp = [q for q in range(2, n_layers + 1) if q * per_rank <= n_layers]
    fix = (f"use pp in {', '.join(map(str, ok_pp))}" if ok_pp else
           "use a schedule with one stage per rank (1f1b, zb-h1, ...)")
    return [f"{spec.name} at pp={pp} cuts the model into {stages} stages but model.n_layers="
            f"{n_layers}; every stage needs a layer: {fix}, or set model.n_layers>={stages}"]


@without_gc
def build_schedule(
    name: str,
    pp: int,
    microbatches: int,
    virtual_stages: int = 1,
    durations: Durations | None = None,
    layout: list | None = None,
) -> Schedule:
    """Build the named schedule; ValueError listing every problem (and its fix) otherwise.
    `durations` only matters for the list-scheduled zb-v and dualpipe, whose order is
    searched for those durations (default: T_F = T_I = T_W, free transfers); for them a
    `layout` list receives the search's own lay-out (`list_schedule.list_schedule`)."""
    problems = validate_schedule_request(name, pp, microbatches, virtual_stages)
    if problems:
        raise ValueError(f"cannot build schedule {name!r}: " + "; ".join(problems))
    spec = SCHEDULES[name]
    if spec.list_scheduled:
        return spec.build(pp, microbatches, virtual_stages, durations, layout)
    return spec.build(pp, microbatches, virtual_stages)


# --- closed forms -------------------------------------------------------------------------


def _uniform_and_free(d: Durations) -> bool:
    return not (d.p2p or d.post or d.gap or d.forward_per_stage or d.backward_input_per_stage
                or d.backward_weight_per_stage or d.backward_per_stage or d.per_action)


def closed_form_bubble(
    name: str, pp: int, microbatches: int, virtual_stages: int, d: Durations
) -> float | None:
    """The bubble fraction `simulate` must give (idle / (pp * step), synchronous step: every
    rank waits for the last one), for uniform stages and p2p = 0; None where no closed form
    applies (`ScheduleSpec.sync_bubble`). Busy time per rank is m v (T_F + T_B)."""
    spec = SCHEDULES.get(name)
    if not _uniform_and_free(d) or spec is None or spec.sync_bubble is None:
        return None
    p, m, v = pp, microbatches, virtual_stages
    tf, ti, tw = d.forward, d.backward_input, d.backward_weight
    busy = m * v * (tf + ti + tw)
    bubble = spec.sync_bubble(p, m, tf, ti, tw)
    return None if bubble is None else bubble / (busy + bubble)


def paper_bubble_time(
    name: str, pp: int, microbatches: int, virtual_stages: int, d: Durations
) -> float | None:
    """The bubble *time* per rank as the papers state it, where they do
    (`ScheduleSpec.paper_bubble`). The zero-bubble paper and the DeepSeek-V3 report count
    idle inside a rank's span (compare with `max(SimResult.span_idle_per_rank)`); for
    gpipe/1f1b/interleaved/zb-h1 that equals the synchronous bubble. Uniform stages,
    p2p = 0. For dualpipe the report's (p/2-1)(T_F&B + T_B - 3T_W) with T_F&B = T_F + T_B
    (this model does not overlap a forward with a backward): a bound to meet."""
    spec = SCHEDULES.get(name)
    if not _uniform_and_free(d) or spec is None or spec.paper_bubble is None:
        return None
    return spec.paper_bubble(pp, microbatches, d.forward, d.backward_input, d.backward_weight)
