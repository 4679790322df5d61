"""Fault-tolerant replicas as the loop's replica synchronisation (sync.py's protocol):
the quorum itself, its verdicts, joins and hand-overs, is plait/parallel/fault_tolerance.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plait.mesh import ParallelMesh
from plait.parallel.fault_tolerance import FaultTolerantReplicas, held_tensors
from plait.parallel.optimizer import GradSyncOptimizer

if TYPE_CHECKING:  # sync.py imports this module when a job is fault-tolerant
    from plait.parallel.replicas.sync import Rows, Train


class Quorum:
    """This rank of one fault-tolerant replica (`replicas`; `mesh` and the optimizer are
    the replica's own): each step its slots of the global batch, the gradients summed
    over the live replicas; a replacement starts from a live replica's state."""

    def __init__(self, replicas: FaultTolerantReplicas, optimizer: GradSyncOptimizer,
                 mesh: ParallelMesh):
        self.replicas, self.optimizer, self.mesh = replicas, optimizer, mesh

    def start(self) -> int | None:
        if not self.replicas.joining:
            return None
        steps = torch.zeros(1, dtype=torch.float64, device=self.mesh.device.torch)
        start = self.replicas.join(lambda: [*held_tensors(self.optimizer), steps])
        self.optimizer.finish_load(int(steps.item()))
        return start

    def job_batch(self) -> int:
        return self.replicas.global_batch

    def gradients(self, step: int, rows: Rows, train: Train) -> torch.Tensor:
        """This replica's slots, then the sum over the live replicas (a lost replica's
        slots trained here too where the quorum hands them over)."""
        opt, ft = self.optimizer, self.replicas

        def train_slots(slots: list[int], onto: bool = True) -> torch.Tensor:
            """Train `slots`, their gradients added to those held (`onto`)."""
            loss = torch.zeros(1, dtype=torch.float64, device=self.mesh.device.torch)
            for slot in slots:
                kept = [g.clone() for g in opt.replica_gradients()] if onto else None
                opt.zero_grad()
                loss += train(rows(*ft.rows_of(slot)))
                for g, k in zip(opt.replica_gradients(), kept or [], strict=bool(kept)):
                    g += k
                onto = True
            return loss

        loss = train_slots(ft.slots(), onto=False)
        return ft.sum_gradients(step, opt.replica_gradients, loss, train_slots)

    def after_step(self, step: int, row: dict) -> None:
        """The row names the replicas that trained it; then a replacement is admitted."""
        row["replicas"] = len(self.replicas.epoch.members)
        self.replicas.hand_over(step, self._held_with_steps)

    def writes(self) -> bool:
        return self.replicas.writes()  # they hold the same state: the lowest live writes

    def progress(self, progress: dict) -> None:
        """The whole job's batch, and the replicas it had."""
        progress["data"]["global_batch"] = self.replicas.global_batch
        progress["replicas"] = {"live": len(self.replicas.epoch.members),
                                "of": self.replicas.count}

    def summary(self) -> dict:
        return {"fault_tolerance": self.replicas.summary(self._held_with_steps())}

    def _held_with_steps(self) -> list[torch.Tensor]:
        """What a replacement replica receives: the held state and the update count."""
        return [*held_tensors(self.optimizer),
                torch.tensor([float(self.optimizer.steps)], dtype=torch.float64,
                              device=self.mesh.device.torch)]
