"""Alpha-beta cost of collectives (Hockney's model; ring and tree algorithms).

Every function takes numpy arrays or scalars (the search evaluates thousands of layouts
at once). Sizes are the *full* message in bytes: the tensor all-reduced, the gathered
result of an all-gather, the input of a reduce-scatter, all a rank sends in an all-to-all.

  ring all-reduce       2(n-1) alpha + 2(n-1)/n * S/B      (Patarasuk & Yuan 2009)
  tree all-reduce       2 log2(n) alpha + 2 S/B            (NCCL double binary tree, pipelined)
  all-gather, reduce-scatter (ring)   (n-1) alpha + (n-1)/n * S/B
  all-to-all (pairwise) (n-1) alpha + (n-1)/n * S/B
  p2p                   alpha + S/B
B is the achieved bandwidth: the link's datasheet bandwidth times the fitted
`link_efficiency` (plait/plan/calibration.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.dims import DEFAULT_ORDER, LAID, REPLICA_AXES
from plait.plan.hardware import GPU

Num = Any  # float or numpy array


def intra_node(stride: Num, size: Num, gpus_per_node: int) -> Num:
    """Whether a group of `size` ranks spaced `stride` apart stays inside one node (ranks
    are numbered node by node, in the mesh order: `order_strides`)."""
    return np.asarray(stride) * np.asarray(size) <= gpus_per_node


def order_strides(order: tuple[str, ...], sizes: dict[str, Num]) -> dict[str, Num]:
    """The rank distance between neighbours along each axis of the mesh `order` (innermost
    first, parallel.order), from every dimension's `sizes` by record name: with
    `intra_node`, which groups cross nodes. A dimension laid over the replicas (expert
    parallel) has its groups modelled in the default order only."""
    if sorted(order) != sorted(DEFAULT_ORDER):
        raise ValueError(f"order {','.join(order)}: name each of {', '.join(DEFAULT_ORDER)} "
                         "once")
    if tuple(order) != DEFAULT_ORDER and any(np.any(np.asarray(sizes[d.name]) > 1)
                                             for d in LAID):
        laid = " and ".join(f"{d.title}'s" for d in LAID)
        raise ValueError(f"a mesh order other than {','.join(DEFAULT_ORDER)} is modelled for "
                         f"dense layouts only ({laid} groups assume the default)")
    strides, stride = {}, 1.0
    for d in order:
        strides[d], stride = stride, stride * sizes[d]
    return strides


def replica_block_span(order: tuple[str, ...], sizes: dict[str, Num],
                       strides: dict[str, Num], block: Num) -> Num:
    """Ranks from the first to past the last of `block` consecutive replica positions (the
    replica ranks in rank order: the replica axes of the mesh `order`, innermost first,
    `strides` from `order_strides`): hybrid sharding's shard group (block = its ranks) or
    the whole replica group (block = the replicas; a copies group spans it too). Inside
    one node when at most gpus_per_node."""
    rem, span = np.asarray(block, dtype=float), np.asarray(1.0)
    for name in (d for d in order if d in REPLICA_AXES):
        take = np.minimum(rem, np.asarray(sizes[name], dtype=float))  # its positions covered
        span = np.where(take > 1, strides[name] * take, span)
        rem = rem / take
    return span


def rails(n: Num, span: Num, gpus_per_node: int, nics_per_node: int = 0) -> Num:
    """Ranks of a group of `n` ranks over `span` consecutive ranks in each node it
    touches (at least 1): a node-spanning group's ring collectives cross each node
    boundary once a channel, and NCCL spreads its channels over the NICs of those ranks
    (one NIC per GPU: DGX A100 and H100's rail-optimised fabrics, NVIDIA's DGX
    SuperPOD reference architectures), so the group's bus bandwidth across nodes is that
    many NICs', at most the node's (`nics_per_node`; 0: one a GPU)."""
    span = np.maximum(np.asarray(span, dtype=float), 1.0)
    per_node = np.asarray(n, dtype=float) * gpus_per_node / span
    return np.clip(per_node, 1.0, nics_per_node or gpus_per_node)


def link(gpu: GPU, intra: Num, efficiency: float, nics: Num = 1.0) -> tuple[Num, Num]:
    """(bandwidth bytes/s, latency s) of the slowest link a group uses; across nodes a
    ring collective of a group with `nics` ranks in each node (`rails`) moves over that
    many NICs, at most the NVLink ring inside the node."""
    across = np.minimum(gpu.internode_bw * np.asarray(nics, dtype=float), gpu.nvlink_bw)
    bw = np.where(intra, gpu.nvlink_bw, across) * efficiency
    alpha = np.where(intra, gpu.nvlink_alpha, gpu.internode_alpha)
    return bw, alpha


def all_reduce(size: Num, n: Num, bw: Num, alpha: Num) -> tuple[Num, Num]:
    """(time, use_tree): the faster of ring and tree."""
    n = np.asarray(n, dtype=float)
    ring = 2 * (n - 1) * alpha + 2 * (n - 1) / n * size / bw
    tree = 2 * np.log2(np.maximum(n, 1)) * alpha + 2 * size / bw
    t = np.where(n > 1, np.minimum(ring, tree), 0.0)
    return t, (tree < ring) & (n > 1)


def gather_like(size: Num, n: Num, bw: Num, alpha: Num) -> Num:
    """All-gather, reduce-scatter or all-to-all: (n-1) steps of S/n each."""
    n = np.asarray(n, dtype=float)
    return np.where(n > 1, (n - 1) * alpha + (n - 1) / n * size / bw, 0.0)


def p2p(size: Num, bw: Num, alpha: Num) -> Num:
    return alpha + size / bw


@dataclass
class Collective:
    """One kind of collective a rank issues per step (fields may be arrays in a search)."""

    dim: str  # a dimension's record name, a laid group's ("edp"), or "world"
    op: str  # all-reduce, all-gather, reduce-scatter, all-to-all, p2p
    size: Num  # bytes per call (see the module docstring)
    count: Num  # calls per step on the most loaded rank
    group: Num  # ranks in the group
    intra: Num  # True: NVLink; False: inter-node
    time_each: Num  # seconds per call
    exposed: Num  # seconds per step not hidden behind compute
    overlap: str  # what it overlaps with, in words
    algorithm: str = "ring"
    # of `count`, the calls per step the issuing rank waits on at once (a synchronous call,
    # or an async one waited before any compute runs beside it): those pay a measured
    # profile's collective sync (plait/plan/comm/sync.py's sync_seconds). None: every call
    blocking: Num = None

    @property
    def total(self) -> Num:
        return self.count * self.time_each
