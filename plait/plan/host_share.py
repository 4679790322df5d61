"""Ranks that share a host's CPU cores: the step time when a host runs more runnable
work than it has cores (a CPU cluster, or emulated nodes on one machine).

The planner's step time assumes each rank owns its processor. On a CPU host of C cores
running R ranks (plus B runnable scheduling entities of other work) that holds only while
R + B <= C. Past it, the model:

- Each rank's step is D seconds of CPU work (compute, the optimizer, and collectives on
  the host's own loopback: their copies are CPU work) and W seconds of waiting: the
  pipeline bubble and the exposed time of collectives over links between nodes (a wire
  transfer needs no core). Both are the planner's own dedicated-core terms.
- A waiting rank holds no core: gloo waits without spinning (measured here: a rank blocked
  2 s in an all-reduce used 5 ms of CPU).
- The scheduler shares the cores equally among the runnable scheduling entities
  (processor sharing, as Linux's CFS does for entities of equal weight): with n runnable,
  each progresses at s = min(1, C / n) of a core. An entity is a task, or with autogroup
  (sched_autogroup_enabled, the default of many distributions) a session: torchrun starts
  each rank in a session of its own, so a rank is one entity either way, and B counts
  the other work's runnable sessions, not its tasks.
- Mean field: a rank is runnable a fraction (T - W) / T of a step T, so n = B + R (T - W)
  / T, and its CPU work takes D = s (T - W). Eliminating s gives the step time T as the
  larger root of
        C T^2 - (C W + B D + R D) T + R D W = 0,
  and T >= D + W (a rank never runs faster than a whole core).

- The link between nodes (the planner's exposed inter-node communication assumes a
  node's ranks all send at once, each at 1/k of the node's link for k ranks a node):
  ranks time-sliced on shared cores drift apart (a node's ranks are in different groups
  of the dimension that crosses), so a rank sends alone at the whole link except while
  another of its node's ranks sends too, which (mean field again) it does for the
  fraction W / T of the step it spends on the link: W = (W_sync / k)(1 + (k - 1) W / T),
  at most W_sync (`link_wait`). The two mean-field equations are solved together
  (`shared_cores_step`), so the TERM line may be negative: drifting ranks share a link
  better than ranks in step.

- Node ranks in step: where a node's ranks are one group of a dimension with collectives
  in every layer (tensor, context, expert parallel: the communication model's
  PER_LAYER_DIMS; inside the node: `in_step`), they wait for each other at every layer
  and reach a link wait at the same point of the step (dp's gradient
  all-reduce after the backward) together: then the link wait is every rank's at once,
  the planner's in-step wait, and no rank of the host computes during it, T = W_link +
  the shared step of the rest. Measured on the emulated cluster (tp inside, dp across):
  given the measured CPU, the drifting model read 132 ms against 181 measured, this one
  166 (docs/planner_cpu.md).
- Collectives' CPU, where a profile measured it (comm_cpu: every thread of a rank per
  call, the caller's and gloo's): a call's CPU is D and the rest of its exposed time W,
  on the link or waiting for the peer (`comm_split`); without it, as in the first item.

Its limits: with B = 0 it is max(D + W, R D / C), the two bounds a work-conserving
scheduler meets when one rank's waits are filled by another's work (exact for ranks
that take turns; a lower bound when their waits coincide); with B > 0 the other work
takes its share of the cores a waiting rank frees. One rank alone (R = 1, W = 0) on a
host with B other tasks: T = D (B + 1) / C. Nothing else of the host is modelled (caches
and memory bandwidth shared, the scheduler's latency, SMT).

Applies only where the hardware says how many cores a host has (`plait calibrate`
records them; GPU presets leave it 0: a GPU's host does not run its compute) and
R + B > C. R is the ranks per host: `--ranks-per-host`, by default the ranks of a node
(each node its own host; emulated nodes on one machine share it).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from plait.plan.comm import EXPOSED_TERMS, PER_LAYER_DIMS
from plait.plan.hardware import Cluster

Num = Any
TERM = "host cores shared"  # the step-time breakdown's line for it
# the step-time lines a rank waits in: the bubble and the sync waits (None), and each
# collective's exposed time (the communication model's lines, with the dimensions whose
# collectives they are)
WAIT_TERMS: dict[str, tuple[str, ...] | None] = {
    "pipeline bubble + p2p": None, "collective sync (waits)": None, **EXPOSED_TERMS}


def host_ranks(cluster: Cluster) -> int:
    """Ranks that share one host's cores."""
    return min(cluster.ranks_per_host or cluster.gpus_per_node, cluster.n_gpus)


def applies(cluster: Cluster) -> bool:
    """Whether the host has fewer cores than runnable entities (the model changes the step)."""
    cores = cluster.gpu.host_cores
    return cores > 0 and host_ranks(cluster) + cluster.host_load > cores


def shared_step(cpu: Num, wait: Num, cores: float, ranks: int, load: float = 0.0) -> Num:
    """Step time of R ranks each doing `cpu` seconds of work and `wait` seconds of
    waiting per step on a host of `cores` cores with `load` other runnable entities (the
    module's equation; arrays broadcast)."""
    d, w = np.asarray(cpu, dtype=float), np.asarray(wait, dtype=float)
    a = cores * w + load * d + ranks * d
    root = (a + np.sqrt(np.maximum(a * a - 4 * cores * ranks * d * w, 0.0))) / (2 * cores)
    return np.maximum(d + w, root)


def waits(time: dict[str, Num], colls: list) -> tuple[Num, Num]:
    """(bubble, link): seconds of a step a rank waits without a core, the pipeline
    bubble and each dimension's exposed communication where its groups cross nodes."""
    bubble, link = 0.0, 0.0
    for term, dims in WAIT_TERMS.items():
        if term not in time:
            continue
        if dims is None:
            bubble = bubble + time[term]
            continue
        crossing = [~np.asarray(c.intra, dtype=bool) for c in colls if c.dim in dims]
        if crossing:
            link = link + np.where(np.logical_or.reduce(np.broadcast_arrays(*crossing)),
                                   time[term], 0.0)
    return bubble, link


def link_wait(link_sync: Num, node_ranks: int, step: Num) -> Num:
    """A rank's wait on its node's link when the node's ranks do not send in step.
    `link_sync` is the planner's: every rank of the node sending at once, each at
    1/node_ranks of the link. Time-sliced ranks drift apart (a node's ranks are in
    different groups), so each sends alone at the full link, and shares it with another
    rank of the node for the fraction of time that one is on the link, w / step (mean
    field, as for the cores): w = link_sync / k * (1 + (k - 1) w / step), at most
    link_sync."""
    k = float(node_ranks)
    alone = np.asarray(link_sync, dtype=float) / k
    free = np.maximum(1.0 - (k - 1) * alone / np.maximum(step, 1e-30), 1e-12)
    return np.minimum(link_sync, alone / free)


def shared_cores_step(cpu: Num, bubble: Num, link_sync: Num, cores: float, ranks: int,
                      load: float, node_ranks: int) -> Num:
    """The step on shared cores with the waits of `link_wait`: the fixed point of the two
    mean-field equations (each step's waits set the share of the cores, the step sets the
    share of the link), by iteration from the planner's in-step link."""
    link = np.asarray(link_sync, dtype=float)
    for _ in range(50):
        step = shared_step(cpu, bubble + link, cores, ranks, load)
        link = link_wait(link_sync, node_ranks, step)
    return shared_step(cpu, bubble + link, cores, ranks, load)


def comm_split(time: dict[str, Num], colls: list, cpu_call: float, cpu_byte: float
               ) -> tuple[Num, Num, Num]:
    """(CPU, link wait, local wait) of a step's collectives where their CPU is measured
    (a profile's comm_cpu): every call's CPU (count x (per call + per byte x size), its
    threads' work, hidden calls too) needs a core; of each dimension's exposed time the
    rest is waiting, on the link where the dimension's groups cross nodes (`waits`),
    else for the peer."""
    cpu, link, local = 0.0, 0.0, 0.0
    for term, dims in WAIT_TERMS.items():
        if dims is None or term not in time:
            continue
        mine = [c for c in colls if c.dim in dims]
        used = sum((np.where(np.asarray(c.group) > 1, c.count, 0.0)
                    * (cpu_call + cpu_byte * np.asarray(c.size, dtype=float)) for c in mine),
                   0.0)
        crossing = [~np.asarray(c.intra, dtype=bool) for c in mine]
        crosses = np.logical_or.reduce(np.broadcast_arrays(*crossing)) if crossing else False
        rest = np.maximum(time[term] - used, 0.0)
        cpu, link = cpu + used, link + np.where(crosses, rest, 0.0)
        local = local + np.where(crosses, 0.0, rest)
    return cpu, link, local


def in_step(colls: list, node_ranks: int) -> Num:
    """Whether a node's ranks run in step: its ranks are one group of the per-layer
    dimensions inside the node (their group sizes, where inside, multiply to a node's
    ranks or more). Then a wait on the link at the same point of the step (dp's gradient
    all-reduce after the backward) is every rank's at once."""
    span = {}
    for c in colls:
        if c.dim in PER_LAYER_DIMS:  # they leave the layers (and the step) together
            size = np.where(np.asarray(c.intra, dtype=bool) & (np.asarray(c.count) > 0),
                            np.asarray(c.group, dtype=float), 1.0)
            span[c.dim] = np.maximum(span.get(c.dim, 1.0), size)
    covered = np.prod(np.broadcast_arrays(*span.values()), axis=0) if span else 1.0
    return (np.asarray(covered) >= node_ranks) & (node_ranks > 1)


def step_on_shared_cores(cpu: Num, bubble: Num, link: Num, cores: float, ranks: int,
                         load: float, node_ranks: int, together: Num) -> Num:
    """The step of `cpu` seconds of work, `bubble` of waiting and `link` on the links
    between nodes: where `together` (node ranks in step, `in_step`) they wait on the link
    all at once, each at its share of it (the planner's in-step wait), while no rank of
    the host computes; else they drift apart (`shared_cores_step`)."""
    args = (cores, ranks, load, node_ranks)
    return np.where(together, link + shared_cores_step(cpu, bubble, 0.0, *args),
                    shared_cores_step(cpu, bubble, link, *args))


def _on_shared_cores(cluster: Cluster, colls: list, cpu: Num, bubble: Num, link: Num) -> Num:
    return step_on_shared_cores(cpu, bubble, link, cluster.gpu.host_cores,
                                host_ranks(cluster), cluster.host_load, cluster.gpus_per_node,
                                in_step(colls, cluster.gpus_per_node))


def work_and_waits(time: dict[str, Num], colls: list, step: Num, cpu_call: float = 0.0,
                   cpu_byte: float = 0.0) -> tuple[Num, Num, Num]:
    """(CPU work, bubble, link) of a rank's dedicated-core `step`, as `apply` splits it:
    the waits of `waits`, and with the collectives' CPU measured (`comm_split`) a
    collective's CPU as work, the rest of its exposed time as waiting."""
    bubble, link = waits(time, colls)
    bubble = np.minimum(bubble, step)
    link = np.minimum(link, step - bubble)
    cpu = step - bubble - link
    if cpu_call or cpu_byte:
        used, link, local = comm_split(time, colls, cpu_call, cpu_byte)
        exposed = sum(time.get(term, 0.0) for term, dims in WAIT_TERMS.items() if dims)
        cpu, bubble = np.maximum(step - bubble - exposed, 0.0) + used, bubble + local
    return cpu, bubble, link


def apply(cluster: Cluster, time: dict[str, Num], colls: list, step: Num,
          cpu_call: float = 0.0, cpu_byte: float = 0.0) -> Num:
    """The step time on shared cores; adds the difference to `time` as TERM. Unchanged
    (and `time` too) where the model does not apply. With the collectives' CPU measured
    (`cpu_call`, `cpu_byte`: a profile's comm_cpu) a collective's CPU is work and the
    rest of its exposed time a wait (`comm_split`); without, a collective inside a node
    is work, one over a link between nodes a wait."""
    if not applies(cluster):
        return step
    cpu, bubble, link = work_and_waits(time, colls, step, cpu_call, cpu_byte)
    shared = _on_shared_cores(cluster, colls, cpu, bubble, link)
    time[TERM] = shared - step
    return shared


HIDDEN_TERM = "hidden comm CPU"  # the step-time breakdown's line for hidden_comm_cpu


def hidden_comm_cpu(cluster: Cluster, colls: list, cpu_call: float, cpu_byte: float) -> Num:
    """CPU seconds a step of the collectives a rank does not wait on (`Collective.blocking`
    below the count: ZeRO's prefetched gathers, its reduce-scatters behind the backward)
    where the host's ranks hold every core and nothing else runs (R = C: past it `apply`
    counts them as work): gloo's threads copy and reduce on the cores the ranks compute
    on, so the compute that hides the call is stretched by its CPU (a profile's
    comm_cpu). 0 where a core is free, or the CPU is not measured (the GPU presets)."""
    cores = cluster.gpu.host_cores
    if not (cpu_call or cpu_byte) or cores <= 0 or applies(cluster) \
            or host_ranks(cluster) < cores:
        return 0.0
    total = 0.0
    for c in colls:
        if c.blocking is not None and not (c.dim == "pp" and c.op.startswith("send")):
            hidden = np.where(np.asarray(c.group) > 1,
                              np.maximum(np.asarray(c.count) - c.blocking, 0.0), 0.0)
            total = total + hidden * (cpu_call + cpu_byte * np.asarray(c.size, dtype=float))
    return total


def note(cluster: Cluster) -> str | None:
    """One line for `plait plan`'s output when the model applies."""
    if not applies(cluster):
        return None
    load = f" and {cluster.host_load:g} other runnable entities" if cluster.host_load else ""
    return (f"Host cores shared: {host_ranks(cluster)} ranks{load} on {cluster.gpu.host_cores:g} "
            "cores per host: ranks are time-sliced, a waiting rank (the bubble, links between "
            f"nodes) frees its core (plait/plan/host_share.py); the step time's '{TERM}' "
            "line is the change against ranks with a core each, in step.")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--host-cores", type=float, metavar="C",
                       help="CPU cores of a host that runs its ranks' compute (default: "
                       "the --hardware profile's; 0 for GPU presets: not modelled)")
    group.add_argument("--ranks-per-host", type=int, metavar="R",
                       help="ranks sharing one host's cores (default: a node's, each node "
                       "its own host; emulated nodes on one machine: all of them)")
    group.add_argument("--host-load", type=float, default=0.0, metavar="B",
                       help="runnable scheduling entities of other work on each host "
                       "(tasks; with autogroup, sessions; default 0)")


def problems(args: argparse.Namespace) -> list[str]:
    out = []
    cores = getattr(args, "host_cores", None)
    if cores is not None and not (np.isfinite(cores) and cores >= 0):
        out.append(f"--host-cores {cores}: give a number of cores >= 0")
    rph = getattr(args, "ranks_per_host", None)
    if rph is not None and rph < 1:
        out.append(f"--ranks-per-host {rph} must be >= 1")
    load = getattr(args, "host_load", 0.0)
    if not (np.isfinite(load) and load >= 0):
        out.append(f"--host-load {load}: give a number of tasks >= 0")
    return out
