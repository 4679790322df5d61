"""ParallelMesh: the one object that says where this rank sits and how it talks.

Its axes and their default order, innermost first, are the dimension records'
(plait/dims/): tensor parallel innermost, so that its groups are contiguous ranks inside
one node. Built over torch's DeviceMesh for the
dims of size > 1; a dim of size 1 has no group and its collectives are no-ops. With every
dim of size 1 no process group is needed at all: the single-process reference runs the
same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.distributed as dist

from plait.config import ParallelConfig
from plait.device import CPU, Device
from plait.dims import DEFAULT_ORDER, DIMS, LAID, REPLICA_AXES, REPLICAS, replica_group
from plait.ledger import Ledger

# Product dims with a group of their own, named "a_b": the replica axes' product, where
# gradients are summed and the laid dimensions (expert parallel) cut their groups.
PRODUCTS = (REPLICA_AXES,)


@dataclass
class ParallelMesh:
    sizes: dict[str, int]
    rank: int
    order: tuple[str, ...] = DEFAULT_ORDER  # innermost first
    gpus_per_node: int = 8
    coords: dict[str, int] = field(default_factory=dict)
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    device_mesh: object | None = None
    ledger: Ledger = field(default_factory=Ledger)
    device: Device = CPU  # where this rank allocates and computes (plait/device)
    # the sizes of the dimensions laid over the replica ranks (see `laid_ranks`)
    laid: dict[str, int] = field(default_factory=dict)

    # ---- construction -----------------------------------------------------------
    @classmethod
    def build(cls, parallel: ParallelConfig, rank: int | None = None,
              world_size: int | None = None, device: Device = CPU) -> ParallelMesh:
        """Make the mesh for `parallel` on `device`. Needs an initialised process group
        (of `device.backend`) when world > 1."""
        world = parallel.world_size
        if world > 1:
            if not dist.is_initialized():
                raise RuntimeError("a multi-rank mesh needs torch.distributed initialised first")
            rank = dist.get_rank() if rank is None else rank
            actual = dist.get_world_size() if world_size is None else world_size
            if actual != world:
                raise ValueError(
                    f"layout needs {world} ranks ({'*'.join(DIMS)}) but the world has "
                    f"{actual}")
        mesh = cls.arithmetic(parallel, rank or 0, device)
        if world > 1:
            mesh._make_groups()
        return mesh

    @classmethod
    def arithmetic(cls, parallel: ParallelConfig, rank: int, device: Device = CPU
                   ) -> ParallelMesh:
        """The mesh of `parallel` as rank `rank` sees it, without process groups: its
        coordinates and the ranks of every group it would join (tests, the planner)."""
        sizes = {d: getattr(parallel, d) for d in DIMS}
        mesh = cls(sizes=sizes, rank=rank, order=tuple(parallel.order),
                   gpus_per_node=parallel.gpus_per_node, device=device)
        mesh.coords = mesh.coords_of(mesh.rank)
        for d in DIMS:
            mesh.group_ranks[d] = mesh.ranks_along(d)
            mesh.groups[d] = None
        for dims in PRODUCTS:
            mesh.group_ranks["_".join(dims)] = mesh.ranks_across(dims)
            mesh.groups["_".join(dims)] = None
        mesh.laid = {d.name: getattr(parallel, d.name) for d in LAID}
        for name in mesh.laid_groups():
            mesh.group_ranks[name] = mesh.laid_ranks(name)
            mesh.groups[name] = None
        return mesh

    def _make_groups(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        # DeviceMesh lists dims outermost first; only dims that actually split ranks
        outer_first = [d for d in reversed(self.order) if self.sizes[d] > 1]
        shape = tuple(self.sizes[d] for d in outer_first)
        self.device_mesh = init_device_mesh(self.device.type, shape,
                                            mesh_dim_names=tuple(outer_first))
        for d in outer_first:
            self.groups[d] = self.device_mesh.get_group(d)
            got = dist.get_process_group_ranks(self.groups[d])
            if got != self.group_ranks[d]:  # our rank arithmetic must agree with DeviceMesh's
                raise RuntimeError(f"mesh dim {d}: DeviceMesh ranks {got} != {self.group_ranks[d]}")
        for dims in PRODUCTS:
            name, split = "_".join(dims), [d for d in dims if self.sizes[d] > 1]
            if len(split) == 1:  # the product is just that dim
                self.groups[name] = self.groups[split[0]]
            elif len(split) > 1:
                # new_group is collective over the world: every rank creates every partition
                # in the same order and keeps its own
                partitions = sorted({tuple(self.ranks_across(dims, r))
                                     for r in range(self.world_size)})
                for ranks in partitions:
                    group = dist.new_group(list(ranks))
                    if self.rank in ranks:
                        self.groups[name] = group
        made: dict[frozenset, dist.ProcessGroup] = {}
        for name in self.laid_groups():
            self.groups[name] = self._subgroup(name, made)

    def _subgroup(self, name: str, made: dict[frozenset, dist.ProcessGroup]
                  ) -> dist.ProcessGroup | None:
        """The process group of laid group `name`: None when it is one rank; the replica
        group when it is all of it; an earlier laid group's when it cuts the ranks the same
        way (`made`, by partition: hybrid sharding's groups without replica groups)."""
        mine = self.group_ranks[name]
        if len(mine) == 1:
            return None
        if mine == self.group_ranks[REPLICAS]:
            return self.groups[REPLICAS]
        partition = frozenset(tuple(self.laid_ranks(name, r)) for r in range(self.world_size))
        if partition not in made:
            # new_group is collective over the world: every rank makes every group, in order
            for ranks in sorted(partition):
                group = dist.new_group(list(ranks))
                if self.rank in ranks:
                    made[partition] = group
        return made[partition]

    # ---- rank arithmetic (pure, so tests and the planner can use it without groups) ----
    def strides(self) -> dict[str, int]:
        stride, out = 1, {}
        for d in self.order:
            out[d] = stride
            stride *= self.sizes[d]
        return out

    def coords_of(self, rank: int) -> dict[str, int]:
        st = self.strides()
        return {d: (rank // st[d]) % self.sizes[d] for d in self.order}

    def rank_of(self, coords: dict[str, int]) -> int:
        st = self.strides()
        return sum(coords[d] * st[d] for d in self.order)

    def ranks_along(self, dim: str, rank: int | None = None) -> list[int]:
        """Global ranks of the group along `dim` that contains `rank` (default: this rank)."""
        c = self.coords_of(self.rank if rank is None else rank)
        return [self.rank_of({**c, dim: i}) for i in range(self.sizes[dim])]

    def ranks_across(self, dims: tuple[str, ...], rank: int | None = None) -> list[int]:
        """Global ranks sharing `rank`'s coordinates on every dim not in `dims`, in order."""
        c = self.coords_of(self.rank if rank is None else rank)
        return sorted(r for r in range(self.world_size)
                      if all(self.coords_of(r)[d] == c[d] for d in self.order if d not in dims))

    def replica_dim(self) -> str:
        """The group over which the copies of a parameter sum their gradients: the data-
        parallel axis alone, or the replica axes' product group once another of them
        (context parallel) splits ranks too."""
        return replica_group(self.sizes)

    def laid_groups(self) -> list[str]:
        """The groups of the dimensions laid over the replica ranks (plait/dims/)."""
        return [g for d in LAID for g in d.laid_groups]

    def laid_ranks(self, name: str, rank: int | None = None) -> list[int]:
        """Ranks of laid group `name` containing `rank`, cut from the replica ranks by
        the record of the dimension that owns the group."""
        rank = self.rank if rank is None else rank
        ranks = self.ranks_across(REPLICA_AXES, rank)
        owner = next(d for d in LAID if name in d.laid_groups)
        return owner.laid_ranks(name, ranks, ranks.index(rank), self.laid)

    # ---- queries -------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())

    def size(self, dim: str) -> int:
        """Group size along `dim`; "world" is every rank (the default process group)."""
        if dim == "world":
            return self.world_size
        return self.sizes[dim] if dim in self.sizes else len(self.group_ranks[dim])

    def coord(self, dim: str) -> int:
        """This rank's index along `dim` (for a product dim: its position in the group)."""
        if dim in self.coords:
            return self.coords[dim]
        return self.group_ranks[dim].index(self.rank)

    def group(self, dim: str) -> dist.ProcessGroup | None:
        if dim == "world":
            return dist.group.WORLD if self.world_size > 1 else None
        return self.groups[dim]

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def crosses_nodes(self, dim: str) -> bool:
        """Does the group along `dim` span more than one node?"""
        if dim == "world":
            return self.world_size > self.gpus_per_node
        return len({self.node_of(r) for r in self.group_ranks[dim]}) > 1

    def link(self, dim: str) -> str:
        return "inter" if self.crosses_nodes(dim) else "intra"

    def shard_groups(self) -> tuple[dict[str, str], str | None]:
        """Where ZeRO shards each reduction group's parameters, and the group that holds
        copies of the shards (None: none). With hybrid sharding (dp_replicate > 1) the
        replica group's parameters shard over "dp_shard" and the experts' copies over
        "edp_shard", and "dp_replicate" holds the copies; else each shards over itself."""
        if self.laid.get("dp_replicate", 1) == 1:
            return {}, None
        return {self.replica_dim(): "dp_shard", "edp": "edp_shard"}, "dp_replicate"

    def describe(self) -> str:
        parts = [f"{d}={self.sizes[d]}" for d in reversed(self.order)]
        over = " x ".join(REPLICA_AXES)
        laid = "".join(f", {n}={k} over {over}" for n, k in self.laid.items() if k > 1)
        return " x ".join(parts) + laid + f" (order innermost first: {','.join(self.order)})"
