"""`Dimension`: what every layer of plait needs to know about one parallel dimension.

A dimension's record names its config field and CLI flag, checks its settings, says which
process groups the mesh makes for it, what is summed over its ranks, how checkpoints treat
its ranks, and what it divides for the planner, which sizes it searches and which
planned sizes it refuses. Code outside the dimension's own strategy module reads these
fields instead of naming the dimension: the mesh builds groups from them, the training
loop reduces the loss over the dimensions that say so, the checkpoint writer picks its
writing ranks from them, the planner sizes a layout from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# plait.config.Config, the layer above: a record's checks read its model, parallel and
# train settings
Config = Any
# plait.plan's types, a layer above too: a planned layout (`Layout`: `sizes` by record
# name, `sp`, `replicas`, `seq_split`) and the model's shape (`Shape`: seq, heads,
# kv_heads, layers, experts, moe)
Planned = Any
ModelShape = Any


def _every_size(sizes: list[int], shape: ModelShape, ranks_per_node: int) -> list[int]:
    return sizes

# What a dimension's ranks divide between them (the planner's and the docs' vocabulary).
SPLITS = ("batch", "layers", "sequence", "hidden", "experts")
# How a checkpoint treats the ranks along a dimension (plait/checkpoint/pieces.py):
# "copies": they hold the same pieces, coordinate 0 writes them; "gathered": their shards
# are gathered to coordinate 0, which writes the whole; "owned": each writes the pieces it
# alone holds (a pipeline stage's layers, an expert rank's experts).
CHECKPOINT_ROLES = ("copies", "gathered", "owned")


def divisors_text(n: int) -> str:
    """n's divisors, "1, 2, 4": what a check offers in place of a size that does not
    divide n."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class Setting:
    """A setting of the dimension beside its size: `--flag` sets `parallel.<key>`."""

    key: str  # the ParallelConfig field
    choices: tuple[str, ...]  # empty for an integer setting
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


@dataclass(frozen=True)
class Dimension:
    name: str  # the ParallelConfig field, the `--<name>` flag and the mesh group's name
    title: str  # what users call it ("context parallel")
    strategy: str  # the module that applies it to the model
    splits: str  # what its ranks divide (SPLITS)
    # an axis of the rank grid (world = the product of the axes' sizes); False: laid over
    # the replica axes' ranks (their ranks are cut into its own groups, `laid_ranks`)
    axis: bool = True
    # its ranks hold whole copies of the parameters: gradients are summed over the product
    # of these dimensions, ZeRO shards over it, and a dimension laid over others uses its
    # ranks
    replicates_params: bool = False
    # the logged loss of a step is a sum of partial sums along it (each rank saw a part of
    # the tokens, or a stage computed it)
    sums_loss: bool = False
    checkpoint: str = "copies"  # CHECKPOINT_ROLES
    settings: tuple[Setting, ...] = ()
    # the process groups it adds beyond an axis's own; for a laid dimension, the name of
    # each group and the function that cuts this rank's group from the replica ranks
    # (given the replica ranks in order, this rank's position, and every laid size); the
    # last group is the one whose ranks hold copies of the same slice (the grad norm and
    # checkpoints count one of them, plait/placement.py)
    laid_groups: tuple[str, ...] = ()
    laid_ranks: Callable[[str, list[int], int, dict[str, int]], list[int]] | None = None
    color: str = "#7f7f7f"  # its collectives on timelines
    help: str = ""  # the `--<name>` flag's help
    problems: Callable[[Config], list[str]] = field(default=lambda cfg: [])
    # the planner (plait/plan/search.py): of the divisors of the ranks left for it (an
    # axis) or of the replicas (a laid dimension), the sizes its search tries for the
    # model `shape` on nodes of `ranks_per_node` (a laid dimension: the consecutive
    # replica ranks one node holds); and every reason a planned layout's size is invalid,
    # each naming the fix (the planner's words: flags, not config fields)
    plan_sizes: Callable[[list[int], ModelShape, int], list[int]] = _every_size
    plan_problems: Callable[[Planned, ModelShape], list[str]] = field(
        default=lambda lay, shape: [])
    # the words a run's layout line adds for the dimension's settings (its mode, ...),
    # from the parallel config; nothing where the size alone says it
    words: Callable[[Any], list[str]] = field(default=lambda p: [])

    @property
    def field(self) -> str:
        return f"parallel.{self.name}"
