"""Checkpoints that reshard to any layout (docs/checkpoint.md).

`Checkpointing` is what the training loop drives: `restore` once after `parallelize`
(the step to continue from), `after_step` after each step (save every N steps and at the
last) and `finish` after the last (commit a background save). The format is format.py;
what a rank holds, pieces.py; the save protocol, writer.py; loading under any layout,
reader.py; inspect and consolidate, export.py; the `plait checkpoint` command and the
train flags, cli.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from plait.config import Config
from plait.mesh import ParallelMesh
from plait.parallel.parallelize import ParallelModel

from .format import CheckpointError, CorruptCheckpoint
from .reader import CheckpointWarning, restore
from .writer import PendingSave, save

__all__ = ["CheckpointError", "CheckpointWarning", "Checkpointing", "CorruptCheckpoint",
           "PendingSave", "restore", "save"]


@dataclass
class Checkpointing:
    """Where and how often a run saves, and what it resumes from.

    `resume`: None (start fresh), "latest" (the newest complete checkpoint in `dir`, older
    ones if it is corrupt) or a path (a checkpoint directory, no fallback; or a root).
    `background` (--async-checkpoint): a save copies the state to the host and returns;
    a thread writes the files while training goes on, and the next `after_step` (or
    `finish`) commits it: one step later, at the same point on every rank."""

    dir: Path | None = None
    every: int = 0  # save after every `every` steps (0: never) and after the last
    final: bool = False  # save after the last step even when `every` is 0
    keep: int | None = None  # committed checkpoints to keep (None: all)
    resume: str | None = None
    background: bool = False
    resumed_from: Path | None = None  # set by restore
    saved: list[Path] = field(default_factory=list)  # committed by this run, in order
    # per save: step, seconds the training thread was blocked saving, and committing
    timings: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what preflight decided, to be told
    # where a resume and each committed save are told (rank 0's terminal; None: nowhere)
    say: Callable[[str], None] | None = None
    _pending: PendingSave | None = None

    def problems(self) -> list[str]:
        out = []
        if self.every < 0:
            out.append(f"--checkpoint-every {self.every}: must be >= 1")
        if self.keep is not None and self.keep < 1:
            out.append(f"--keep {self.keep}: must be >= 1 (the newest is always kept)")
        if (self.every or self.keep or self.background) and self.dir is None:
            out.append("--checkpoint-every/--keep/--async-checkpoint need --checkpoint-dir D")
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
        self._tell(f"resumed from {self.resumed_from} at step {step}")
        return step

    def after_step(self, step: int, par: ParallelModel, mesh: ParallelMesh, cfg: Config,
                   progress: dict | None = None) -> Path | None:
        """After step `step` (0-based) completed: commit a background save begun a step
        ago; save when due. Returns the directory committed now, if any."""
        committed = self.finish()
        done = step + 1
        last = done == cfg.train.steps
        due = (self.every and done % self.every == 0) or (last and (self.every or self.final))
        if not due or self.dir is None:
            return committed
        start = time.perf_counter()
        out = save(par, mesh, cfg, Path(self.dir), done, progress, self.keep,
                   background=self.background)
        self.timings.append({"step": done, "blocking_s": time.perf_counter() - start})
        if isinstance(out, PendingSave):
            self._pending = out
            return committed
        self._committed(out)
        return out

    def finish(self) -> Path | None:
        """Commit the background save in flight, if any (every rank; the loop calls it
        after the last step)."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        start = time.perf_counter()
        path = pending.commit()
        self.timings[-1]["commit_s"] = time.perf_counter() - start
        self._committed(path)
        return path

    def _committed(self, path: Path) -> None:
        self.saved.append(path)
        self._tell(f"checkpoint saved: {path}")

    def _tell(self, line: str) -> None:
        if self.say is not None:
            self.say(line)
