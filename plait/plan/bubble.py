"""Pipeline time: closed forms for ranking many layouts, the shared simulator for the
numbers a layout shows (plait/schedule/simulate.py: one cost model).

F, I, W below are one micro-batch's forward, input-gradient and weight-gradient time on
one *chunk* (a stage of the schedule: L/p layers, L/(pv) interleaved, L/(2p) for the V
shapes). Closed forms of the step (busy + bubble) on the slowest rank:
  gpipe, 1f1b    (m + p - 1)(F + I + W)               Huang 2019; Narayanan et al. 2021
  interleaved    m v (F+I+W) + (p-1)(F+I+W)           Narayanan et al. 2021, sec. 2.2
  zb-h1          m (F+I+W) + (p-1)(F + I - W)         Qi et al. 2023 ("zero bubble"), sec. 2
  zb-h2          m (F+I+W) + (p-1)(F + I - 2W)        (clipped at 0)
  zb-v           2m (F+I+W) + (p-1)(F + I - 2W)       Qi et al. 2024 (V schedule), chunk times
  dualpipe(v)    c m (F+I+W) + (p/2 - 1)(F + 2I - 2W) DeepSeek-V3 report, Table 2, with
                                                      F&B = F + B (no overlap modelled)
plus 2(p-1) p2p transfers on the fill/drain path. Each schedule's bubble term is its
planner facts' `ranking_bubble` (plait/plan/schedule_facts.py).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from plait.plan.schedule_facts import facts, planner_rules
from plait.schedule.registry import build_schedule, schedule_spec

Num = Any

# actions we let the simulator lay out per call before extrapolating in m
_SIM_ACTIONS = 24_000
# a schedule never extrapolated (peaks growing with m) is simulated up to this many
# actions (a few seconds); past it, the closed form stands in and says so
_SIM_ACTIONS_MAX = 400_000
# list-scheduled schedules (zb-v, dualpipe) have their order searched for the durations
# when built: above this p*m the planner uses the closed form. (The search cost ~(p*m)^2
# when this was set; it is O(n log n) now, but the limit stays so that plans do not move.)
_LIST_BUILD_LIMIT = 400


def chunks_per_rank(schedule: str, v: Num) -> Num:
    """Stages (chunks) one rank holds (the registry's `stages_per_rank`)."""
    return schedule_spec(schedule).stages_per_rank(v)


def stages_per_chain(schedule: str, pp: Num, v: Num) -> Num:
    """Stages one copy of the model is cut into (dualpipe: each of its two chains has pp)."""
    return schedule_spec(schedule).model_stages(pp, v)


def closed_form(schedule: str, pp: Num, m: Num, v: Num, f: Num, i: Num, w: Num,
                p2p: Num) -> Num:
    """Pipeline step time on the slowest rank (see the module docstring)."""
    spec = schedule_spec(schedule)
    p = np.asarray(pp, dtype=float)
    m = np.asarray(m, dtype=float)
    b = f + i + w
    c = spec.stages_per_rank(np.asarray(v, dtype=float))
    busy = m * c * b / spec.chains  # each chain runs its share of the micro-batches
    slots, idle = facts(schedule).ranking_bubble(p, f, i, w)
    bubble = np.maximum(slots, 0) * np.maximum(idle, 0)
    return np.where(p > 1, busy + bubble + 2 * (p - 1) * p2p, m * c * b)


def _valid_m(schedule: str, p: int, v: int, target: int) -> int:
    """The smallest micro-batch count >= target, and >= p (a steady state to extrapolate
    from), the search accepts for the schedule."""
    rules = planner_rules(schedule)
    start = max(target, p)
    for m in range(start, 2 * start + 2 * p):  # a multiple of p, or of 2, lies in there
        if all(rule.holds(p, m, v) for rule in rules):
            return m
    raise ValueError(f"no micro-batch count >= {start} suits {schedule} at pp={p}, v={v}")


def _peaks_grow_with_m(schedule: str, p: int, v: int) -> bool:
    """Whether the closed-form peak activations keep growing with m (gpipe: all m in
    flight): then a short run's peaks are not a long run's, so it is never extrapolated."""
    peaks, big = facts(schedule).peak_inflight, 1 << 40
    return peaks(p, big, v, min) != peaks(p, 2 * big, v, min)


@lru_cache(maxsize=256)
def _build(schedule: str, pp: int, m: int, v: int, ratios: tuple[float, float, float]) -> Any:
    """The schedule, built once per (name, p, m, v, rounded duration ratios): list-scheduled
    orders are tuned to the ratios I/F, W/F, p2p/F, valid under any durations."""
    from plait.schedule.simulate import Durations

    return build_schedule(schedule, pp, m, v, durations=Durations(1.0, *ratios))


# post-validation: the steady state is read from steps 2..STEADY_STEPS of one timeline
STEADY_STEPS = 3


@lru_cache(maxsize=4096)
def _simulate(schedule: str, pp: int, m: int, v: int, f: tuple[float, ...],
              i: tuple[float, ...], w: tuple[float, ...], p2p: float,
              optimizer_sync: str = "barrier", post: float = 0.0, gap: float = 0.0
              ) -> tuple[float, float, tuple[int, ...]]:
    """(step, bubble, peaks): one step under the barrier; under post-validation the
    steady-state step of STEADY_STEPS consecutive ones (a rank starts its next step when
    its own is done)."""
    from plait.schedule.ir import peak_activations
    from plait.schedule.simulate import Durations, simulate

    d = Durations(f[0], i[0], w[0], p2p, forward_per_stage=f, backward_input_per_stage=i,
                  backward_weight_per_stage=w, post=post, gap=gap)
    fm = max(sum(f) / len(f), 1e-30)
    ratios = (round(sum(i) / len(i) / fm, 1), round(sum(w) / len(w) / fm, 1),
              round(p2p / fm, 2))
    sched = _build(schedule, pp, m, v, ratios)
    # memory counts a micro-batch's activations from F to W (or B): after I a W still
    # holds its weight-gradient inputs (Qi et al. 2023, Table 1), as the closed forms'
    # `peak_inflight` bounds do (schedule_facts.py); for F/B schedules it is the count to B
    peaks = tuple(peak_activations(sched, until="W"))
    if optimizer_sync == "barrier":
        r = simulate(sched, d, events=False)  # the figures only: no per-event tuples
        return r.step_time, r.bubble_fraction, peaks
    r = simulate(sched, d, STEADY_STEPS, optimizer_sync, events=False)
    return r.steady_step_time, r.steady_bubble_fraction, peaks


class TooLargeToSimulate(Exception):
    """A schedule the planner does not simulate at this size (see the limits above)."""


def simulate_pipeline(schedule: str, pp: int, m: int, v: int, f: list[float], i: list[float],
                      w: list[float], p2p: float, optimizer_sync: str = "barrier",
                      post: float = 0.0, gap: float = 0.0) -> dict[str, Any]:
    """Step time, bubble and per-rank peak activations from the shared simulator, with
    per-stage durations. Long runs are simulated at two smaller micro-batch counts and
    extrapolated linearly in m (exact once the steady state repeats). `optimizer_sync`
    ("barrier" or "post_validation", as `parallel.optimizer_sync`): the time of one step
    that waits for every rank, or the steady-state step when each rank starts its next
    step as soon as its own is done (Qi et al. 2023, section 4); the result says which
    (`optimizer_sync`, and `source`). `post`: a rank's time to post one batch of
    transfers (the simulator's; a measured profile's p2p_post); `gap`: a rank's own
    runtime work before each compute action (the simulator's; a profile's pipeline_gap)."""
    out = _simulate_pipeline(schedule, pp, m, v, f, i, w, p2p, optimizer_sync, post, gap)
    if optimizer_sync != "barrier":
        out["source"] += (f", steady state of steps 2-{STEADY_STEPS} ({optimizer_sync})"
                          if out["source"].startswith("simulator")
                          else f"; {optimizer_sync} not modelled by the closed form")
    return {**out, "optimizer_sync": optimizer_sync}


def _simulate_pipeline(schedule: str, pp: int, m: int, v: int, f: list[float],
                       i: list[float], w: list[float], p2p: float,
                       optimizer_sync: str, post: float = 0.0, gap: float = 0.0
                       ) -> dict[str, Any]:
    spec = schedule_spec(schedule)
    key = (tuple(f), tuple(i), tuple(w), float(p2p), optimizer_sync, float(post), float(gap))
    actions = pp * m * 2 * spec.stages_per_rank(v)
    try:
        if spec.list_scheduled and pp * m > _LIST_BUILD_LIMIT and \
                3 * pp * pp > _LIST_BUILD_LIMIT:
            raise TooLargeToSimulate(f"{schedule} with p*m={pp * m} is too large to "
                                     "list-schedule here")
        if spec.list_scheduled and pp * m > _LIST_BUILD_LIMIT:
            actions = _SIM_ACTIONS + 1  # extrapolate from small builds
        if actions > _SIM_ACTIONS_MAX and _peaks_grow_with_m(schedule, pp, v):  # gpipe
            raise TooLargeToSimulate(f"{actions:,} actions are too many to simulate here")
        if actions <= _SIM_ACTIONS or _peaks_grow_with_m(schedule, pp, v):
            step, bubble, peaks = _simulate(schedule, pp, m, v, *key)
            return {"step": step, "bubble": bubble, "peaks": list(peaks),
                    "source": "simulator"}
        m1 = _valid_m(schedule, pp, v, 2 * pp)
        m2 = _valid_m(schedule, pp, v, m1 + max(pp, 2))
        s1, _, _ = _simulate(schedule, pp, m1, v, *key)
        s2, _, peaks = _simulate(schedule, pp, m2, v, *key)
        step = s2 + (m - m2) * (s2 - s1) / (m2 - m1)
        busy = m * spec.stages_per_rank(v) * (sum(f) + sum(i) + sum(w)) / len(f)
        busy /= spec.chains  # each chain runs its share of the micro-batches
        return {"step": step, "bubble": max(0.0, 1 - busy / step), "peaks": list(peaks),
                "source": f"simulator at m={m1},{m2}, extrapolated to m={m}"}
    except TooLargeToSimulate as exc:  # the closed form stands in, and says so
        n = len(f)
        fm, im, wm = (max(x) for x in (f, i, w))
        step = float(closed_form(schedule, pp, m, v, fm, im, wm, p2p))
        busy = m * spec.stages_per_rank(v) * (sum(f) + sum(i) + sum(w)) / n
        busy /= spec.chains
        return {"step": step, "bubble": max(0.0, 1 - busy / step), "peaks": None,
                "source": f"closed form ({exc})"}


def simulate_layers(layers_total: int, sched: str, pp: int, m: int, v: int, f: float,
                    i: float, w: float, head_f: float, head_g: float, p2p: float,
                    optimizer_sync: str = "barrier", post: float = 0.0, gap: float = 0.0
                    ) -> dict[str, Any]:
    """A model of `layers_total` layers through the shared simulator (plait/plan/
    estimate.py's one layout): per-stage durations, layers split as evenly as possible,
    the head on the last stage of each chain."""
    if pp == 1:
        c = layers_total
        step = m * (c * (f + i + w) + head_f + 2 * head_g)
        return {"step": step, "bubble": 0.0, "peaks": [1], "source": "no pipeline",
                "optimizer_sync": optimizer_sync}
    chains = schedule_spec(sched).chains
    n = stages_per_chain(sched, pp, v)
    base, extra = divmod(layers_total, n)
    layers = [base + (1 if s >= n - extra else 0) for s in range(n)]
    fs = [x * f for x in layers] * chains
    is_ = [x * i for x in layers] * chains
    ws = [x * w for x in layers] * chains
    for last in range(n - 1, n * chains, n):
        fs[last] += head_f
        is_[last] += head_g
        ws[last] += head_g
    return simulate_pipeline(sched, pp, m, v, fs, is_, ws, p2p, optimizer_sync, post, gap)
