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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.placement import PlacementTable, Split

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
                                  p.dtype if state == "param" else torch.float32,
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
