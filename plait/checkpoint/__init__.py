"""Checkpoints that reshard to any layout (docs/checkpoint.md).

`Checkpointing` is what the training loop drives: `restore` once after `parallelize`
(the step to continue from) and `after_step` after each step (save every N steps and at
the last). The format is format.py; what a rank holds, pieces.py; the save protocol,
writer.py; loading under any layout, reader.py; inspect and consolidate, export.py; the
`plait checkpoint` command and the train flags, cli.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from plait.config import Config
from plait.mesh import ParallelMesh
from plait.parallel.parallelize import ParallelModel

from .format import CheckpointError, CorruptCheckpoint
from .reader import CheckpointWarning, restore
from .writer import save

__all__ = ["CheckpointError", "CheckpointWarning", "Checkpointing", "CorruptCheckpoint",
           "restore", "save"]


@dataclass
class Checkpointing:
    """Where and how often a run saves, and what it resumes from.

    `resume`: None (start fresh), "latest" (the newest complete checkpoint in `dir`, older
    ones if it is corrupt) or a path (a checkpoint directory, no fallback; or a root)."""

    dir: Path | None = None
    every: int = 0  # save after every `every` steps (0: never) and after the last
    keep: int | None = None  # committed checkpoints to keep (None: all)
    resume: str | None = None
    resumed_from: Path | None = None  # set by restore
    saved: list[Path] | None = None

    def problems(self) -> list[str]:
        out = []
        if self.every < 0:
            out.append(f"--checkpoint-every {self.every}: must be >= 1")
        if self.keep is not None and self.keep < 1:
            out.append(f"--keep {self.keep}: must be >= 1 (the newest is always kept)")
        if (self.every or self.keep) and self.dir is None:
            out.append("--checkpoint-every/--keep need --checkpoint-dir D")
        if self.resume == "latest" and self.dir is None:
            out.append("--resume without a path resumes from --checkpoint-dir; give one, "
                       "or --resume PATH")
        return out

    def source(self) -> Path | None:
        if self.resume is None:
            return None
        return Path(self.dir) if self.resume == "latest" else Path(self.resume)

    def restore(self, par: ParallelModel, mesh: ParallelMesh, cfg: Config,
                start_step: int = 0) -> int:
        """Load the checkpoint to resume from, if any; the step to start at."""
        src = self.source()
        if src is None:
            return start_step
        step, self.resumed_from = restore(par, mesh, cfg, src)
        return step

    def after_step(self, step: int, par: ParallelModel, mesh: ParallelMesh, cfg: Config,
                   progress: dict | None = None) -> Path | None:
        """After step `step` (0-based) completed: save when due."""
        done = step + 1
        if not self.every or self.dir is None:
            return None
        if done % self.every and done != cfg.train.steps:
            return None
        path = save(par, mesh, cfg, Path(self.dir), done, progress, self.keep)
        self.saved = [*(self.saved or []), path]
        return path
