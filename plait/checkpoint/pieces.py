"""What this rank holds of each named tensor, as pieces of the global tensors.

A `Piece` is this rank's live tensor for (parameter name, state) placed in the global,
unpadded tensor: a box (the tensor-parallel slice, from the PlacementTable's `Split`;
the whole tensor otherwise) and elements [start, stop) of it (ZeRO's flat shard; the
whole box otherwise). What the rank holds comes from the optimizer's protocol
(plait/parallel/optimizer.py: `held_states()`, plait/parallel/held.py), whichever strategy
it is. States are the optimizer's fp32 ones: `master` and, for AdamW, `exp_avg` and
`exp_avg_sq`. The compute-dtype parameter is not saved: after every update it is exactly
`master` cast to the compute dtype (every optimizer publishes it so), and the optimizer's
`finish_load` makes it so again after a load (`params_read_on_load`: those it reads from
the saved masters instead).

`write` marks the one holder that saves a piece: replicas are written once, by the rank
at coordinate 0 of every dim the piece is replicated over (the grad norm's rule,
`PlacementTable.counts_in_norm`, with the dims the optimizer shards the state over);
DualPipe's second copies are never written (they equal the owned copies) but are filled
on load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plait.dims import AXES
from plait.mesh import ParallelMesh
from plait.parallel.expert import balance_biases
from plait.parallel.held import HeldState
from plait.parallel.parallelize import ParallelModel
from plait.placement import Placement, PlacementTable

from .format import CheckpointError


@dataclass
class Piece:
    name: str  # the model's parameter name
    state: str  # master | exp_avg | exp_avg_sq
    box_offset: tuple[int, ...]
    box_shape: tuple[int, ...]
    start: int  # elements [start, stop) of the box, row-major
    stop: int
    tensor: torch.Tensor  # the live elements (stop - start of them), any shape and dtype
    write: bool  # this rank saves it


def states_of(kind: str) -> tuple[str, ...]:
    if kind == "muon":  # each tensor keeps some of these (plait/muon.py muon_states)
        return ("master", "exp_avg", "exp_avg_sq", "momentum")
    return ("master", "exp_avg", "exp_avg_sq") if kind == "adamw" else ("master",)


def tp_box(name: str, pl: Placement, local_shape: tuple[int, ...], mesh: ParallelMesh
           ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offset, shape) of this rank's tensor in the global one: each split axis's slice,
    padding cut (None: all padding, e.g. a rank holding only padded vocabulary rows)."""
    off, shape = [0] * len(local_shape), list(local_shape)
    for s in pl.splits:
        size = local_shape[s.axis]
        o = (mesh.coord(s.dim) // s.replicas) * size
        valid = min(size, s.full_size - o)
        if valid <= 0:
            return None
        if valid < size and s.axis != 0:  # padding only ever pads rows (the vocabulary)
            raise CheckpointError(f"{name}: padding along axis {s.axis} is not supported")
        off[s.axis], shape[s.axis] = o, valid
    if len(shape) != len(pl.full_shape) or any(
            a != b for i, (a, b) in enumerate(zip(shape, pl.full_shape, strict=True))
            if all(s.axis != i for s in pl.splits)):
        raise CheckpointError(f"{name}: local shape {local_shape} does not fit the global "
                              f"{pl.full_shape}")
    return tuple(off), tuple(shape)


def _valid(t: torch.Tensor, box_shape: tuple[int, ...]) -> torch.Tensor:
    """The part of a (padded) local tensor inside the global tensor: leading rows."""
    return t.narrow(0, 0, box_shape[0]) if t.ndim and t.shape[0] != box_shape[0] else t


def pieces(par: ParallelModel, mesh: ParallelMesh, kind: str) -> list[Piece]:
    """Every piece this rank holds of the optimizer's fp32 states (those of `kind`), then
    of the training state beside them (`state_pieces`)."""
    states = states_of(kind)
    placed = (_placed(h, par.placements, mesh) for h in par.optimizer.held_states()
              if h.state in states)
    return [p for p in placed if p is not None] + state_pieces(par, mesh)


def _placed(h: HeldState, placements: PlacementTable, mesh: ParallelMesh) -> Piece | None:
    """`h` in the global tensor (None: this rank's elements of it are all padding)."""
    box = tp_box(h.name, placements.of(h.param), tuple(h.param.shape), mesh)
    if box is None:
        return None
    n = math.prod(box[1])
    write = (placements.counts_in_norm(h.param, mesh, also_sharded=h.sharded_over)
             and not h.second_copy and all(mesh.coord(d) == 0 for d in h.copies_over))
    if not h.flat:  # the whole local tensor: its rows inside the global one
        return Piece(h.name, h.state, *box, 0, n, _valid(h.tensor, box[1]), write)
    stop = min(h.stop, n)  # padded vocabulary rows are the flat tail of the tensor
    if stop <= h.start:
        return None
    view = h.tensor.reshape(-1)[:stop - h.start]
    return Piece(h.name, h.state, *box, h.start, stop, view, write)


def state_pieces(par: ParallelModel, mesh: ParallelMesh) -> list[Piece]:
    """Training state that is not a parameter: each MoE block's balancing bias (fp32,
    saved as its `master`), whole on every rank of its stage; written by the rank at
    coordinate 0 of every axis whose ranks hold copies or gathered shards (plait/dims/:
    not the pipeline's stages), DualPipe's owned copy only."""
    first = all(mesh.coord(d.name) == 0 for d in AXES if d.checkpoint != "owned")
    return [Piece(name, "master", (0,), (t.numel(),), 0, t.numel(), t, first and owned)
            for name, t, owned in balance_biases(par.model)]


def param_pieces(par: ParallelModel, mesh: ParallelMesh) -> list[Piece]:
    """Pieces whose live tensor is the compute parameter itself, to be filled from the
    saved `master` (the optimizer's `params_read_on_load`: ZeRO stages 1 and 2, where each
    rank holds its whole tp-local parameters). Empty where the optimizer's `finish_load`
    derives the parameters from the loaded masters instead."""
    out = []
    for name, p in par.optimizer.params_read_on_load():
        box = tp_box(name, par.placements.of(p), tuple(p.shape), mesh)
        if box is not None:
            out.append(Piece(name, "master", *box, 0, math.prod(box[1]),
                             _valid(p.data, box[1]), False))
    return out


def initial_pieces(par: ParallelModel, mesh: ParallelMesh, kind: str) -> list[Piece]:
    """What starting weights fill on this rank (`--init-from`): the fp32 masters, and the
    compute parameters where the optimizer reads them directly."""
    return [p for p in pieces(par, mesh, kind) if p.state == "master"] + param_pieces(par, mesh)


def covering_box(p: Piece) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The rows of `p`'s box that hold elements [start, stop), every other axis whole:
    (offset in the global tensor, shape, elements of it before `start`). A reader that
    can only fetch rectangles (safetensors slices, DCP chunks) reads this and cuts the
    flat run out (`cut`)."""
    row = math.prod(p.box_shape[1:])
    r0, r1 = p.start // row, -(-p.stop // row)
    offset = (p.box_offset[0] + r0, *p.box_offset[1:])
    return offset, (r1 - r0, *p.box_shape[1:]), p.start - r0 * row


def cut(block: torch.Tensor, p: Piece, skip: int) -> torch.Tensor:
    """Elements [start, stop) of `p` from its covering box `block` (see covering_box)."""
    return block.reshape(-1)[skip:skip + p.stop - p.start]
