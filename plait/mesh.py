"""ParallelMesh: the one object that says where this rank sits and how it talks.

Dims `dp, pp, cp, tp`; default order innermost first `tp, cp, pp, dp` so that tensor
parallel groups are contiguous ranks inside one node. Built over torch's DeviceMesh for the
dims of size > 1; a dim of size 1 has no group and its collectives are no-ops. With every
dim of size 1 no process group is needed at all: the single-process reference runs the
same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.distributed as dist

from plait.config import DEFAULT_ORDER, DIMS, ParallelConfig
from plait.device import CPU, Device
from plait.ledger import Ledger

# Product dims with a group of their own: dp x cp is where expert parallel and the
# data-parallel gradient reduction of context-parallel runs live. Named "a_b".
PRODUCTS = (("dp", "cp"),)
# Expert parallel's groups, cut from dp x cp: "ep", consecutive runs of `ep` of its ranks
# (they hold different experts and exchange tokens), and "edp", the ranks holding the same
# experts (their expert gradients are summed).
EXPERT_DIMS = ("ep", "edp")


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
    ep: int = 1  # expert parallel, laid over dp x cp (see `expert_ranks`)

    # ---- construction -----------------------------------------------------------
    @classmethod
    def build(cls, parallel: ParallelConfig, rank: int | None = None,
              world_size: int | None = None, device: Device = CPU) -> ParallelMesh:
        """Make the mesh for `parallel` on `device`. Needs an initialised process group
        (of `device.backend`) when world > 1."""
        sizes = {d: getattr(parallel, d) for d in DIMS}
        world = parallel.world_size
        if world > 1:
            if not dist.is_initialized():
                raise RuntimeError("a multi-rank mesh needs torch.distributed initialised first")
            rank = dist.get_rank() if rank is None else rank
            actual = dist.get_world_size() if world_size is None else world_size
            if actual != world:
                raise ValueError(
                    f"layout needs {world} ranks (dp*pp*cp*tp) but the world has {actual}"
                )
        mesh = cls(sizes=sizes, rank=rank or 0, order=tuple(parallel.order),
                   gpus_per_node=parallel.gpus_per_node, device=device)
        mesh.coords = mesh.coords_of(mesh.rank)
        for d in DIMS:
            mesh.group_ranks[d] = mesh.ranks_along(d)
            mesh.groups[d] = None
        for dims in PRODUCTS:
            mesh.group_ranks["_".join(dims)] = mesh.ranks_across(dims)
            mesh.groups["_".join(dims)] = None
        mesh.ep = parallel.ep
        for name in EXPERT_DIMS:
            mesh.group_ranks[name] = mesh.expert_ranks(name)
            mesh.groups[name] = None
        if world > 1:
            mesh._make_groups()
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
        for name in EXPERT_DIMS:
            self.groups[name] = self._subgroup(name)

    def _subgroup(self, name: str) -> dist.ProcessGroup | None:
        """The process group of expert dim `name` (None when it is one rank, or the whole
        dp x cp group when it is all of it)."""
        mine = self.group_ranks[name]
        if len(mine) == 1:
            return None
        if mine == self.group_ranks["dp_cp"]:
            return self.groups["dp_cp"]
        group = None  # collective over the world: every rank makes every group, in order
        for ranks in sorted({tuple(self.expert_ranks(name, r)) for r in range(self.world_size)}):
            made = dist.new_group(list(ranks))
            if self.rank in ranks:
                group = made
        return group

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

    def expert_ranks(self, name: str, rank: int | None = None) -> list[int]:
        """Ranks of expert dim `name` ("ep" or "edp") containing `rank`: with dp x cp's
        ranks in order and i this rank's position, ep = positions with the same i // ep,
        edp = those with the same i % ep."""
        rank = self.rank if rank is None else rank
        ranks = self.ranks_across(("dp", "cp"), rank)
        i, e = ranks.index(rank), self.ep
        return ranks[(i // e) * e:(i // e + 1) * e] if name == "ep" else ranks[i % e::e]

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

    def describe(self) -> str:
        parts = [f"{d}={self.sizes[d]}" for d in reversed(self.order)]
        ep = f", ep={self.ep} over dp x cp" if self.ep > 1 else ""
        return " x ".join(parts) + ep + f" (order innermost first: {','.join(self.order)})"
