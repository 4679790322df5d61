"""Why the best layout wins, in words: the rules of thumb of
Stanford CS336, lecture 8 (parallelism), checked one by one.

1. Fit first: TP up to the node size, then PP or ZeRO-3 across nodes.
2. Then scale compute with DP; DP and PP consume batch size, TP does not.
3. Sharding pays only if the memory it saves is worth the communication and idle time.
"""

from __future__ import annotations

from plait.dims import REPLICA_AXES
from plait.plan.basis import SHARD_COPIES
from plait.plan.estimate import Estimate, Layout, Training
from plait.plan.hardware import GB, Cluster
from plait.plan.memory import state_bytes
from plait.plan.shape import Shape
from plait.plan.units import nbytes, params
from plait.schedule.registry import schedule_spec


def _pct(a: float, b: float) -> str:
    """How much slower a is than b, in words."""
    d = 100 * (a / b - 1)
    return "as fast (within 0.5 %)" if abs(d) < 0.5 else f"{d:.0f} % slower" if d > 0 \
        else f"{-d:.0f} % faster"


def dominant_term(est: Estimate) -> tuple[str, float]:
    k = max(est.memory, key=lambda k: float(est.memory[k]))
    return k, float(est.memory[k])


def why_no_fit(est: Estimate, cluster: Cluster, train: Training, searched: bool = True) -> str:
    """Why `est` (the smallest-memory layout of a search, or the one layout given) does
    not fit, and what to change; where it fits the whole device but not the usable
    fraction, that the headroom is what it lacks."""
    hbm = cluster.gpu.hbm_bytes
    limit = hbm * train.mem_limit_frac
    total = float(est.memory_total)
    term, val = dominant_term(est)
    what = (f"no layout fits: the smallest-memory layout ({est.layout.label()}, zero="
            f"{est.layout.zero}, recompute={est.layout.recompute}, attention="
            f"{est.layout.attention})" if searched else "this layout")
    text = (f"{what} needs {total / GB:.1f} GB per rank, {(total - limit) / GB:.1f} GB over "
            f"the {limit / GB:.1f} GB usable ({train.mem_limit_frac:.0%} of "
            f"{hbm / GB:.0f} GB); the largest term is {term} ({val / GB:.1f} GB).")
    if total <= hbm:
        return (text + f" It is within the device's {hbm / GB:.1f} GB: only the "
                f"{1 - train.mem_limit_frac:.0%} kept for the CUDA context, NCCL's buffers and "
                "the allocator's fragmentation is short, so a run may fit (--mem-limit "
                f"{min(1.0, total / hbm + 0.005):.2f} plans with that little headroom).")
    return text + " Add GPUs, a larger-memory GPU, or a smaller batch/sequence."


def _zero_ranks(lay: Layout) -> str:
    """The ranks ZeRO shards over, in words: the replicas, or hybrid sharding's shard
    group of them."""
    whole = f"{'*'.join(REPLICA_AXES)}={lay.replicas}"
    if lay.shard_copies == 1:
        return whole
    copies = ",".join(f"{name}={lay.sizes[name]}" for name in SHARD_COPIES)
    return (f"shard groups of {int(lay.zero_split)} of the {whole} replicas (hybrid sharding: "
            f"{copies} copies of each shard)")


def _hybrid_lines(lay: Layout, by: dict[str, float | None], t: float) -> list[str]:
    """Whether hybrid sharding pays: the best layout with and without copies of shards."""
    key = "+".join(SHARD_COPIES)
    alone, split = by.get(f"{key}=1"), by.get(f"{key}>1")
    if lay.shard_copies > 1:
        return [f"Hybrid sharding pays: ZeRO's collectives stay inside shard groups of "
                f"{int(lay.zero_split)} ranks and only the reduced gradient shards (1/"
                f"{int(lay.zero_split)} of the gradients) are all-reduced over the copies; "
                + ("no layout without it fits." if alone is None else
                   f"the best layout sharding over every replica is {_pct(alone, t)}.")]
    if lay.zero and split is not None:
        return [f"No hybrid sharding: ZeRO over every replica; the best layout with "
                f"{key}>1 is {_pct(split, t)}."]
    return []


def explain(best: Estimate, shape: Shape, cluster: Cluster, train: Training,
            best_by: dict[str, float | None] | None = None,
            runner_up: Estimate | None = None) -> list[str]:
    lay, gpn = best.layout, cluster.gpus_per_node
    by = best_by or {}
    # rule comparisons use the closed forms on both sides (the search's ranking numbers)
    t = by.get("best") or float(best.step_time)
    free_v = schedule_spec(lay.schedule).free_virtual_stages  # v worth naming (interleaved)
    lines = [f"Best: {lay.label()}, micro-batch {lay.mbs} x {int(best.microbatches)}, "
             f"schedule {lay.schedule}" + (f" (v={lay.v})" if free_v else "")
             + f", ZeRO-{lay.zero}, recompute {lay.recompute}: {float(best.step_time):.3f} s/step, "
             f"MFU {float(best.mfu):.1%}."]

    # 1. fit first
    pb, gb, kb = state_bytes(train.precision, train.optimizer)
    states = shape.num_params() * (pb + gb + kb)
    cap = cluster.gpu.hbm_bytes * train.mem_limit_frac
    lines.append(f"Fit first: model states are {nbytes(states)} "
                 f"({pb + gb + kb} B/param x {params(shape.num_params())} params) against "
                 f"{nbytes(cap)} usable per GPU, so they must be cut at least "
                 f"{max(1, -(-states // cap)):.0f} ways; this layout cuts them by tp*pp="
                 f"{lay.tp * lay.pp}" + (f" and ZeRO-{lay.zero} over {_zero_ranks(lay)}"
                                         if lay.zero else "") + ".")
    tp_rule = by.get(f"tp={gpn}")
    if lay.tp == gpn:
        lines.append(f"Rule 'TP up to the node size' held: tp={gpn} keeps TP collectives on "
                     "NVLink.")
    elif tp_rule is not None:
        lines.append(f"Rule 'TP up to the node size' did not hold: the best tp={gpn} layout is "
                     f"{_pct(tp_rule, t)}; at tp={lay.tp} the TP collectives cost more than "
                     "the memory they would free is worth.")
    else:
        lines.append(f"tp={gpn} was not possible or did not fit (heads {shape.heads}, KV heads "
                     f"{shape.kv_heads}).")
    pp1, ppn = by.get("pp=1"), by.get("pp>1")
    if lay.pp > 1:
        alt = (f"ZeRO-3/DP without PP would be {_pct(pp1, t)}" if pp1 is not None
               else "no layout without PP fits")
        lines.append(f"Across nodes PP={lay.pp} was chosen ({lay.schedule}, bubble "
                     f"{float(best.bubble_fraction):.1%}); {alt}.")
    elif ppn is not None:
        lines.append(f"No pipeline: the best PP layout is {_pct(ppn, t)}; "
                     + ("ZeRO-3 shards the states instead." if lay.zero == 3
                        else "the states fit without it."))

    # 2. scale with DP, batch consumed
    per_replica = train.global_batch // lay.dp
    replicas = " x ".join(f"{name}={lay.sizes[name]}" for name in REPLICA_AXES
                          if name == "dp" or lay.sizes[name] > 1)
    lines.append(f"Then DP: {replicas}"
                 + f" replicas; DP and PP consume batch: {train.global_batch} sequences / dp "
                 f"= {per_replica} per replica = {int(best.microbatches)} micro-batches of "
                 f"{lay.mbs}" + (f" for {lay.pp} stages" if lay.pp > 1 else "") + ".")

    # 3. does sharding pay?
    z0 = by.get("zero=0")
    if lay.zero:
        if z0 is None:
            lines.append(f"ZeRO-{lay.zero} is needed: no ZeRO-0 layout fits.")
        else:
            lines.append(f"ZeRO-{lay.zero} pays: the best ZeRO-0 layout is {_pct(z0, t)} "
                         "(sharding frees memory for a faster layout at little exposed "
                         "communication).")
    elif by.get("zero=1") is not None:
        lines.append(f"No ZeRO: replicated states fit and ZeRO-1 would be "
                     f"{_pct(by['zero=1'], t)} (its all-gather is exposed).")
    lines += _hybrid_lines(lay, by, t)
    rn = by.get("recompute=none")
    if lay.recompute != "none":
        lines.append(f"Recompute {lay.recompute}: " + (
            "no layout fits without recompute." if rn is None else
            f"the best layout without recompute is {_pct(rn, t)}."))
    if runner_up is not None:
        lines.append(_runner_up_line(best, runner_up))
    return lines


def _runner_up_line(best: Estimate, runner_up: Estimate) -> str:
    """The runner-up against the best, by the term it loses most on."""
    # a term one layout has and the other not (ZeRO-3's copies) counts as zero there
    d = {k: float(runner_up.time.get(k, 0.0)) - float(best.time.get(k, 0.0))
         for k in {**best.time, **runner_up.time}}
    k = max(d, key=lambda k: d[k])
    return (f"Runner-up {runner_up.layout.label()} ({runner_up.layout.schedule}, "
            f"ZeRO-{runner_up.layout.zero}, {runner_up.layout.recompute}) is "
            f"{_pct(float(runner_up.step_time), float(best.step_time))}, mostly {k} "
            f"({d[k]:+.3f} s).")
