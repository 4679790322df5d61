"""The parallel dimensions, one record each (record.py: `Dimension`), in the mesh's
default order, innermost first: tensor parallel stays inside a node (Stanford CS336,
lecture 8 (parallelism); Llama 3 used the same order). Expert parallel and hybrid
sharding's replica groups come last: they are not axes of the rank grid but laid over the
replica axes.

Adding a dimension is its strategy module (plait/parallel/), its record here and their
tests; the mesh, the config checks and flags, the training loop's reductions, the
checkpoint writer and the timeline read the records.
"""

from __future__ import annotations

from collections.abc import Mapping

from plait.dims import cp, dp, dp_replicate, ep, pp, tp
from plait.dims.record import CHECKPOINT_ROLES, SPLITS, Dimension, Setting

DIMENSIONS: tuple[Dimension, ...] = (tp.DIMENSION, cp.DIMENSION, pp.DIMENSION,
                                     dp.DIMENSION, ep.DIMENSION, dp_replicate.DIMENSION)
BY_NAME = {d.name: d for d in DIMENSIONS}
AXES = tuple(d for d in DIMENSIONS if d.axis)  # the rank grid's axes
DEFAULT_ORDER = tuple(d.name for d in AXES)  # innermost first
DIMS = tuple(reversed(DEFAULT_ORDER))  # outermost first: how layouts are written
LAID = tuple(d for d in DIMENSIONS if not d.axis)  # laid over the replica axes
# the axes whose ranks hold parameter copies, in the order written; their product group
# ("dp_cp") is where gradients are summed and laid dimensions cut their groups
REPLICA_AXES = tuple(n for n in DIMS if BY_NAME[n].replicates_params)
REPLICAS = "_".join(REPLICA_AXES)
# the logged loss is summed over these in this order (a float sum's order is part of its
# value): the stages' partial sums, then the sequence's slices, then the replicas
LOSS_SUMMED = tuple(d.name for split in ("layers", "sequence", "batch") for d in AXES
                    if d.sums_loss and d.splits == split)


a2a_degree = cp.a2a_degree  # context parallel's hierarchical all-to-all group


def replica_group(sizes: Mapping[str, int]) -> str:
    """The name of the group over which the copies of a parameter sum their gradients and
    ZeRO shards them, for axis `sizes` by name: the data-parallel axis alone, or the
    replica axes' product group (REPLICAS) once another of them (context parallel) splits
    ranks too. The mesh names its groups by it and the planner its collectives, so the
    ledger's rows and the planner's match by name."""
    first, *others = REPLICA_AXES
    return REPLICAS if any(sizes[d] > 1 for d in others) else first


def problems(cfg) -> list[str]:
    """Every dimension's own checks, innermost first."""
    return [msg for d in DIMENSIONS for msg in d.problems(cfg)]


__all__ = ["AXES", "BY_NAME", "CHECKPOINT_ROLES", "DEFAULT_ORDER", "DIMENSIONS", "DIMS",
           "LAID", "LOSS_SUMMED", "REPLICAS", "REPLICA_AXES", "SPLITS", "Dimension",
           "Setting", "a2a_degree", "problems", "replica_group"]
