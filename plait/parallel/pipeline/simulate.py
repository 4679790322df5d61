"""The shared pipeline cost model: lay a schedule out in time, given durations.

Used by `plait simulate`, by the planner (`plait/plan/`) and by the validator that compares
measured timelines with this prediction: one cost model (docs/architecture.md,
"One cost model"). The closed forms it must agree with are the registry's
(`registry.closed_form_bubble`, `registry.paper_bubble_time`).

What is modelled. Each rank runs its compute actions strictly in list order, one at a time.
An action starts when its rank is free *and* its input has arrived:
  F s, mb   the output of F (s-1), mb        (+ p2p if stage s-1 is on another rank)
  I/B s, mb the gradient from I/B (s+1), mb   (+ p2p if on another rank); the last stage
            of a chain needs only its own F (the loss)
  W s, mb   its own I s, mb
B takes T_I + T_W. A transfer is latency `p2p` on the link, counted from the producer's
compute end: it does not occupy either rank (the runtime posts sends/receives
asynchronously). Posting does cost the rank something: `post` is the time one batch of
consecutive transfer actions of the lowered schedule keeps its rank from computing (the
runtime's `batch_isend_irecv` call; on gloo under load ~1 ms, mostly blocked, not CPU).
With post = 0 (the default) transfers are skipped and only p2p counts; with post > 0 an
unlowered schedule is lowered first. Post time is idle, not busy, in the bubble.

Not modelled: bandwidth contention between concurrent transfers, compute/communication
interference, overlap of a forward with a backward chunk (DualPipe's F&B), the optimizer
step and gradient all-reduce after the flush, and per-micro-batch jitter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.parallel.pipeline.check import peak_activations
from plait.parallel.pipeline.ir import Action, Schedule

Event = tuple[str, int, int, float, float]  # (kind, stage, microbatch, start, end)


@dataclass(frozen=True)
class Durations:
    forward: float  # T_F per stage per micro-batch (seconds, or any unit)
    backward_input: float  # T_I  (B = I + W)
    backward_weight: float  # T_W
    p2p: float = 0.0  # one activation/grad transfer between ranks
    # optional per-stage overrides: tuple of length num_stages, else None
    forward_per_stage: tuple[float, ...] | None = None
    backward_input_per_stage: tuple[float, ...] | None = None
    backward_weight_per_stage: tuple[float, ...] | None = None
    post: float = 0.0  # a rank's time to post one batch of transfers (lowered schedule)

    def of(self, kind: str, stage: int) -> float:
        """Duration of one compute action on `stage`."""
        f = self.forward_per_stage[stage] if self.forward_per_stage else self.forward
        i = (
            self.backward_input_per_stage[stage]
            if self.backward_input_per_stage
            else self.backward_input
        )
        w = (
            self.backward_weight_per_stage[stage]
            if self.backward_weight_per_stage
            else self.backward_weight
        )
        return {"F": f, "I": i, "W": w, "B": i + w}[kind]


@dataclass
class SimResult:
    step_time: float
    bubble_fraction: float  # idle / (pp * step_time) over all ranks (mean idle fraction)
    bubble_per_rank: list[float]  # idle fraction of step_time, per rank
    busy_per_rank: list[float]  # compute time per rank
    peak_activations: list[int]  # micro-batch activations in flight per rank
    events: list[list[Event]]  # per rank: (kind, stage, mb, start, end)
    # idle time between each rank's first and last action. The zero-bubble paper and the
    # DeepSeek-V3 report count this ("parallelogram") bubble: it is what a step costs when
    # the optimizer's synchronisation is removed (Qi et al. 2023, section 4, post-update
    # validation) and the next step's forwards start as soon as a rank is done.
    span_idle_per_rank: list[float] = field(default_factory=list)


class DeadlockError(ValueError):
    """The schedule's order makes some rank wait for an action that can never run."""


def simulate(schedule: Schedule, durations: Durations) -> SimResult:
    """Lay the schedule out in time (see the module docstring for the rules)."""
    _check_durations(schedule, durations)
    schedule, queues = _queues(schedule, durations)
    events = _lay_out(schedule, queues, durations)
    step = max((ev[-1][4] for ev in events if ev), default=0.0)
    busy = [sum(e - s for _, _, _, s, e in ev) for ev in events]
    per_rank = [(step - b) / step if step > 0 else 0.0 for b in busy]
    return SimResult(
        step_time=step,
        bubble_fraction=sum(per_rank) / schedule.pp,
        bubble_per_rank=per_rank,
        busy_per_rank=busy,
        peak_activations=peak_activations(schedule),
        events=events,
        span_idle_per_rank=[
            (ev[-1][4] - ev[0][3]) - b if ev else 0.0 for ev, b in zip(events, busy)
        ],
    )


Queue = list[Action | None]  # a rank's compute actions; None: posting a batch of transfers


def _queues(schedule: Schedule, durations: Durations) -> tuple[Schedule, list[Queue]]:
    """Each rank's work in order: its compute actions, and with post > 0 one None per run
    of consecutive transfers (the schedule lowered first if it is not)."""
    if durations.post <= 0:
        return schedule, [[a for a in acts if not a.is_comm] for acts in schedule.actions]
    if not schedule.lowered:
        from plait.parallel.pipeline.lower import lower

        schedule = lower(schedule)
    runs = [[a for k, a in enumerate(acts)
             if not a.is_comm or k == 0 or not acts[k - 1].is_comm] for acts in
            schedule.actions]
    return schedule, [[None if a.is_comm else a for a in q] for q in runs]


def _lay_out(schedule: Schedule, queues: list[Queue], durations: Durations
             ) -> list[list[Event]]:
    """Run every rank as far as its inputs allow, round after round, until all is done."""
    pos = [0] * schedule.pp
    free = [0.0] * schedule.pp
    # end time of each finished compute, keyed by (kind family, stage, mb):
    # "F" for forwards, "G" for the input-gradient producer (I or B), "W" for W.
    done: dict[tuple[str, int, int], float] = {}
    events: list[list[Event]] = [[] for _ in range(schedule.pp)]
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for r in range(schedule.pp):
            while pos[r] < len(queues[r]):
                a = queues[r][pos[r]]
                if a is None:  # posting a batch of transfers
                    free[r] += durations.post
                else:
                    t = _ready_time(schedule, durations, done, a)
                    if t is None:
                        break
                    start = max(free[r], t)
                    free[r] = start + durations.of(a.kind, a.stage)
                    fam = "G" if a.kind in ("I", "B") else a.kind
                    done[(fam, a.stage, a.microbatch)] = free[r]
                    events[r].append((a.kind, a.stage, a.microbatch, start, free[r]))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [
                f"rank {r} waits at {queues[r][pos[r]]}"
                for r in range(schedule.pp)
                if pos[r] < len(queues[r])
            ]
            raise DeadlockError("schedule cannot finish: " + "; ".join(stuck))
    return events


def _ready_time(schedule: Schedule, durations: Durations,
                done: dict[tuple[str, int, int], float], a: Action) -> float | None:
    """When the inputs of compute action `a` are available on its rank; None if not yet."""
    rank_of, stage, mb = schedule.stage_to_rank, a.stage, a.microbatch
    if a.kind == "F":
        src = schedule.prev_stage(stage)
        if src is None:
            return 0.0
        key = ("F", src, mb)
    elif a.kind in ("I", "B"):
        src = schedule.next_stage(stage)
        if src is None:  # last stage of the chain: the loss gradient is local
            return done.get(("F", stage, mb))
        if ("F", stage, mb) not in done:
            return None
        key = ("G", src, mb)
    else:  # W needs its own I
        return done.get(("G", stage, mb))
    if key not in done:
        return None
    return done[key] + (durations.p2p if rank_of[src] != rank_of[stage] else 0.0)


def _check_durations(schedule: Schedule, d: Durations) -> None:
    for name in ("forward_per_stage", "backward_input_per_stage", "backward_weight_per_stage"):
        v = getattr(d, name)
        if v is not None and len(v) != schedule.num_stages:
            raise ValueError(
                f"Durations.{name} has {len(v)} entries; the schedule has "
                f"{schedule.num_stages} stages"
            )
    if min(d.forward, d.backward_input, d.backward_weight, d.p2p, d.post) < 0:
        raise ValueError("durations must be >= 0")
