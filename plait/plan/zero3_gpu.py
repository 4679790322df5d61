"""What a ZeRO-3 (FSDP) step pays on a GPU beyond its collectives' wire time, priced with
the published GPU numbers (plait/plan/gpu_data.py) only: a measured CPU profile and the
fitted constants have these inside what they measured or fitted.

Copies (`copy_bytes`, HBM bytes per step on one rank; PyTorch FSDP2 issues an all-gather as
a copy-in, the collective and a copy-out, pytorch/pytorch PR #117950, and a reduce-scatter
as a copy-in of the unsharded gradients into one flat buffer, the collective and a copy of
the reduced shard into the sharded gradient, `foreach_reduce`):

  all-gather copy-in    each gather reads the rank's fp32 shard (the master weights) and
                        writes it cast to the gathered dtype: G / n (4 + p) bytes
  all-gather copy-out   reads the gathered buffer and writes each parameter's unsharded
                        tensor: 2 G p bytes
  reduce-scatter in     reads the unsharded gradient (the compute dtype, p) and writes it in
                        the reduce dtype (g; 4 where the reduction runs in fp32, torchtitan's
                        default `mixed_precision_reduce = "float32"`): k U (p + g)
  reduce-scatter out    divides the reduced shard (read + write) and adds it into the fp32
                        sharded gradient (read g, write 4): k U / n (3 g + 4)

with G the parameters gathered per step (plait/plan/comm/zero.py), U the rank's
parameters, n the shard group, k the reduce-scatter rounds. Each is a streaming kernel
over the achievable HBM bandwidth (plait/plan/memory_bound.py's), added to the step: the
copies run beside compute and take its bandwidth.

Exposed ends (`end_collectives`): the step's first all-gather, of the first unit (the
embedding: plait's units, plait/parallel/zero_units.py), has no earlier compute to hide
behind (FSDP prefetches the next unit during a forward, never the first), and the last
unit's reduce-scatter (the embedding's gradient, after the last backward) is waited on by
the optimizer step. Both are on the critical path once a step (every micro-batch's first
gather under gradient accumulation hides behind the previous micro-batch: not counted).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from plait.plan import memory, memory_bound
from plait.plan.basis import Basis, Layout, Training
from plait.plan.comm import price
from plait.plan.comm.step import zero_group
from plait.plan.comm.zero import zero_reduce_scatters
from plait.plan.compute import Efficiency
from plait.plan.hardware import Cluster

Num = Any
# the step-time term of ZeRO-3's copy kernels
COPIES_TERM = "zero-3 copies"
MASTER_BYTES = 4  # the fp32 shard FSDP's copy-in reads (the master weights)


def applies(lay: Layout, eff: Efficiency) -> bool:
    """ZeRO-3 priced with the published GPU numbers (not a measured profile's runtime
    collectives, which price plait's own units)."""
    return lay.zero == 3 and memory_bound.priced(eff) and not eff.runtime_comm


def copy_bytes(train: Training, params: Num, gathered: Num, gathered_bytes: Num, n: Num,
               rounds: Num) -> Num:
    """HBM bytes per step of ZeRO-3's copy kernels on a rank holding `params` (unsharded
    count), gathering `gathered` parameters in `gathered_bytes` bytes per step, sharded
    `n` ways, reduce-scattering `rounds` times (the module docstring); 0 where n is 1."""
    p, g, _ = memory.state_bytes(train.precision, train.optimizer)
    n = np.asarray(n, dtype=float)
    copy_in = gathered / n * MASTER_BYTES + gathered_bytes / n
    copy_out = 2.0 * gathered_bytes
    rs_in = rounds * params * (p + g)
    rs_out = rounds * params / n * (3 * g + MASTER_BYTES)
    return np.where(n > 1, copy_in + copy_out + rs_in + rs_out, 0.0)


def copy_seconds(cluster: Cluster, train: Training, lay: Layout, eff: Efficiency, b: Basis,
                 params: Num, gathered: Num, gathered_bytes: Num, experts: bool = False
                 ) -> Num:
    """Seconds per step of ZeRO-3's copy kernels (`copy_bytes` over the achievable HBM
    bandwidth); `experts`: the routed experts' shard group."""
    _, n, _, _ = zero_group(cluster, lay, b, experts)
    moved = copy_bytes(train, params, gathered, gathered_bytes, n,
                       zero_reduce_scatters(lay, b))
    return moved / memory_bound.achievable_bw(cluster.gpu, eff)


def end_collectives(cluster: Cluster, train: Training, lay: Layout, eff: Efficiency,
                    b: Basis, first_unit: Num, colls: list[price.Collective]) -> Num:
    """Exposed seconds of the step's first all-gather and last reduce-scatter, each of
    `first_unit` parameters (the embedding's on this rank) over the shard group; appends
    both to `colls`."""
    p, g, _ = memory.state_bytes(train.precision, train.optimizer)
    dim, n, intra, nics = zero_group(cluster, lay, b)
    bw, al = price.link(cluster.gpu, intra, eff.link_efficiency, nics)
    total = 0.0
    for op, size, how in (("all-gather (first unit, params)", first_unit * p,
                           "none: before the first forward"),
                          ("reduce-scatter (last unit, grads)", first_unit * g,
                           "none: after the last backward")):
        t = price.gather_like(size, n, bw, al)
        total = total + t
        if np.any(n > 1):
            colls.append(price.Collective(dim, op, size, np.where(n > 1, 1.0, 0.0), n, intra,
                                         t, t, how, blocking=np.where(n > 1, 1.0, 0.0)))
    return total
