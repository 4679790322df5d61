"""Where each parameter lives on the mesh: one record per parameter, set by the strategy
that shards it, read by everything that must know (the grad norm, full-state gathering,
and checkpoints: plait/checkpoint/pieces.py).

A parameter's record says
  * `splits`: the mesh dims that cut it along a tensor axis (tensor parallel: `tp` along
    axis 0 or 1), with the full length of that axis (padding beyond it is never used) and
    how many consecutive ranks of the dim hold the same slice (`replicas`, GQA's replicated
    KV heads);
  * `distinct_over`: mesh dims over which the ranks hold different tensors without a
    tensor split (pipeline stages: each pp rank holds other layers);
  * `norm_owner`: among ranks holding the same slice, whether this one counts it in the
    global grad norm.
  * `flat_shard`: set by ZeRO (plait/parallel/zero.py): this rank's tensor (tp-local where
    tp splits it) is a run of elements of a flat, padded buffer sharded over dp, and which
    elements each dp rank's optimizer shard holds (`FlatShard.on_rank`).
Every dim not named is a replica dim: the parameter is the same on all its ranks, and only
coordinate 0 counts it in the norm. `flat_shard` is not a split of the tensor (in stages 1
and 2 every dp rank computes with the whole of it), so it names no dim in `sharded_dims`;
ZeRO's own norm passes its dim to `counts_in_norm`. The optimizer's index of the shards by
name and state is `ZeroOptimizer.shard_index()` (plait/parallel/zero_index.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from plait.dims import LAID, REPLICA_AXES
from plait.mesh import ParallelMesh


@dataclass(frozen=True)
class Split:
    """The parameter is cut along tensor `axis` over mesh dim `dim`."""

    dim: str
    axis: int
    full_size: int  # the axis's length in the full (unpadded) parameter
    replicas: int = 1  # consecutive ranks of `dim` holding the same slice


@dataclass(frozen=True)
class FlatShard:
    """ZeRO over mesh dim `dim`: this rank's tensor, flattened, is elements [offset, offset +
    numel) of unit `unit`'s flat buffer, of which dp rank r holds [r*k, (r+1)*k) (k =
    `shard_numel`; the buffer is padded to a multiple of the dim's size)."""

    dim: str
    unit: int
    offset: int
    numel: int
    shard_numel: int

    def on_rank(self, r: int) -> tuple[int, int] | None:
        """(start, stop): the elements of the flattened tensor dp rank `r` holds; None if
        its shard holds none (padding is never part of a parameter)."""
        lo, hi = r * self.shard_numel, (r + 1) * self.shard_numel
        a, b = max(self.offset, lo), min(self.offset + self.numel, hi)
        return (a - self.offset, b - self.offset) if a < b else None


@dataclass(frozen=True)
class Placement:
    full_shape: tuple[int, ...]
    splits: tuple[Split, ...] = ()
    distinct_over: tuple[str, ...] = ()
    norm_owner: bool = True
    flat_shard: FlatShard | None = None

    @property
    def sharded_dims(self) -> tuple[str, ...]:
        """Dims over which this rank's tensor differs from its peers'."""
        return tuple(dict.fromkeys((*self.distinct_over, *(s.dim for s in self.splits))))

    def split_on(self, dim: str) -> Split | None:
        return next((s for s in self.splits if s.dim == dim), None)


@dataclass
class PlacementTable:
    """This rank's parameters' placements, keyed by the parameter object."""

    _records: dict[int, tuple[torch.Tensor, Placement]] = field(default_factory=dict)

    def of(self, p: torch.Tensor) -> Placement:
        """The record of `p`; a parameter no strategy placed is replicated everywhere."""
        hit = self._records.get(id(p))
        if hit is not None and hit[0] is p:
            return hit[1]
        return Placement(tuple(p.shape))

    def _set(self, p: torch.Tensor, placement: Placement) -> None:
        self._records[id(p)] = (p, placement)  # holding p keeps its id from being reused

    def mark_split(self, p: torch.Tensor, like: torch.Tensor, split: Split, mesh: ParallelMesh
                   ) -> None:
        """`p` is this rank's slice of `like` (which it replaces) cut by `split`."""
        base = self.of(like)
        owner = mesh.coord(split.dim) % split.replicas == 0
        self._set(p, replace(base, full_shape=tuple(like.shape),
                             splits=(*base.splits, split), norm_owner=base.norm_owner and owner))

    def mark_distinct(self, p: torch.Tensor, dim: str) -> None:
        """Ranks along `dim` hold different tensors in this place (e.g. pipeline stages)."""
        base = self.of(p)
        if dim not in base.distinct_over:
            self._set(p, replace(base, distinct_over=(*base.distinct_over, dim)))

    def mark_flat_shard(self, p: torch.Tensor, shard: FlatShard) -> None:
        """ZeRO keeps `p` (this rank's tensor) in a flat buffer sharded over `shard.dim`."""
        self._set(p, replace(self.of(p), flat_shard=shard))

    def any_sharded(self, params: list[torch.Tensor]) -> bool:
        return any(self.of(p).sharded_dims for p in params)

    def counts_in_norm(self, p: torch.Tensor, mesh: ParallelMesh,
                       also_sharded: tuple[str, ...] = ()) -> bool:
        """Does this rank's copy of `p` count in the global grad norm? Replicas count once:
        on coordinate 0 of every dim `p` is not split over (`also_sharded`: dims a strategy
        splits its gradient over, e.g. ZeRO's dp); a slice replicated within a split dim
        counts on its first holder only."""
        pl = self.of(p)
        # a product dim (ZeRO's shards over the replica axes, "dp_cp") names its parts; a
        # hybrid-sharding shard group ("dp_shard") spans the parts of the group it cuts
        spans = {shard: whole for whole, shard in mesh.shard_groups()[0].items()}
        sharded = pl.sharded_dims + tuple(d for s in also_sharded
                                          for d in spans.get(s, s).split("_"))
        laid = [d for d in LAID if d.name in sharded]
        # a slice of a laid dimension (an expert slice) replaces the replica axes by its
        # own groups: the first of them holds the slice, the others (edp) its copies
        owner = all(mesh.coord(d) == 0 for d in mesh.sizes if d not in sharded
                    and not (laid and d in REPLICA_AXES))
        for dim in laid:
            copies = dim.laid_groups[-1]
            if copies not in sharded:
                owner = owner and mesh.coord(copies) == 0
        return owner and pl.norm_owner
