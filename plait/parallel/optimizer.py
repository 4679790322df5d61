"""The gradient-sync + optimizer protocol the training loop drives, and the factory.

One object per run owns everything between "backward produced gradients" and "the
parameters are updated": gradient synchronisation over dp, the global grad norm, the
update, and what the memory tracker and the parity oracle read. Implementations:

  * `ReplicatedOptimizer` (plait/parallel/replicated.py), zero = 0: `DataParallel` +
    `MixedPrecisionAdamW` over whole parameters;
  * `TwoCopyOptimizer` (same module), zero = 0 with DualPipe's two model copies;
  * `ZeroOptimizer` (plait/parallel/zero.py), zero = 1, 2, 3 (DualPipe's copies too).

Who calls what, when, in one step (plait/train/loop.py, plait/parallel/pipeline/runtime.py):

1. the pipeline runtime, around each gradient-writing action (B or W) of this rank:
   `before_backward(last)` (`last`: that stage's final B/W of the step: data parallel may
   reduce during it) and `after_backward(last)` (`last`: this rank's final B/W);
2. the loop, once the runtime's step has returned: `finish_gradients()`: when it
   returns the gradients are final (synced over dp, DualPipe's copies summed);
3. `grad_norm()`: the global L2 norm of the step's gradient, each element counted once
   over the mesh (collective over the world);
4. optionally `full_grads()` (the parity check's first-step gradients, collective over dp);
5. `step(lr, grad_scale)`: the update with gradients x grad_scale (the clip coefficient);
6. `zero_grad()`.
The run's replica synchronisation (plait/parallel/replicas/: hybrid sharding's sum,
fault-tolerant replicas') sums `replica_gradients()` in place between 2 and 3.
After the last step: `settle()` (ZeRO-1/2 complete their parameters' all-gathers; every
read of the parameters outside a forward settles first).
Between steps: `full_state()` (collective over dp for ZeRO) and, on the memory step,
`memory_sources()` (read by the memory meter, plait/device/memory.py).

With `parallel.optimizer_sync=post_validation` (plait/parallel/post_validation.py) steps
3 and 5 change: `local_sq_norm()` (this rank's share, no communication) replaces
`grad_norm()`; `snapshot()` before an optimistic `step(lr)`; once the check is in,
`drop_snapshot()`, or `restore()` (exactly the state before) and the right `step`; then
`zero_grad()`.

Checkpoints (plait/checkpoint/pieces.py) read only the protocol, never which strategy it
is: `steps` (the update count, saved), `held_states()` (what this rank holds of each fp32
state of each parameter: whole tensors, or ZeRO's flat runs; the live tensors, written
from and loaded into in place, plait/parallel/held.py), `params_read_on_load()` (compute
parameters a load fills straight from the saved masters) and, once a load has filled
those, `finish_load(steps)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

from plait.config import Config
from plait.mesh import ParallelMesh
from plait.muon import muon_settings
from plait.parallel.held import HeldState
from plait.parallel.replicated import ReplicatedOptimizer, TwoCopyOptimizer
from plait.parallel.zero import ZeroOptimizer
from plait.placement import PlacementTable

if TYPE_CHECKING:
    from plait.parallel.pipeline.partition import PipelineParts


@runtime_checkable
class GradSyncOptimizer(Protocol):
    """Gradient sync over dp + the optimizer, as the training loop drives them and as
    checkpoints save and load it."""

    mesh: ParallelMesh  # what it syncs over; its ledger counts `full_state`'s gathers

    def before_backward(self, last_microbatch: bool) -> None:
        """Before each backward (B or W) of this rank: `last_microbatch` is the stage's
        final one of the step."""

    def after_backward(self, last_microbatch: bool) -> None:
        """After each backward of this rank: `last_microbatch` is the rank's final one."""

    def finish_gradients(self) -> None:
        """Once per step, after every backward of the step: gradients final on return."""

    def grad_norm(self, summed_with: torch.Tensor | None = None) -> float:
        """Global L2 norm of the step's gradient (collective over the world).
        `summed_with` (float64, (1,); only where dp is the whole mesh): summed over dp in
        place, in the norm's own all-reduce where it has one (the loop's logged loss:
        one small collective and one wait for the slowest rank a step less)."""

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """Update with gradients x `grad_scale` (the clipping coefficient)."""

    def zero_grad(self) -> None:
        """Drop the step's gradients (or zero the accumulating shards)."""

    def replica_gradients(self) -> list[torch.Tensor]:
        """The step's final gradients this rank holds, as live tensors (zeros where a
        parameter had none): what the replicas of this rank's state sum in place."""

    def settle(self) -> None:
        """Complete what the update left in flight (ZeRO-1/2's parameter all-gathers, which
        each unit's next forward waits on): the parameters are the updated ones after it."""

    def release_gathered(self) -> None:
        """Free what forwards without a backward (an evaluation) left gathered, so the
        next step starts as it would without them."""

    def local_sq_norm(self) -> torch.Tensor:
        """This rank's share of the squared global norm (float64, (1,)); no communication."""

    def snapshot(self) -> None:
        """Copy what `step` changes (masters, moments, the update count)."""

    def restore(self) -> None:
        """Back to the snapshot, exactly (compute parameters too); the copy is dropped."""

    def drop_snapshot(self) -> None:
        """Forget the snapshot: the update it guarded stands."""

    def full_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, fp32, by its module's names; dp shards gathered (tp
        slices stay slices: plait.train.loop.full_state gathers them)."""

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The gradients `step` will use (synced, before clipping), like `full_state`."""

    def memory_sources(self) -> dict[str, list[torch.Tensor]]:
        """The tensors the strategy holds, by category: params, grads, optimizer, comm."""

    @property
    def steps(self) -> int:
        """The updates made (Adam's bias correction): the steps taken, less any skipped
        for a non-finite gradient."""

    def held_states(self) -> list[HeldState]:
        """What this rank holds of each fp32 state (`master`; AdamW: `exp_avg`,
        `exp_avg_sq`) of each of its parameters, by the model's names, in an order fixed
        by the layout: the live tensors (a checkpoint writes them and loads into them)."""

    def params_read_on_load(self) -> list[tuple[str, nn.Parameter]]:
        """(model name, parameter) of the compute parameters a load fills from the saved
        masters directly (ZeRO-1/2: whole on every rank, their masters sharded); the
        others `finish_load` derives."""

    def finish_load(self, steps: int) -> None:
        """After a load filled `held_states` and `params_read_on_load` in place: the other
        compute parameters from their masters, and the update count `steps`. No
        communication."""


def make_optimizer(model: nn.Module, mesh: ParallelMesh, cfg: Config,
                   placements: PlacementTable, pipeline: PipelineParts | None = None
                   ) -> GradSyncOptimizer:
    """The strategy for cfg.parallel.zero (0: replicated), summing DualPipe's two model
    copies where `pipeline` (this rank's stages) has them."""
    t = cfg.train
    dim = mesh.replica_dim()
    two_copies = pipeline is not None and pipeline.schedule.num_chains > 1
    if cfg.parallel.zero == 0 and two_copies:
        return TwoCopyOptimizer(model, mesh, cfg, placements, pipeline.stages,
                                pipeline.schedule, dim=dim)
    if cfg.parallel.zero == 0:
        return ReplicatedOptimizer(model, mesh, cfg, placements, dim=dim)
    return ZeroOptimizer(model, mesh, cfg.parallel.zero, (t.beta1, t.beta2), t.eps,
                         t.weight_decay, dim=dim, kind=t.optimizer, placements=placements,
                         bucket_mb=cfg.parallel.bucket_mb, gather=cfg.parallel.zero3_gather,
                         copies=pipeline.schedule if two_copies else None,
                         muon=muon_settings(t))
