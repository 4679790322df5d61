"""ZeRO's shard index: which elements of which parameter each dp rank's shard holds.

ZeroOptimizer (zero.py) keeps each unit's parameters in one flat buffer padded to a
multiple of N = dp and shards that, so a shard crosses parameter boundaries. The index
says it by name: "elements [a, b) of `layers.3.attn.wq.weight` (rows i..j) are elements
[o, o + b - a) of dp rank 1's master shard of unit 4", for each state the optimizer keeps
(`param`: the compute-dtype parameter, `master`: the fp32 master, `exp_avg`, `exp_avg_sq`:
AdamW's moments; SGD keeps none), padding excluded. A checkpoint writer saves each rank's
own entries without a gather; a resharding reader knows every rank's (`dp_rank` is any
rank's layout, computable on every rank).

Ranges speak of this rank's tensor: where tensor parallel splits a parameter that is its
tp-local slice (`shape`, with `splits` and `full_shape` from the PlacementTable saying how
it sits in the full parameter). Built once, at construction, from each parameter's
`FlatShard` in the PlacementTable (plait/placement.py): nothing on the training path.

`NamedShards` is ZeroOptimizer's side of it (mixed into the optimizer): the index, the
live view of each entry, and what a checkpoint reads and writes of them (the
GradSyncOptimizer's `held_states`, `params_read_on_load`, `finish_load`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from plait.mesh import ParallelMesh
from plait.model.precision import wide_dtype
from plait.muon import muon_states
from plait.parallel.held import HeldState
from plait.placement import FlatShard, PlacementTable, Split

if TYPE_CHECKING:
    from plait.parallel.zero_units import _Unit

STATES = ("param", "master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class ShardSlice:
    """Elements [start, stop) of parameter `name`'s flattened tensor, state `state`, held by
    dp rank `dp_rank` as elements [offset, offset + stop - start) of its shard tensor of
    unit `unit` for that state (ZeroOptimizer.shard_tensor(unit, state))."""

    name: str  # the model's name (the keys of plait.train.loop.full_state)
    state: str  # one of STATES
    dp_rank: int  # coordinate along the ZeRO dim
    start: int
    stop: int
    rows: tuple[int, int] | None  # [start, stop) as rows of axis 0, when whole rows
    shape: tuple[int, ...]  # the tensor the ranges index: tp-local where tp splits it
    dtype: torch.dtype  # of the shard tensor: the compute dtype for `param`, else fp32
    unit: int
    offset: int
    full_shape: tuple[int, ...]  # the whole parameter's (equal to `shape` unless split)
    splits: tuple[Split, ...] = ()  # tensor-parallel cuts of the full parameter

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def tp_local(self) -> bool:
        """The ranges index a tensor-parallel slice, not the full parameter."""
        return bool(self.splits)

    def view_shape(self) -> tuple[int, ...]:
        """The slice's shape as a block of rows when it is whole rows, else flat."""
        if self.rows is None:
            return (self.numel,)
        return (self.rows[1] - self.rows[0], *self.shape[1:])


def whole_rows(shape: tuple[int, ...], start: int, stop: int) -> tuple[int, int] | None:
    """[start, stop) as rows of axis 0, when it begins and ends on row boundaries."""
    if not shape or shape[0] == 0:
        return None
    row = int(torch.Size(shape).numel()) // shape[0]
    if row == 0 or start % row or stop % row:
        return None
    return start // row, stop // row


def build_shard_index(named: list[tuple[str, torch.Tensor]], placements: PlacementTable,
                      n: int, states: tuple[str, ...]) -> tuple[ShardSlice, ...]:
    """Every dp rank's slices of the parameters `named` (model name, this rank's tensor)
    for `states`, in rank, unit and parameter order. Each parameter must carry its
    FlatShard in `placements`."""
    out = []
    for r in range(n):
        for name, p in named:
            pl = placements.of(p)
            fs = pl.flat_shard
            if fs is None:
                raise ValueError(f"{name} has no ZeRO flat shard in the placement table")
            got = fs.on_rank(r)
            if got is None:
                continue
            a, b = got
            shape = tuple(p.shape)
            rows = whole_rows(shape, a, b)
            offset = fs.offset + a - r * fs.shard_numel
            out.extend(ShardSlice(name, state, r, a, b, rows, shape,
                                  p.dtype if state == "param" else wide_dtype(p.dtype),
                                  fs.unit, offset, pl.full_shape, pl.splits)
                       for state in states)
    return tuple(out)


def format_shard_index(entries: list[ShardSlice] | tuple[ShardSlice, ...],
                       state: str | None = "master") -> str:
    """A table of `entries` (those of `state`; None: all), one line each."""
    lines = [f"{'dp':>2}  {'name':<26} {'state':<10} {'elements':<15} {'rows':<10} "
             f"{'unit':>4} {'offset':>6}  shape"]
    for e in entries:
        if state is not None and e.state != state:
            continue
        rows = "-" if e.rows is None else f"{e.rows[0]}:{e.rows[1]}"
        shape = "x".join(map(str, e.shape)) + (" (tp-local)" if e.tp_local else "")
        lines.append(f"{e.dp_rank:>2}  {e.name:<26} {e.state:<10} "
                     f"{f'{e.start}:{e.stop}':<15} {rows:<10} {e.unit:>4} {e.offset:>6}  {shape}")
    return "\n".join(lines)


def _model_name(model: nn.Module, name: str) -> str:
    """A unit's parameter name as the model names it: a pipeline rank's "stages.S." prefix
    dropped (a stage's own names are the model's; DualPipe's second copies too)."""
    names = getattr(model, "model_names", None)
    if names is None:
        return name
    return names.get(name, name.split(".", 2)[2] if name.startswith("stages.") else name)


class NamedShards:
    """ZeroOptimizer's shards by parameter name and state. The optimizer provides `units`,
    `placements`, `mesh`, `kind`, `stage`, `steps` and `settle()`, and calls
    `_index_shards(model)` once its units exist."""

    units: list[_Unit]
    placements: PlacementTable
    mesh: ParallelMesh
    kind: str
    stage: int
    steps: int
    replicate: str | None

    # ---- the shard index: built once, read by checkpoints -------------------------------
    def _index_shards(self, model: nn.Module) -> None:
        """Each parameter's FlatShard into the placement table, and the index from them."""
        named: dict[str, list] = {}
        # (model name, parameter) in unit order: DualPipe's two copies share a name
        self._named: list[tuple[str, nn.Parameter]] = []
        self._param_of: dict[tuple[int, str], nn.Parameter] = {}  # by (unit, name)
        for u in self.units:
            for name, p, off in zip(u.names, u.params, u.offsets, strict=True):
                self.placements.mark_flat_shard(
                    p, FlatShard(u.dim, u.index, off, p.numel(), u.k))
                name = _model_name(model, name)
                self._named.append((name, p))
                self._param_of[u.index, name] = p
                named.setdefault(u.dim, []).append((name, p))
        self.states = {"adamw": STATES, "muon": (*STATES, "momentum")}.get(
            self.kind, ("param", "master"))
        self._index = tuple(e for d, group in named.items() for e in build_shard_index(
            group, self.placements, self.mesh.size(d), self.states))

    def shard_index(self, dp_rank: int | None = None) -> list[ShardSlice]:
        """The slices of every parameter and state that dp rank `dp_rank` (None: this one)
        holds, padding excluded; any rank's layout can be asked on every rank."""
        if dp_rank is None:  # each entry's own unit says which rank of its dim this is
            return [e for e in self._index if e.dp_rank == self.units[e.unit].rank]
        return [e for e in self._index if e.dp_rank == dp_rank]

    def shard_tensor(self, unit: int, state: str) -> torch.Tensor:
        """This rank's shard of unit `unit` for `state` (flat; `param`: stage 3's
        persistent shard, else this rank's part of the gathered compute buffer)."""
        if state not in self.states:
            raise KeyError(f"state {state!r}; this optimizer keeps {self.states}")
        u = self.units[unit]
        if state == "param":
            self.settle()
            return u.shard if self.stage == 3 else u.full[u.lo:u.hi]
        return getattr(u, state)  # master, exp_avg, exp_avg_sq; Muon's momentum

    def shard_view(self, entry: ShardSlice) -> torch.Tensor:
        """The live elements of `entry` on this rank (a flat view, no copy; shaped
        `entry.view_shape()` when whole rows)."""
        mine = self.units[entry.unit].rank
        if entry.dp_rank != mine:
            raise ValueError(f"{entry.name}: a slice of dp rank {entry.dp_rank}, this is "
                             f"dp rank {mine}")
        flat = self.shard_tensor(entry.unit, entry.state)
        return flat[entry.offset:entry.offset + entry.numel]

    # ---- checkpoints (GradSyncOptimizer: held_states, params_read_on_load, finish_load) ----
    def held_states(self) -> list[HeldState]:
        """This rank's run of each fp32 state, in `shard_index` order (the compute `param`
        is left out: it is the master cast). Each run is a shard over its unit's dim:
        routed experts over edp, the rest over the replica axes."""
        return [HeldState(e.name, e.state, self._param_of[e.unit, e.name], e.start, e.stop,
                          self.shard_view(e), flat=True,
                          sharded_over=(self.units[e.unit].reduced_over,),
                          copies_over=(self.replicate,) if self.replicate else (),
                          second_copy=self.units[e.unit].second_copy)
                for e in self.shard_index() if e.state != "param" and self._keeps(e)]

    def _keeps(self, e: ShardSlice) -> bool:
        """Muon: a matrix's momentum, the other parameters' moments (plait/muon.py)."""
        return self.kind != "muon" or e.state in muon_states(e.name, self._param_of[
            e.unit, e.name])

    def params_read_on_load(self) -> list[tuple[str, nn.Parameter]]:
        """Stages 1, 2: every parameter, whole on each rank while its masters are shards
        (read from the saved masters: no all-gather). Stage 3: none (`finish_load`)."""
        return [] if self.stage == 3 else list(self._named)

    @torch.no_grad()
    def finish_load(self, steps: int) -> None:
        """Stage 3: the persistent compute shards from the loaded masters (the next forward
        gathers them); the update count."""
        if self.stage == 3:
            for u in self.units:
                u.shard.copy_(u.master)
        self.steps = steps
