"""The replica-synchronisation protocol the training loop drives, one call a step, and
the choice of its implementation, made once by `parallelize`.

Replicas are the copies of this rank's state that train other rows of the global batch.
The implementations:

* `InMesh`: every replica is a rank of this job's mesh. The optimizer sums their gradients
  during the backward (data parallel, ZeRO), so a step trains this rank's data-parallel
  slice and nothing more crosses replicas;
* `EveryStep`: hybrid sharding (Zhao et al. 2023, PyTorch FSDP section 3.2.2): ZeRO
  shards inside each shard group, whose ranks reduce their gradients during the
  backward, and the groups are replicas of each other: each reduced shard is summed over
  the ranks holding the same shard once a step (1/N of the gradient crosses between shard
  groups; a ring all-reduce moves 2(M-1)/M of it a rank);
* `Quorum` (quorum.py): fault-tolerant replicas, each a job of its own
  (plait/parallel/fault_tolerance.py): this replica's slots, their gradients summed over
  the live replicas, a lost replica's slots trained here too, a replacement's state
  received from a live replica.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from plait import comm
from plait.mesh import ParallelMesh

if TYPE_CHECKING:
    from plait.parallel.fault_tolerance import FaultTolerantReplicas
    from plait.parallel.optimizer import GradSyncOptimizer

# (index, count) -> this rank's rows of the step's global batch: slice `index` of `count`
Rows = Callable[[int, int], torch.Tensor]
# rows -> their partial loss; their gradients accumulated onto the optimizer's
Train = Callable[[torch.Tensor], torch.Tensor]


class ReplicaSync(Protocol):
    """What the training loop asks of the replicas of this rank's state."""

    def start(self) -> int | None:
        """Before the first step: a replacement receives its state from a live replica and
        returns the step to start at; None where nothing was received."""

    def job_batch(self) -> int:
        """The whole job's rows a step (what the loss is normalised by, whoever trains
        them)."""

    def gradients(self, step: int, rows: Rows, train: Train) -> torch.Tensor:
        """Step `step`: this rank's rows trained by `train`, their gradients summed over
        the replicas; the rank's partial loss."""

    def after_step(self, step: int, row: dict) -> None:
        """After step `step`'s update: its row says who trained it; replacements join."""

    def writes(self) -> bool:
        """Does this rank's replica write checkpoints (one replica does)?"""

    def progress(self, progress: dict) -> None:
        """A checkpoint's record of the run's position: the replicas' part added."""

    def summary(self) -> dict:
        """The replicas' part of the run's summary (empty where there is none)."""


class InMesh:
    """Replicas that are ranks of this job's mesh: the optimizer sums their gradients."""

    def __init__(self, mesh: ParallelMesh, global_batch: int):
        self.mesh, self.global_batch = mesh, global_batch

    def start(self) -> int | None:
        return None

    def job_batch(self) -> int:
        return self.global_batch

    def gradients(self, step: int, rows: Rows, train: Train) -> torch.Tensor:
        return train(rows(self.mesh.coord("dp"), self.mesh.size("dp")))

    def after_step(self, step: int, row: dict) -> None:
        """Nothing: the mesh's replicas are fixed."""

    def writes(self) -> bool:
        return True

    def progress(self, progress: dict) -> None:
        """Nothing: the configuration's global batch is the job's."""

    def summary(self) -> dict:
        return {}


class EveryStep(InMesh):
    """Hybrid sharding's replicas: the optimizer's reduced shards (`replica_gradients`)
    summed over `group`, the ranks holding the same shards, after each step's backward."""

    def __init__(self, mesh: ParallelMesh, global_batch: int, optimizer: GradSyncOptimizer,
                 group: str):
        super().__init__(mesh, global_batch)
        self.optimizer, self.group = optimizer, group

    def gradients(self, step: int, rows: Rows, train: Train) -> torch.Tensor:
        loss = super().gradients(step, rows, train)
        handles = [comm.all_reduce(g, self.mesh, self.group, async_op=True, tag="grads")
                   for g in self.optimizer.replica_gradients()]
        for h in handles:
            h.wait()
        return loss


def replica_sync(mesh: ParallelMesh, global_batch: int, optimizer: GradSyncOptimizer,
                 fault_tolerant: FaultTolerantReplicas | None) -> ReplicaSync:
    """The run's replica synchronisation: the fault-tolerant quorum where this rank is one
    replica of a fault-tolerant job, the every-step sum where the mesh lays replica groups
    over ZeRO's shard groups, else the mesh's own."""
    if fault_tolerant is not None:
        from plait.parallel.replicas.quorum import Quorum

        return Quorum(fault_tolerant, optimizer, mesh)
    copies = mesh.shard_groups()[1]
    if copies is not None:
        return EveryStep(mesh, global_batch, optimizer, copies)
    return InMesh(mesh, global_batch)
