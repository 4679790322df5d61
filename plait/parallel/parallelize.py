"""parallelize(model, mesh, cfg): every strategy applied to a model, in one place, in one order.

This is the only code that knows the order in which strategies are applied. It takes the
plain model built on the meta device (no memory yet: `build_model(..., device="meta")`)
and returns this rank's part of the parallel model: its pipeline stages, materialised on
the mesh's device, and the one gradient-sync + optimizer object the loop drives.

The order, and why:

1. **Recompute** (`train.recompute = "selective" | "full"`, `train.recompute_ops`): a
   `Recompute` setting on the model (plait/model/recompute.py) that the shared block loop
   (`plait.model.transformer.run_blocks`) applies to each block; every stage cut from the
   model inherits it (a stage whose backward is split into I and W recomputes as a whole
   instead: the pipeline runtime).
2. **Pipeline split** (`parallel.pp`, `parallel.schedule`): the layers are cut into model
   stages (balanced by cost) and only the stages this pp rank holds are materialised,
   from the name-seeded init, on `mesh.device`. The split *selects* modules and renames
   nothing, so applying the module swaps below to each stage is the same as applying them
   to the whole model first - and no rank ever holds layers it does not run.
3. **Expert parallel** (MoE models): each MoE block keeps this rank's experts (a slice of
   the stacked weights, a split in the placement table) and dispatches tokens by
   all-to-all (plait/parallel/expert.py). Before TP, so that the
   sequence-parallel gradient hooks land on the slices; every MoE block also gets its
   balance-loss scale and, where a sequence is split over ranks, its count reduction.
4. **Tensor + sequence parallel** (`parallel.tp`, `parallel.sp`): module swaps on each stage
   (column/row-parallel linears, vocab-parallel embedding and head, the vocab-parallel
   loss), on the tp group of the stage's pp coordinate; each swapped parameter's split is
   recorded in the placement table.
   **Float8** (`train.precision = "fp8"`): every block linear, plain or tensor-parallel,
   multiplies in float8 (plait/parallel/fp8.py); after tp so that it sees the split.
5. **Context parallel** (its size, mode and layout): each attention's parameter-free `core`
   is swapped for ring (or all-gather) attention over its group
   (plait/parallel/context.py); it composes with TP because it sees only
   this tp rank's heads, and after the split because a core holds no parameters. This
   rank's token positions come back with the parts (`ParallelModel.positions`): the
   runtime indexes each sequence's inputs and targets with them and RoPE rotates by them.
6. **Data parallel / ZeRO** (`parallel.dp`, `parallel.zero`, `parallel.data_parallel`): the
   gradient-sync + optimizer object over the local parameters (`make_optimizer`: replicated
   with naive or bucketed all-reduce, ZeRO 1-3, or DualPipe's two copies summed), over
   the replica axes (the mesh's product group of the dimensions whose ranks hold parameter
   copies: plait/dims/).
7. **Compile** (`train.compile`): each block's forward compiled (plait/parallel/compile.py),
   last, so that every module swap and hook is in place and the communicating ones are
   marked as graph breaks.
8. **Replica synchronisation** (plait/parallel/replicas/): how the copies of this rank's
   state that train other rows agree each step, chosen once: the mesh's own (the
   optimizer of 6. sums them), or a fault-tolerant job's quorum.

Every strategy records where it put each parameter in one `PlacementTable`, returned with
the parts: the grad norm, full-state gathering and the ZeRO shard index read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from plait.config import Config
from plait.mesh import ParallelMesh
from plait.model.precision import compute_dtype
from plait.model.recompute import Recompute
from plait.model.transformer import Transformer, fill_in_place
from plait.parallel.compile import compile_blocks
from plait.parallel.context import context_parallel_stages
from plait.parallel.expert import prepare_moe_blocks
from plait.parallel.optimizer import GradSyncOptimizer, make_optimizer
from plait.parallel.pipeline.partition import Partition, PipelineParts, Stage, build_pipeline
from plait.parallel.replicas.sync import ReplicaSync, replica_sync
from plait.placement import PlacementTable
from plait.schedule.ir import Schedule

if TYPE_CHECKING:
    from plait.parallel.fault_tolerance import FaultTolerantReplicas


def model_dtype(cfg: Config) -> torch.dtype:
    """The parameters' and activations' dtype of `cfg.train` (fp8: bf16, or its
    `fp8_compute`, with the blocks' linears in float8: plait/parallel/fp8.py)."""
    return compute_dtype(cfg.train.precision, cfg.train.fp8_compute)


@dataclass
class ParallelModel:
    """This rank's part of the parallel model, as `parallelize` made it."""

    model: nn.Module  # the Transformer when pp == 1, else this rank's PipelineModule
    stages: dict[int, Stage]  # schedule stage id -> module (pp == 1: one, the whole model)
    schedule: Schedule  # the action lists (pp == 1: F, B per micro-batch)
    partition: Partition  # the layers of each model stage
    optimizer: GradSyncOptimizer  # gradient sync over dp + the update
    placements: PlacementTable  # where each of this rank's parameters lives
    # how the replicas of this rank's state agree each step (plait/parallel/replicas/)
    replicas: ReplicaSync
    # a split sequence: this rank's token positions in each one (int64); None: all
    positions: torch.Tensor | None = None

    @property
    def pipeline(self) -> PipelineParts:
        return PipelineParts(self.model, self.stages, self.schedule, self.partition)


def parallelize(model: Transformer, mesh: ParallelMesh, cfg: Config,
                shard_init: bool = False, replicas: FaultTolerantReplicas | None = None
                ) -> ParallelModel:
    """Apply every strategy of `cfg.parallel` to `model` (built on the meta device) for this
    rank of `mesh`, in the order of this module's docstring.

    `shard_init` (the dry run, plait/observe/dry_run.py): the stages are allocated but not
    written until expert and tensor parallel have cut them, then each kept tensor is
    filled at its own size (`fill_in_place`): no full stage is ever written, so the host
    holds one rank's slices and initialises only those. The values are then not the
    reference's slices (a dry run's values are meaningless); a real run keeps `False`:
    slices of the full name-seeded init.

    `replicas`: this rank's fault-tolerant replica, where the job is one
    (plait/parallel/fault_tolerance.py; `mesh` and `cfg` are the replica's own): the
    replicas then agree through its quorum (plait/parallel/replicas/)."""
    on_meta = {p.device.type for p in model.parameters()}
    if on_meta != {"meta"}:
        raise ValueError("parallelize takes the model built on the meta device "
                         "(build_model(cfg, seed, device='meta')): each rank materialises "
                         f"only the layers it holds; got parameters on {sorted(on_meta)}")
    placements = PlacementTable()
    model.recompute = Recompute.of(cfg.train.recompute, cfg.train.recompute_ops)  # 1.
    pipe = build_pipeline(cfg, mesh.coord("pp"), model_dtype(cfg),  # 2. pp
                          placements, model=model, device=mesh.device.torch,
                          fill=not shard_init)
    prepare_moe_blocks(pipe.stages.values(), mesh, cfg, placements)  # 3. (before tp)
    _tensor_parallel(pipe, mesh, cfg, placements)  # 4. tp + sp
    if cfg.train.precision == "fp8":  # 4b. after tp: the swapped linears turn float8 too
        from plait.parallel.fp8 import apply_float8

        apply_float8(pipe.stages.values(), mesh, cfg.train.fp8_recipe, cfg.train.fp8_block)
    if shard_init:  # in place: the parameter objects the hooks and placements know stay
        for stage in pipe.stages.values():
            fill_in_place(stage, cfg.model, cfg.train.seed)
    positions = context_parallel_stages(pipe.stages, mesh, cfg)  # 5.
    optimizer = make_optimizer(pipe.model, mesh, cfg, placements, pipe)  # 6. dp / ZeRO
    if cfg.train.compile:  # 7. each block's forward, once every swap and hook is in place
        compile_blocks(pipe.stages.values(), cfg.train.compile_backend)
    sync = replica_sync(mesh, cfg.train.global_batch, optimizer, replicas)  # 8.
    return ParallelModel(pipe.model, pipe.stages, pipe.schedule, pipe.partition, optimizer,
                         placements, sync, positions)


def _tensor_parallel(pipe: PipelineParts, mesh: ParallelMesh, cfg: Config,
                     placements: PlacementTable) -> None:
    """Module swaps on each stage, on the tp group of its own pp coordinate: the first
    stage holds the vocab-parallel embedding, the last the vocab-parallel head and loss."""
    if cfg.parallel.tp == 1:
        return
    from plait.parallel.tensor import apply_tensor_parallel

    pp = cfg.parallel.pp > 1
    for stage in pipe.stages.values():
        # a tp slice of a stage's parameter keeps the stage's placement (distinct per pp)
        stage.loss_fn = apply_tensor_parallel(stage, mesh, sp=cfg.parallel.sp, partial=pp,
                                              placements=placements,
                                              async_tp=cfg.parallel.async_tp).loss_sum
    if not pp:  # the one stage shares the model's blocks; re-point the model's ends
        pipe.model.embed, pipe.model.head = pipe.stages[0].embed, pipe.stages[0].head


def gather_split_state(model: nn.Module, mesh: ParallelMesh, placements: PlacementTable | None,
                       state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (this rank's tensors by `model`'s names) made whole along every dimension
    that splits parameters: expert slices all-gathered, then tp shards (their padding
    cut). Collective over those groups; a no-op where they are one rank."""
    from plait.parallel import expert, tensor

    for dim, gather in ((expert.DIM, expert.gather_expert_state),
                        (tensor.DIM, tensor.gather_full_state)):
        if mesh.size(dim) == 1:
            continue
        if placements is None:
            raise ValueError(f"gathering {dim}-split parameters needs the run's placements")
        state = gather(model, mesh, placements, state)
    return state

