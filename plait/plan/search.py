"""Enumerate every valid layout, score them all at once, rank, simulate the best.

Mesh order: the vectorised pass scores every layout in the records' default order
(innermost first: tp inside a node); each layout the simulator re-ranks is then also
scored under every other order that places its groups differently (`best_order`), and
keeps the fastest (the default on a tie).

Candidates: each dimension's record says which of its sizes the search tries
(`Dimension.plan_sizes`: tp inside a node, a sequence split into whole chunks, ...): the
rank grid's axes nested in the default order, the batch axis (dp) taking the ranks left,
the dimensions laid over the replicas last; the records' `plan_problems` refuse a planned
size.

Speed: the numeric sizes (every dimension's, micro-batch size) become numpy arrays and
`estimate.evaluate` scores one array per (schedule, virtual stages, ZeRO stage,
recompute) combination — about a hundred vectorised calls instead of a Python loop over
~10^5 layouts. Pipelines are ranked by their closed forms; the best `simulate_top`
layouts are then re-evaluated through the shared simulator, re-ranked, and shown.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from plait.dims import AXES, BY_NAME, DEFAULT_ORDER, DIMENSIONS, LAID, REPLICA_AXES
from plait.plan.basis import SHARD_COPIES, WRITTEN, product
from plait.plan.bubble import stages_per_chain
from plait.plan.comm import price
from plait.plan.compute import Efficiency
from plait.plan.estimate import Estimate, Layout, Training, evaluate
from plait.plan.hardware import Cluster
from plait.plan.memory import RECOMPUTE
from plait.plan.schedule_facts import planner_rules, search_schedules
from plait.plan.shape import ATTENTION, Shape
from plait.schedule.registry import SCHEDULE_NAMES, SCHEDULES

VIRTUAL_STAGES = (2, 3, 4, 6, 8)
MAX_MICROBATCH = 16  # sequences; larger micro-batches only add activation memory


class PlanError(ValueError):
    """Bad input or no feasible layout; the message says what to change."""


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (trial division to sqrt(n): fast for any GPU count)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


# the rank grid's axes, written as a layout writes them (the product the GPUs must be)
GRID = tuple(name for name in WRITTEN if BY_NAME[name].axis)


def layout_problems(shape: Shape, cluster: Cluster, train: Training, lay: Layout) -> list[str]:
    """Every reason the layout is invalid (empty when valid), each naming the fix: the
    product of the axes, each dimension's own (its record's `plan_problems`), the batch,
    the schedule, the ZeRO stage and the recompute mode and attention kernel."""
    n = cluster.n_gpus
    out = []
    prod = lay.world
    if prod != n:
        out.append(f"layout {'*'.join(GRID)} = {'*'.join(str(lay.sizes[d]) for d in GRID)} "
                   f"= {prod} does not multiply to the GPU count {n}; change a size or "
                   f"--gpus {prod}")
    out += [msg for d in DIMENSIONS for msg in d.plan_problems(lay, shape)]
    if train.global_batch % (lay.dp * lay.mbs):
        out.append(f"global batch {train.global_batch} sequences is not divisible by dp*"
                   f"micro-batch = {lay.dp}*{lay.mbs}")
    if lay.schedule not in SCHEDULES:
        out.append(f"schedule {lay.schedule!r} is unknown; use one of "
                   f"{', '.join(SCHEDULE_NAMES)}")
    elif lay.pp > 1 and not out:
        m = train.global_batch // (lay.dp * lay.mbs)
        if not _schedule_ok(lay.schedule, np.array([lay.pp]), np.array([m]), lay.v,
                            shape.layers)[0]:
            out.append(_schedule_hint(lay.schedule, lay.pp, m, lay.v, shape.layers,
                                      stages_per_chain(lay.schedule, lay.pp, lay.v)))
    if lay.zero not in (0, 1, 2, 3):
        out.append(f"zero={lay.zero}: use 0, 1, 2 or 3")
    if lay.recompute not in RECOMPUTE:
        out.append(f"recompute={lay.recompute!r}: use one of {', '.join(RECOMPUTE)}")
    if lay.attention not in ATTENTION:
        out.append(f"attention={lay.attention!r}: use one of {', '.join(ATTENTION)}")
    return out


def _schedule_hint(s: str, p: int, m: int, v: int, layers: int, stages: int) -> str:
    needs = " and ".join(rule.brief for rule in planner_rules(s))
    return (f"schedule {s} with pp={p}, {m} micro-batches, virtual stages {v} is not valid "
            f"({stages} stages for {layers} layers; {s} needs {needs}, and a layer per stage)")


def _schedule_ok(s: str, pp: np.ndarray, m: np.ndarray, v: int, layers: int) -> np.ndarray:
    """Which layouts (arrays of pp and micro-batch counts) the schedule can run: its
    registry rules as the search applies them, and a layer for every stage."""
    spec = SCHEDULES[s]
    ok = np.ones(np.shape(pp), dtype=bool)
    for rule in planner_rules(s):
        ok = ok & rule.holds(pp, m, v)
    return ok & (spec.model_stages(pp, v) <= layers)


def schedule_variants() -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs the search scores, in the planner's search order;
    a free stage count (interleaved) is tried at each of VIRTUAL_STAGES."""
    out = []
    for name in search_schedules():
        spec = SCHEDULES[name]
        vs = VIRTUAL_STAGES if spec.free_virtual_stages else (spec.virtual_stages,)
        out += [(name, v) for v in vs]
    return out


# the axes the search nests, in the default order; the batch axis takes the ranks left
BATCH = next(d.name for d in AXES if d.splits == "batch")
NESTED = tuple(name for name in DEFAULT_ORDER if name != BATCH)
COLUMNS = (*(d.name for d in DIMENSIONS), "mbs")


def _axis_sizes(ranks: int, shape: Shape, node: int, axes: tuple[str, ...] = NESTED
                ) -> Iterator[dict[str, int]]:
    """Every size of `axes` (nested in order, each its record's `plan_sizes` of the
    divisors of the ranks left) with the batch axis's, the ranks left after them."""
    if not axes:
        yield {BATCH: ranks}
        return
    d = BY_NAME[axes[0]]
    for size in d.plan_sizes(divisors(ranks), shape, node):
        for rest in _axis_sizes(ranks // size, shape, node, axes[1:]):
            yield {d.name: size, **rest}


def _laid_sizes(axes: dict[str, int], shape: Shape, node: int) -> list[dict[str, int]]:
    """The sizes of the dimensions laid over the replicas, from the divisors of those and
    the consecutive replica ranks one node holds (`node_replicas`); a combination a
    record's `plan_problems` refuses is left out."""
    replicas = divisors(product(axes, REPLICA_AXES))
    options = [d.plan_sizes(replicas, shape, node_replicas(axes, node)) for d in LAID]
    out = []
    for sizes in itertools.product(*options):
        laid = dict(zip((d.name for d in LAID), sizes, strict=True))
        lay = Layout({**axes, **laid})
        if not any(d.plan_problems(lay, shape) for d in LAID):
            out.append(laid)
    return out


def node_replicas(axes: dict[str, int], node: int) -> int:
    """The most consecutive replica ranks (a divisor of the replicas) inside one node, in
    the default mesh order (the one a laid dimension is modelled in)."""
    strides = price.order_strides(DEFAULT_ORDER, axes)
    return max(b for b in divisors(product(axes, REPLICA_AXES))
               if price.replica_block_span(DEFAULT_ORDER, axes, strides, b) <= node)


def numeric_candidates(shape: Shape, cluster: Cluster, train: Training) -> dict[str, np.ndarray]:
    """Every dimension's size and the micro-batch size meeting divisibility, as parallel
    arrays keyed by record name (and "mbs")."""
    n, gpn, b = cluster.n_gpus, cluster.gpus_per_node, train.global_batch
    rows = []
    for axes in _axis_sizes(n, shape, gpn):
        dp = axes[BATCH]
        if b % dp:
            continue  # DP consumes batch: every replica needs whole sequences
        laid = [{**axes, **sizes} for sizes in _laid_sizes(axes, shape, gpn)]
        for mbs in divisors(b // dp):
            if mbs > MAX_MICROBATCH:
                break
            rows.extend((*(sizes[name] for name in COLUMNS[:-1]), mbs) for sizes in laid)
    a = np.array(rows, dtype=np.int64).reshape(-1, len(COLUMNS))
    return {k: a[:, j] for j, k in enumerate(COLUMNS)}


@dataclass
class SearchResult:
    top: list[Estimate]  # simulated, best first
    considered: int
    feasible: int
    closest: Estimate | None = None  # when nothing fits: the smallest-memory layout
    extra: dict[str, Any] = field(default_factory=dict)


def search(shape: Shape, cluster: Cluster, train: Training, eff: Efficiency, top: int = 5,
           simulate_top: int | None = None, cost: Callable[[Estimate], Any] | None = None,
           attention: str = "flash", async_tp: bool = False, overlap_fb: bool = False,
           ) -> SearchResult:
    """The best `top` layouts by step time or `cost(estimate)` (plait/plan/goodput.py); every
    layout with the given kernel, async tp and DualPipe's overlap (Layout's fields)."""
    seconds = cost or (lambda e: e.step_time)
    given = {"sp": True, "attention": attention, "async_tp": async_tp, "overlap_fb": overlap_fb}
    c = numeric_candidates(shape, cluster, train)
    if len(c["mbs"]) == 0:
        raise PlanError(f"no layout divides {cluster.n_gpus} GPUs with a global batch of "
                        f"{train.global_batch} sequences; use a batch divisible by more "
                        "data-parallel sizes or another GPU count")
    m = train.global_batch // (c["dp"] * c["mbs"])
    copies = product(c, SHARD_COPIES)
    scored: list[tuple[np.ndarray, np.ndarray, np.ndarray, dict]] = []
    considered = 0
    orders = search_orders(shape, cluster)
    for sched, v in [("none", 1)] + schedule_variants():
        mask = (c["pp"] == 1) if sched == "none" else (c["pp"] > 1) & _schedule_ok(
            sched, c["pp"], m, v, shape.layers)
        if not mask.any():
            continue
        for zero in (0, 1, 2, 3):
            # ZeRO-0 shards nothing: copies of shards (hybrid sharding) need a stage
            idx = np.nonzero(mask & ((copies == 1) if zero == 0 else True))[0]
            if not len(idx):
                continue
            for rec in RECOMPUTE:
                lay = Layout({d.name: c[d.name][idx] for d in DIMENSIONS}, mbs=c["mbs"][idx],
                             schedule="1f1b" if sched == "none" else sched, v=v, zero=zero,
                             recompute=rec, **given)
                est, t, choice = _best_of_orders(shape, cluster, train, eff, lay, seconds,
                                                 orders)
                considered += len(idx)
                scored.append((idx, np.broadcast_to(t, idx.shape),
                               np.broadcast_to(est.memory_total, idx.shape),
                               {"schedule": lay.schedule, "v": v, "zero": zero,
                                "recompute": rec, "order": np.broadcast_to(choice, idx.shape)}))
    limit = cluster.gpu.hbm_bytes * train.mem_limit_frac
    times = np.concatenate([s[1] for s in scored])
    mems = np.concatenate([s[2] for s in scored])
    group = np.concatenate([np.full(len(s[0]), k) for k, s in enumerate(scored)])
    rows = np.concatenate([s[0] for s in scored])
    fits = mems <= limit

    starts = np.cumsum([0] + [len(s[0]) for s in scored])

    def layout_at(j: int) -> Layout:
        r, g = rows[j], scored[group[j]][3]
        return Layout({d.name: int(c[d.name][r]) for d in DIMENSIONS}, mbs=int(c["mbs"][r]),
                      schedule=g["schedule"], v=g["v"], zero=g["zero"],
                      recompute=g["recompute"], **given,
                      order=orders[int(g["order"][j - starts[group[j]]])])

    if not fits.any():
        j = int(np.argmin(mems))
        best = evaluate(shape, cluster, train, layout_at(j), eff, simulate=True)
        return SearchResult([], considered, 0, closest=best)
    best_by = _best_by(c, rows, group, scored, times, fits)
    # re-rank the closed form's best 2 x top through the simulator, and more while fewer
    # than `top` of them fit once simulated (its peak activations can exceed the closed
    # form's: DualPipe's)
    n_sim = simulate_top or 2 * top
    order = np.nonzero(fits)[0][np.argsort(times[fits], kind="stable")]
    sims = []
    for j in order[:10 * n_sim]:
        try:
            lay = best_order(shape, cluster, train, eff, layout_at(int(j)))
            sims.append(evaluate(shape, cluster, train, lay, eff, simulate=True))
        except ValueError:  # a layout the simulator cannot build: never shown, the next
            continue  # one is (the search asks every rule a build does: registry.py)
        if len(sims) >= n_sim and sum(bool(s.fits) for s in sims) >= min(top, n_sim):
            break
    if not sims:
        raise PlanError("every best-ranked layout failed to build its pipeline schedule; "
                        "give one with --layout")
    sims = [s for s in sims if bool(s.fits)] or sims
    sims.sort(key=lambda s: float(seconds(s)))
    return SearchResult(sims[:top], considered, int(fits.sum()), extra={"best_by": best_by})


def _best_by(c: dict[str, np.ndarray], rows: np.ndarray, group: np.ndarray, scored: list,
             times: np.ndarray, fits: np.ndarray) -> dict[str, float | None]:
    """The best closed-form step time under each single constraint (for explain.py's
    'which rule of thumb held'); None when no layout fits under it."""
    meta = [s[3] for s in scored]
    zero = np.array([meta[g]["zero"] for g in group])
    rec = np.array([meta[g]["recompute"] for g in group])
    out: dict[str, float | None] = {"best": float(times[fits].min()) if fits.any() else None}

    def best(mask: np.ndarray) -> float | None:
        mk = mask & fits
        return float(times[mk].min()) if mk.any() else None

    for tp in np.unique(c["tp"]):
        out[f"tp={tp}"] = best(c["tp"][rows] == tp)
    for d in DIMENSIONS:  # with and without each dimension
        out[f"{d.name}=1"] = best(c[d.name][rows] == 1)
        out[f"{d.name}>1"] = best(c[d.name][rows] > 1)
    for z in range(4):
        out[f"zero={z}"] = best(zero == z)
    for r in RECOMPUTE:
        out[f"recompute={r}"] = best(rec == r)
    return out


def search_orders(shape: Shape, cluster: Cluster) -> list[tuple[str, ...]]:
    """The mesh orders the vectorised pass scores: the default, and each other dim
    innermost (the rest in the default's order), on more than one node of a dense model
    (the orders of one node place every group alike; expert parallelism's groups assume
    the default: comm.price.order_strides)."""
    if shape.moe or cluster.n_gpus <= cluster.gpus_per_node:
        return [DEFAULT_ORDER]
    return [DEFAULT_ORDER] + [(d, *(x for x in DEFAULT_ORDER if x != d))
                              for d in DEFAULT_ORDER[1:]]


def _best_of_orders(shape: Shape, cluster: Cluster, train: Training, eff: Efficiency,
                    lay: Layout, seconds: Callable[[Estimate], Any],
                    orders: list[tuple[str, ...]]) -> tuple[Estimate, np.ndarray, np.ndarray]:
    """(the default order's estimate, each layout's best seconds over `orders`, the index
    of its order: the first on a tie, so the default wherever no order is faster)."""
    est = evaluate(shape, cluster, train, lay, eff)
    best = np.asarray(seconds(est), dtype=float)
    choice = np.zeros(np.shape(best), dtype=int)
    # a dimension laid over the replicas is modelled in the default order only: those
    # layouts keep it (scored here at laid sizes 1, never chosen)
    laid = np.logical_or.reduce([np.asarray(size) > 1 for size in lay.laid().values()])
    flat = {**lay.sizes, **{name: 1 for name in lay.laid()}}
    for k, order in enumerate(orders[1:], 1):
        t = np.asarray(seconds(evaluate(shape, cluster, train,
                                        replace(lay, sizes=flat, order=order), eff)),
                       dtype=float)
        t = np.where(laid, np.inf, t)
        choice = np.where(t < best, k, choice)
        best = np.minimum(best, t)
    return est, best, choice


def distinct_orders(lay: Layout, gpus_per_node: int) -> list[tuple[str, ...]]:
    """The mesh orders (innermost first) that place `lay`'s groups differently, the
    default first: two orders whose dims of size > 1 have the same strides build the same
    groups. Only the default for a dimension laid over the replicas (expert parallelism:
    comm.price.order_strides) or one node."""
    sizes = lay.sizes
    if any(size > 1 for size in lay.laid().values()) or lay.world <= gpus_per_node:
        return [DEFAULT_ORDER]
    seen, out = set(), []
    for order in [DEFAULT_ORDER, *itertools.permutations(DEFAULT_ORDER)]:
        stride, key = 1, []
        for d in order:
            if sizes[d] > 1:
                key.append((d, stride))
            stride *= sizes[d]
        if tuple(sorted(key)) not in seen:
            seen.add(tuple(sorted(key)))
            out.append(tuple(order))
    return out


def best_order(shape: Shape, cluster: Cluster, train: Training, eff: Efficiency,
               lay: Layout) -> Layout:
    """`lay` under the mesh order with the shortest step (closed forms; the default on a
    tie): which dims share a node's fast links is a choice the search makes too."""
    orders = distinct_orders(lay, cluster.gpus_per_node)
    if len(orders) == 1:
        return lay
    cands = [replace(lay, order=o) for o in orders]
    steps = [float(evaluate(shape, cluster, train, c, eff).step_time) for c in cands]
    return cands[min(range(len(cands)), key=lambda k: (steps[k], k))]


def order_notes(best: Estimate) -> list[str]:
    """What `plait plan` says of the recommended layout's mesh order when it is not the
    default (the default needs no word: tp inside a node)."""
    order = tuple(best.layout.order)
    if order == DEFAULT_ORDER:
        return []
    crossing = [c.dim for c in best.collectives if not bool(c.intra)]
    return [f"Mesh order recommended: {','.join(order)} (innermost first; parallel.order, "
            f"which --emit-config writes): it beats the default {','.join(DEFAULT_ORDER)} for "
            "this layout"
            + (f"; across nodes: {', '.join(dict.fromkeys(crossing))}" if crossing else "")
            + "."]
