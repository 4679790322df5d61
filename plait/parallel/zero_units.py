"""ZeRO's units (plait/parallel/zero.py): the parameters of one module (ZeRO-3) or of a run
of consecutive modules up to a bucket's bytes (ZeRO-1/2), of one reduction dim, as a flat
padded buffer and this rank's shard of it; which modules become units. On a pipeline rank
a unit never spans two stages: each stage's gradients are final at its own last backward
(and DualPipe's two copies of a stage must shard alike)."""

from __future__ import annotations

import torch
from torch import nn

from plait.comm.ops import Handle
from plait.mesh import ParallelMesh
from plait.model.precision import widened
from plait.parallel.buckets import backward_runs
from plait.parallel.expert import reduce_dim
from plait.parallel.fp8 import is_float8
from plait.placement import PlacementTable


class _Unit:
    """One or more modules' parameters as a flat, padded buffer and this rank's shard of it."""

    def __init__(self, index: int, module: nn.Module, named: list[tuple[str, nn.Parameter]],
                 dim: str, n: int, rank: int, moments: bool = True, stage: int = 0,
                 reduced_over: str | None = None):
        """`named`: the unit's parameters by name, `module` the first of the unit's modules
        to run forward (its hooks are the unit's); sharded over mesh dim `dim` (n ranks,
        this one at `rank`); `stage`: the pipeline stage holding it (0 without one)."""
        self.index, self.module, self.stage = index, module, stage
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
        self.master = widened(self.full[self.lo:self.hi]).clone()
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
        self.takes_input_grad = True  # ZeRO-3: its last forward's input takes a gradient
        self.second_copy = False  # DualPipe's chain-1 copy of a stage (not in norms, saves)
        self.ready: set[int] = set()
        self.rs_handle: Handle | None = None
        self.rs_out: torch.Tensor | None = None
        self.rs_in: torch.Tensor | None = None
        # float8 (plait/parallel/zero_fp8.py): the linears whose weights these are (empty:
        # the unit gathers in its own dtype), the weights' scales, this rank's float8 shard
        # and the gathered float8 whole, as bytes
        self.fp8_modules: list[nn.Module] = []
        self.fp8_scales: torch.Tensor | list[torch.Tensor] | None = None
        self.fp8_shard: torch.Tensor | None = None
        self.fp8_full: torch.Tensor | None = None

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


def zero_units(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The modules that become units: top-level children, each block of a ModuleList (or
    of a pipeline stage's ModuleDict of blocks)."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            out.extend((f"{prefix}{name}.{key}.", block) for key, block in child.named_children())
        elif any(True for _ in child.parameters()):
            out.append((f"{prefix}{name}.", child))
    return out


def stage_modules(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """`zero_units` by pipeline stage: a pipeline rank's module (a ModuleDict `stages` of
    stage id -> stage) gives each stage's, named from the rank's module; any other model is
    the one stage 0."""
    stages = getattr(model, "stages", None)
    if not isinstance(stages, nn.ModuleDict):
        return {0: zero_units(model)}
    return {int(s): zero_units(stage, f"stages.{s}.") for s, stage in stages.items()}


def zero_unit_groups(model: nn.Module, cap_bytes: float | None
                     ) -> list[tuple[int, list[tuple[str, nn.Module]]]]:
    """(stage, the modules of each unit), in forward order within each stage. `cap_bytes`
    None: one module a unit (ZeRO-3 gathers each around its use). Else (ZeRO-1/2)
    consecutive modules of a stage share a unit, grouped in backward order as torch DDP
    buckets its gradients: a unit is closed once its parameters reach `cap_bytes`. Fewer,
    larger reduce-scatters and all-gathers; on gloo each collective has a fixed cost
    (docs/zero.md, "Units")."""
    out = []
    for stage, modules in stage_modules(model).items():
        if cap_bytes is None:
            out += [(stage, [m]) for m in modules]
            continue
        sizes = [sum(p.numel() * p.element_size() for p in m.parameters()) for _, m in modules]
        out += [(stage, [modules[i] for i in reversed(run)])
                for run in reversed(backward_runs(sizes, cap_bytes))]
    return out


def make_units(model: nn.Module, mesh: ParallelMesh, placements: PlacementTable, dim: str,
               moments: bool, cap_bytes: float | None, fp8: bool = False) -> list[_Unit]:
    """One unit per group of `zero_unit_groups` and reduction dim: expert-parallel slices
    are sharded over "edp" (the ranks holding the same experts), the rest over `dim`;
    with hybrid sharding over the part of that group inside this rank's shard group
    (`ParallelMesh.shard_groups`). `fp8` (ZeRO-3 under precision fp8): the float8
    linears' weights are a unit of their own, gathered in float8 (zero_fp8.py)."""
    shard_of, _ = mesh.shard_groups()
    units: list[_Unit] = []
    for stage, group in zero_unit_groups(model, cap_bytes):
        by_dim: dict[tuple[str, bool], list[tuple[str, nn.Parameter]]] = {}
        owners: dict[int, nn.Module] = {}
        for prefix, module in group:
            if fp8:
                owners.update((id(m.weight), m) for m in module.modules() if is_float8(m))
            for name, p in module.named_parameters():
                d = reduce_dim(placements, p, dim)
                by_dim.setdefault((d, id(p) in owners), []).append((f"{prefix}{name}", p))
        for (d, in_fp8), named in by_dim.items():
            shard = shard_of.get(d, d)
            units.append(_Unit(len(units), group[0][1], named, shard, mesh.size(shard),
                               mesh.coord(shard), moments, stage, reduced_over=d))
            if in_fp8:
                units[-1].fp8_modules = [owners[id(p)] for _, p in named]
    return units
