"""ZeRO's collectives per step: how many reduce-scatters and how much of a rank's
parameters ZeRO-3 all-gathers, as plait/parallel/zero.py issues them.

Reduce-scatters: one a unit a micro-batch for ZeRO-2/3 without pp; one a unit a step for
ZeRO-1, and for every stage under pp (whole gradients accumulate over its micro-batches).

ZeRO-3's all-gathers of a stage's units, with m its micro-batches (m / chains: DualPipe's
copies take half each) and U its parameters (E of them the embedding's):

  zero3_gather  pp   per step
  step          any  U                      (a unit stays gathered to its last backward)
  microbatch    1    2 m U                  (before each forward and each backward)
  microbatch    > 1  m U + (m + s) (U - E)  (+ s U with recomputation)

under pp a backward gathers only what computes an input gradient (the embedding's takes
none); s of the m backwards are split into I and W, which gather each (I computes the
input gradients; some weight-gradient formulas view the weight), and with recomputation
a split backward's I runs the stage's forward again (its F ran without a graph). A chain's
first stage whose W follows its I at once runs the whole backward in W: not split
(plait/schedule/ir.py `split_backwards`). The closed form (`zero3_gathered`, a
batch of layouts) takes every backward of a splitting schedule as split; for one layout
`end_gathered` counts the built schedule's, the pipeline rank's stages of L / (p v)
layers each, and plait/plan/comm/rank.py the runtime's own partition.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

import numpy as np

from plait.plan import memory
from plait.plan.basis import Basis, Layout, Training
from plait.plan.compute import Num
from plait.schedule.ir import split_backwards
from plait.schedule.registry import build_schedule, schedule_spec


def zero_reduce_scatters(lay: Layout, b: Basis) -> Num:
    """Reduce-scatters of each ZeRO unit per step (the module docstring)."""
    if lay.zero < 2:
        return np.ones_like(b.pp)
    return np.where(b.pp > 1, 1.0, b.m)


def zero3_gathered(lay: Layout, b: Basis, pr: Num, forward_only: Num = 0.0) -> Num:
    """Parameters ZeRO-3 all-gathers per step on a rank holding `pr` (`forward_only` of
    them take no input gradient: the embedding), every backward of a splitting schedule
    taken as split (the module docstring); numbers or arrays."""
    if lay.zero3_gather == "step":
        return pr * np.ones_like(b.pp)
    spec = schedule_spec(b.sched)
    m_stage = b.m / spec.chains
    split = 1.0 if spec.split_backward else 0.0
    again = split if lay.runtime_mode() != "none" else 0.0
    piped = m_stage * ((1 + again) * pr + (1 + split) * (pr - forward_only))
    return np.where(b.pp > 1, piped, 2.0 * b.m * pr)


def gathered_by_stage(lay: Layout, pp: int, stages: Iterable[tuple[int, int, float, float]]
                      ) -> float:
    """Parameters ZeRO-3 all-gathers per step on a rank whose stages are `stages`:
    (micro-batches, split backwards, parameters, of them the embedding's) each."""
    stages = list(stages)
    if lay.zero3_gather == "step":
        return float(sum(u for _, _, u, _ in stages))
    if pp == 1:
        return float(sum(2 * m * u for m, _, u, _ in stages))
    again = lay.runtime_mode() != "none"
    return float(sum((m + (s if again else 0)) * u + (m + s) * (u - e)
                     for m, s, u, e in stages))


@cache
def stage_backwards(sched: str, pp: int, m: int, v: int, rank: int, recompute: bool
                    ) -> tuple[tuple[int, int, int], ...]:
    """(model stage, micro-batches, split backwards) of each stage of pipeline rank `rank`
    of the schedule as built (default durations, as the runtime builds it)."""
    schedule = build_schedule(sched, pp, m, v)
    _, split = split_backwards(schedule, rank, recompute)
    return tuple((schedule.model_stage(s), len(schedule.microbatches_of(s)),
                  sum(1 for st, _ in split if st == s)) for s in schedule.stages_on(rank))


def end_gathered(lay: Layout, b: Basis, last: bool, pr: Num, chunk: Num,
                 ends: tuple[Num, Num, Num]) -> tuple[Num, Num]:
    """(parameters, ZeRO-3's gathered parameters per step) of the first (`last` False) or
    the last pipeline rank holding `pr`: for one layout its stages from the built schedule,
    `chunk` parameters each and `ends` (embedding, head, more on model stage 0) where
    they sit; for a batch of layouts (or no pipeline) `zero3_gathered` of `pr`, the
    embedding's forward-only on the first."""
    emb, head, extra = ends
    scalar = all(np.size(x) == 1 for x in (b.pp, b.m, b.v))
    if not scalar or b.pp <= 1:
        return pr, zero3_gathered(lay, b, pr, 0.0 if last else emb)
    pp = int(b.pp)
    stages = stage_backwards(b.sched, pp, int(b.m), int(b.v), pp - 1 if last else 0,
                             lay.runtime_mode() != "none")
    n_model = schedule_spec(b.sched).model_stages(pp, int(b.v))
    held = [(m, s, chunk + (emb + extra if j == 0 else 0.0) + (head if j == n_model - 1
                                                                else 0.0),
             emb if j == 0 else 0.0) for j, m, s in stages]
    return sum(u for _, _, u, _ in held), gathered_by_stage(lay, pp, held)


def gathered_bytes(train: Training, gathered: Num, linear: Num = 0.0) -> Num:
    """Bytes ZeRO-3's all-gathers move per step: `gathered` parameters at the parameter's
    bytes, `linear` of them block-linear weights at memory.LINEAR_GATHER_BYTES's where the
    precision has them (fp8: 1 byte)."""
    pb = memory.state_bytes(train.precision, train.optimizer)[0]
    return gathered * pb - linear * (pb - memory.LINEAR_GATHER_BYTES.get(train.precision, pb))


def zero3_bytes(train: Training, lay: Layout, b: Basis, pr: Num, gathered: Num,
                linear: Num = 0.0) -> Num:
    """ZeRO-3's bytes per step over the replicas of a rank holding `pr` parameters of
    which it gathers `gathered` (`linear` of them block-linear weights: `gathered_bytes`):
    the gathers and the reduce-scatters."""
    _, gb, _ = memory.state_bytes(train.precision, train.optimizer)
    return pr * gb * zero_reduce_scatters(lay, b) + gathered_bytes(train, gathered, linear)
