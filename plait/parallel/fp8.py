"""`train.precision = "fp8"`: the blocks' linear layers multiply in float8, applied from
outside the model like any strategy (plait/model/fp8.py has the numerics).

Which layers: every linear inside a transformer block (attention's projections, GQA's or
MLA's, and the SwiGLU MLP's three), plain or tensor-parallel. What stays in bf16: the
token embedding, the LM head (the logits feed a softmax over the vocabulary), the norms,
attention's softmax, and everything that is not a GEMM; the optimizer keeps fp32 masters
as with bf16. In MoE blocks the shared experts' linears turn float8 with the rest, and
under the blockwise recipe the routed experts too (`Float8ExpertsForward`: each expert's
three GEMMs); the router stays in fp32. The config checks refuse MoE models under the
tensorwise recipe (its per-tensor scales have no grouped-expert form here).

The swap keeps each module, its parameter and its name: its class becomes a subclass of
its own with a float8 forward, so checkpoints, the placement table, ZeRO's units and any
isinstance test see the same module. Where a linear's tensors are split over ranks (tp
shards weights and the row-parallel inputs; context parallel splits the sequence), its
amaxes are all-reduced (max) over those dims: every rank scales by the whole tensor's amax, the
single-process run's scale (plait/model/fp8.py). The blockwise recipe
(`train.fp8_recipe`, plait/model/fp8_blockwise.py) reduces nothing: the config checks make
every rank's share of a width or of a sequence whole tiles, so each tile's amax is local.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache, partial

import torch
from torch import nn

from plait import comm
from plait.dims import DIMENSIONS
from plait.mesh import ParallelMesh
from plait.model.fp8 import Float8Settings, float8_linear
from plait.model.fp8_blockwise import blockwise_experts, blockwise_linear
from plait.model.moe import Experts
from plait.model.transformer import Block
from plait.parallel.tensor import ColumnParallelLinear, RowParallelLinear

LINEARS = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
# the dims whose ranks hold parts of one linear's tensors in a micro-batch: those that
# split the hidden width (tensor parallel) or the sequence (context parallel)
SPLITTING_DIMS = tuple(d.name for d in DIMENSIONS if d.splits in ("hidden", "sequence"))
AMAX_TAG = "fp8.amax"  # a control collective: a few floats (plait/ledger.py CONTROL_TAGS)


class Float8Forward:
    """The float8 forward mixed into a linear's own class (`float8_class`)."""

    fp8: Float8Settings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        enter = getattr(self, "enter", None)  # a column-parallel linear's region entry
        if enter is not None:
            x = enter(x)
        if self.fp8.recipe == "blockwise":
            return blockwise_linear(x, self.weight, self.fp8)
        return float8_linear(x, self.weight, self.fp8)


class Float8ExpertsForward:
    """The routed experts' blockwise float8 forward, mixed into `Experts`."""

    fp8: Float8Settings

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:  # nothing routed here: the experts' own path keeps the graph
            return super().forward(x, counts)
        return blockwise_experts(x, counts, self.w1, self.w2, self.w3, self.fp8)


@cache
def float8_class(cls: type, mixin: type = Float8Forward) -> type:
    """`cls` with the float8 forward `mixin` (one class per module class)."""
    return type(f"Float8{cls.__name__}", (mixin, cls), {})


def is_float8(module: nn.Module) -> bool:
    return isinstance(module, Float8Forward)


def float8_linears(root: nn.Module, kinds: tuple[type, ...] = LINEARS) -> list[nn.Module]:
    """The linears (or other `kinds`) of every block under `root` (a model or a pipeline
    stage): with MoE, the shared experts' linears; the router is not a linear."""
    out = []
    for block in (m for m in root.modules() if isinstance(m, Block)):
        out += [m for m in block.modules() if isinstance(m, kinds)]
    return out


def _reduce_amax(mesh: ParallelMesh, dims: tuple[str, ...], amax: torch.Tensor) -> None:
    for dim in dims:
        comm.all_reduce(amax, mesh, dim, op="max", tag=AMAX_TAG)


def apply_float8(stages: Iterable[nn.Module], mesh: ParallelMesh, recipe: str = "tensorwise",
                 block: int = 128) -> int:
    """Swap every block linear of `stages` to float8 under `recipe` ("tensorwise", or
    "blockwise" in tiles of `block`: the module docstring); returns how many."""
    dims = tuple(d for d in SPLITTING_DIMS if mesh.size(d) > 1)
    tensorwise = recipe == "tensorwise"
    reduce = partial(_reduce_amax, mesh, dims) if dims and tensorwise else None
    count = 0
    for stage in stages:
        for m in float8_linears(stage):
            if getattr(m, "bias", None) is not None:
                raise ValueError("float8 linears take no bias; plait's blocks have none")
            if not is_float8(m):
                m.__class__ = float8_class(type(m))
                m.fp8 = Float8Settings(reduce_amax=reduce, recipe=recipe, block=block)
                count += 1
        for m in float8_linears(stage, (Experts,)) if not tensorwise else ():
            if not isinstance(m, Float8ExpertsForward):
                m.__class__ = float8_class(type(m), Float8ExpertsForward)
                m.fp8 = Float8Settings(recipe=recipe, block=block)
                count += 1
    return count
