"""Stopping at a step boundary, with a final checkpoint (`plait train --checkpoint-on-stop`).

A checkpoint is a collective: every rank writes its pieces of the same step. A signal
reaches the ranks at different moments, inside different operations, so a rank cannot
save where the signal finds it. Instead the CLI's handler only records the signal in a
`StopRequest`; `train()` asks `agreed_stop` at each step boundary, before the next step
starts: one all-reduce (max) of the recorded signal number over the world (4 bytes,
ledger tag "stop", outside the step). Every rank gets the same answer at the same step,
so when any rank was signalled they all save the completed steps (`save_on_stop`) and
raise `StoppedAtBoundary`; the CLI turns that into 128 + the signal.

Without the option nothing here runs: a rank stops at its next Python instruction
(plait/launch/local.py), and no collective is added to the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from plait import comm
from plait.checkpoint import Checkpointing, save
from plait.checkpoint.format import step_dir
from plait.config import Config
from plait.mesh import ParallelMesh
from plait.parallel.parallelize import ParallelModel


@dataclass
class StopRequest:
    """The first stop signal this rank received (0: none). Set from a signal handler,
    read by `train()` at step boundaries; nothing else happens in the handler."""

    signum: int = 0

    def request(self, signum: int) -> None:
        if not self.signum:
            self.signum = signum


class StoppedAtBoundary(Exception):
    """Every rank stopped at the same step boundary; `checkpoint`: what it committed."""

    def __init__(self, signum: int, steps_done: int, checkpoint: Path | None):
        self.signum, self.steps_done, self.checkpoint = signum, steps_done, checkpoint
        super().__init__(f"stopped by signal {signum} after {steps_done} steps")


def agreed_stop(stop: StopRequest, mesh: ParallelMesh) -> int:
    """The signal any rank recorded (the largest number), 0 for none: the same answer on
    every rank, so all stop at the same boundary. Collective over the world."""
    flag = torch.tensor([stop.signum], dtype=torch.int32, device=mesh.device.torch)
    with mesh.ledger.outside_step():
        comm.all_reduce(flag, mesh, "world", "max", tag="stop")
    return int(flag.item())


def save_on_stop(checkpoint: Checkpointing, par: ParallelModel, mesh: ParallelMesh,
                 cfg: Config, steps_done: int, progress: dict) -> Path | None:
    """Commit a background save in flight, then the state after `steps_done` steps
    (synchronously) unless that step is already committed. Collective over the world."""
    checkpoint.finish()
    if checkpoint.dir is None:
        return None
    target = step_dir(Path(checkpoint.dir), steps_done)
    if checkpoint.saved and checkpoint.saved[-1].name == target.name:
        return checkpoint.saved[-1]
    path = save(par, mesh, cfg, Path(checkpoint.dir), steps_done, progress, checkpoint.keep)
    assert isinstance(path, Path)  # a synchronous save returns the committed directory
    checkpoint.saved.append(path)  # the stop's own line names it: not told here
    return path
