"""ZeRO's units (plait/parallel/zero.py): the parameters of one module (ZeRO-3) or of a run
of consecutive modules up to a bucket's bytes (ZeRO-1/2), of one reduction dim, as a flat
padded buffer and this rank's shard of it; which modules become units."""

from __future__ import annotations

import torch
from torch import nn

from plait.comm.ops import Handle
from plait.mesh import ParallelMesh
from plait.parallel.buckets import backward_runs
from plait.parallel.expert import reduce_dim
from plait.placement import PlacementTable


class _Unit:
    """One or more modules' parameters as a flat, padded buffer and this rank's shard of it."""

    def __init__(self, index: int, module: nn.Module, named: list[tuple[str, nn.Parameter]],
                 dim: str, n: int, rank: int, moments: bool = True,
                 reduced_over: str | None = None):
        """`named`: the unit's parameters by name, `module` the first of the unit's modules
        to run forward (its hooks are the unit's); sharded over mesh dim `dim` (n ranks,
        this one at `rank`)."""
        self.index, self.module = index, module
        self.dim, self.n, self.rank = dim, n, rank
        # the group whose ranks' gradients the unit sums (the replica group, or the
        # experts' copies): `dim` itself, or with hybrid sharding the group `dim` is the
        # shard part of (the grad norm and checkpoints count a shard once over it)
        self.reduced_over = reduced_over or dim
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.numel = sum(p.numel() for p in self.params)
        self.k = -(-self.numel // n)  # shard elements
        self.lo, self.hi = rank * self.k, (rank + 1) * self.k
        self.offsets = list(_cumulative(p.numel() for p in self.params))
        dtype, dev = self.params[0].dtype, self.params[0].device
        self.full = torch.zeros(self.k * n, dtype=dtype, device=dev)
        for p, off in zip(self.params, self.offsets, strict=True):
            self.full[off:off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.full[off:off + p.numel()].view_as(p)
        self.master = self.full[self.lo:self.hi].float().clone()
        # Adam's moments (SGD keeps none: empty tensors, nothing to count)
        none = torch.zeros(0, device=dev)
        self.exp_avg = torch.zeros_like(self.master) if moments else none
        self.exp_avg_sq = torch.zeros_like(self.master) if moments else none
        self.shard: torch.Tensor | None = None  # stage 3: the persistent compute-dtype shard
        self.grad_shard: torch.Tensor | None = None
        self.gathered = True
        self.gather_handle: Handle | None = None
        # stages 1, 2: the update's all-gather input (the cast shard) while in flight, and
        # whether the unit's forward waits for it (else the update does)
        self.gather_in: torch.Tensor | None = None
        self.deferred = False
        self.ready: set[int] = set()
        self.rs_handle: Handle | None = None
        self.rs_out: torch.Tensor | None = None
        self.rs_in: torch.Tensor | None = None

    def segments(self) -> list[tuple[int, int, nn.Parameter]]:
        """(start, end) in shard coordinates of each parameter overlapping this shard."""
        out = []
        for p, off in zip(self.params, self.offsets, strict=True):
            a, b = max(off, self.lo), min(off + p.numel(), self.hi)
            if a < b:
                out.append((a - self.lo, b - self.lo, p))
        return out

    def flat_grad(self, free: bool) -> torch.Tensor:
        """The unit's gradient as one padded flat tensor (zeros where no gradient came).

        `free` drops the per-parameter gradients (stages 2 and 3); stage 1 keeps them, they
        are its 2 bytes/parameter of gradient state.
        """
        # `full` may be freed (stage 3): a new buffer of its shape. Every element is
        # written once: a gradient copied in, zeros only for the padding and a parameter
        # that got no gradient (a zero-filled buffer would write the whole unit twice)
        flat = torch.empty(self.full.shape, dtype=self.full.dtype, device=self.full.device)
        for p, off in zip(self.params, self.offsets, strict=True):
            if p.grad is not None:
                flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
                if free:
                    p.grad = None
            else:
                flat[off:off + p.numel()].zero_()
        flat[self.numel:].zero_()
        return flat


def _cumulative(sizes):
    total = 0
    for s in sizes:
        yield total
        total += s


def zero_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that become units: top-level children, each block of a ModuleList."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            out.extend((f"{name}.{i}.", block) for i, block in enumerate(child))
        elif any(True for _ in child.parameters()):
            out.append((f"{name}.", child))
    return out


def zero_unit_groups(model: nn.Module, cap_bytes: float | None
                     ) -> list[list[tuple[str, nn.Module]]]:
    """The modules of each unit, in forward order. `cap_bytes` None: one module a unit
    (ZeRO-3 gathers each around its use). Else (ZeRO-1/2) consecutive modules share a
    unit, grouped in backward order as torch DDP buckets its gradients: a unit is closed
    once its parameters reach `cap_bytes`. Fewer, larger reduce-scatters and all-gathers;
    on gloo each collective has a fixed cost (docs/zero.md, "Units")."""
    modules = zero_units(model)
    if cap_bytes is None:
        return [[m] for m in modules]
    sizes = [sum(p.numel() * p.element_size() for p in m.parameters()) for _, m in modules]
    return [[modules[i] for i in reversed(run)]
            for run in reversed(backward_runs(sizes, cap_bytes))]


def make_units(model: nn.Module, mesh: ParallelMesh, placements: PlacementTable, dim: str,
               moments: bool, cap_bytes: float | None) -> list[_Unit]:
    """One unit per group of `zero_unit_groups` and reduction dim: expert-parallel slices
    are sharded over "edp" (the ranks holding the same experts), the rest over `dim`;
    with hybrid sharding over the part of that group inside this rank's shard group
    (`ParallelMesh.shard_groups`)."""
    shard_of, _ = mesh.shard_groups()
    units: list[_Unit] = []
    for group in zero_unit_groups(model, cap_bytes):
        by_dim: dict[str, list[tuple[str, nn.Parameter]]] = {}
        for prefix, module in group:
            for name, p in module.named_parameters():
                d = reduce_dim(placements, p, dim)
                by_dim.setdefault(d, []).append((f"{prefix}{name}", p))
        for d, named in by_dim.items():
            shard = shard_of.get(d, d)
            units.append(_Unit(len(units), group[0][1], named, shard, mesh.size(shard),
                               mesh.coord(shard), moments, reduced_over=d))
    return units
