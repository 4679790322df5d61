"""What this rank holds of each named tensor, as pieces of the global tensors.

A `Piece` is this rank's live tensor for (parameter name, state) placed in the global,
unpadded tensor: a box (the tensor-parallel slice, from the PlacementTable's `Split`;
the whole tensor otherwise) and elements [start, stop) of it (ZeRO's flat shard, from
`ZeroOptimizer.shard_index()`; the whole box otherwise). States are the optimizer's fp32
ones: `master` and, for AdamW, `exp_avg` and `exp_avg_sq`. The compute-dtype parameter is
not saved: after every update it is exactly `master` cast to the compute dtype (both
optimizers publish it so), and `publish` makes it so again after a load.

`write` marks the one holder that saves a piece: replicas are written once, by the rank
at coordinate 0 of every dim the piece is replicated over (the grad norm's rule,
`PlacementTable.counts_in_norm`); DualPipe's second copies are never written (they equal
the owned copies) but are filled on load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plait.mesh import ParallelMesh
from plait.model.moe import MoE
from plait.parallel.parallelize import ParallelModel
from plait.parallel.replicated import ReplicatedOptimizer, TwoCopyOptimizer
from plait.parallel.zero import ZeroOptimizer
from plait.placement import Placement

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
    """Every piece this rank holds of the optimizer's fp32 states."""
    opt = par.optimizer
    if isinstance(opt, ZeroOptimizer):
        return _zero_pieces(par, mesh) + state_pieces(par, mesh)
    if isinstance(opt, ReplicatedOptimizer):  # TwoCopyOptimizer included
        return _replicated_pieces(par, mesh, kind) + state_pieces(par, mesh)
    raise CheckpointError(f"checkpointing {type(opt).__name__} is not supported")


def state_pieces(par: ParallelModel, mesh: ParallelMesh) -> list[Piece]:
    """Training state that is not a parameter: each MoE block's balancing bias (fp32,
    saved as its `master`), whole on every rank of its stage; written by the rank at
    coordinate 0 of dp, cp and tp, DualPipe's owned copy only."""
    model = par.model
    stages = model.stages.items() if hasattr(model, "stages") else [("0", model)]
    owned = getattr(model, "owned", None)
    first = all(mesh.coord(d) == 0 for d in ("dp", "cp", "tp"))
    out = []
    for s, stage in stages:
        for name, m in stage.named_modules():
            if isinstance(m, MoE):
                n = m.bias.numel()
                write = first and (owned is None or int(s) in owned)
                out.append(Piece(f"{name}.bias", "master", (0,), (n,), 0, n, m.bias, write))
    return out


def named_local(par: ParallelModel) -> list[tuple[str, torch.nn.Parameter, bool]]:
    """(model name, parameter, owned) of every parameter this rank holds, DualPipe's
    second copies included (owned = False)."""
    model = par.model
    if not hasattr(model, "stages"):  # pp == 1: the Transformer, with the model's names
        return [(n, p, True) for n, p in model.named_parameters()]
    return [(n, p, int(s) in model.owned)  # a stage's own names are the model's
            for s, stage in model.stages.items() for n, p in stage.named_parameters()]


def _replicated_pieces(par: ParallelModel, mesh: ParallelMesh, kind: str) -> list[Piece]:
    opt: ReplicatedOptimizer = par.optimizer
    o = opt.optim
    index = {id(p): i for i, p in enumerate(o.params)}
    two_copies = isinstance(opt, TwoCopyOptimizer)
    out = []
    for name, p, owned in named_local(par):
        pl = par.placements.of(p)
        box = tp_box(name, pl, tuple(p.shape), mesh)
        if box is None:
            continue
        i = index[id(p)]
        write = par.placements.counts_in_norm(p, mesh) and (owned or not two_copies)
        tensors = {"master": o.master[i]}
        if kind == "adamw":
            tensors.update(exp_avg=o.exp_avg[i], exp_avg_sq=o.exp_avg_sq[i])
        n = math.prod(box[1])
        out.extend(Piece(name, state, *box, 0, n, _valid(t, box[1]), write)
                   for state, t in tensors.items())
    return out


def _zero_params(par: ParallelModel) -> dict[str, torch.nn.Parameter]:
    opt: ZeroOptimizer = par.optimizer
    names = getattr(par.model, "model_names", {})
    return {names.get(n, n): p for u in opt.units for n, p in zip(u.names, u.params,
                                                                  strict=True)}


def _zero_pieces(par: ParallelModel, mesh: ParallelMesh) -> list[Piece]:
    opt: ZeroOptimizer = par.optimizer
    params = _zero_params(par)
    out = []
    for e in opt.shard_index():
        if e.state == "param":  # the compute copy: master cast (module docstring)
            continue
        p = params[e.name]
        pl = par.placements.of(p)
        box = tp_box(e.name, pl, e.shape, mesh)
        if box is None:
            continue
        n = math.prod(box[1])
        stop = min(e.stop, n)  # padded vocabulary rows are the flat tail of the tensor
        if stop <= e.start:
            continue
        # the shard's own unit's dim: routed experts shard over edp, the rest over dp (x cp)
        write = par.placements.counts_in_norm(p, mesh, also_sharded=(opt.units[e.unit].dim,))
        view = opt.shard_view(e).reshape(-1)[:stop - e.start]
        out.append(Piece(e.name, e.state, *box, e.start, stop, view, write))
    return out


def param_pieces(par: ParallelModel, mesh: ParallelMesh) -> list[Piece]:
    """Pieces whose live tensor is the compute parameter itself, to be filled from the
    saved `master` (ZeRO stages 1 and 2: each rank holds its whole tp-local parameters).
    Empty where `publish` derives the parameters from the loaded masters instead."""
    opt = par.optimizer
    if not isinstance(opt, ZeroOptimizer) or opt.stage == 3:
        return []
    out = []
    for name, p in _zero_params(par).items():
        box = tp_box(name, par.placements.of(p), tuple(p.shape), mesh)
        if box is not None:
            out.append(Piece(name, "master", *box, 0, math.prod(box[1]),
                             _valid(p.data, box[1]), False))
    return out


def optimizer_steps(par: ParallelModel) -> int:
    """The updates the optimizer has made (Adam's bias correction): the step, less any
    skipped for a non-finite gradient."""
    opt = par.optimizer
    return opt.steps if isinstance(opt, ZeroOptimizer) else opt.optim.steps


@torch.no_grad()
def publish(par: ParallelModel, steps: int) -> None:
    """After a load: the compute parameters from the loaded masters where they are not
    read directly, and the optimizer's update count `steps`."""
    opt = par.optimizer
    if isinstance(opt, ZeroOptimizer):
        if opt.stage == 3:
            for u in opt.units:
                u.shard.copy_(u.master)  # as ZeroOptimizer._publish: the next forward gathers
        opt.steps = steps
        return
    o = opt.optim
    for m, p in zip(o.master, o.params, strict=True):
        if m.data_ptr() != p.data_ptr():  # fp32: the master is the parameter's storage
            p.data.copy_(m)
    o.steps = steps
