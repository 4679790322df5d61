"""Jobs that survive a dead rank: `plait train --max-restarts R --checkpoint-dir D`.

    plait train (run_elastic)            attempt 0, 1, ... R
      └─ the torchrun shim and its ranks  (plait/launch/local.py), one launch per attempt

When a rank dies (an error, SIGKILL, the machine's OOM killer), torch's agent notices
within its monitor interval (0.1 s), terminates the other ranks (SIGTERM, SIGKILL 5 s
later: plait/launch/local.py shortens torch's 30 s) and exits, writing which rank failed first
and how to the file this launcher named (`FAILURE_FILE_ENV`). The launcher then starts
every rank again, on a fresh rendezvous store, resuming from the newest COMMITTED checkpoint in D
(plait/checkpoint: a checkpoint without its marker is never loaded), and says so in one
line: which rank died, its exit status or signal, the step resumed from and the steps
lost. After R restarts the next failure ends the run (exit 1). A stop signal to the
launcher, or bad input, is never restarted.

Resume is exact (docs/checkpoint.md): a restarted run's losses and final parameters are
bit-identical to an uninterrupted run's on the same layout. The steps after the last
checkpoint are trained again: the *lost steps*. Rank 0 logs each step's row to a progress
file in the launcher's state directory; the launcher keeps the rows before the resume
step, and the next attempt's rank 0 writes them first to its metrics file, so the metrics
hold the whole run once, and its summary the restarts (`restarts`, `lost_steps`,
`restart_log`: per restart the rank, exit, last step logged, step resumed from, and the
wall-clock times the agent saw the failure, every rank was gone, the ranks were launched
again and the first step after the restart was done).

This is the CLI layer: it reads the environment (the test-only fault below) and starts
processes. With --nnodes > 1 every node's launcher runs plait/launch/nodes_elastic.py's
loop instead, which agrees on the checkpoint across the launchers and reuses `Progress`,
`next_attempt` and `Restart` from here.

Test-only fault injection: `PLAIT_TEST_FAULT=kill:RANK:STEP` makes that rank SIGKILL
itself right after step STEP's row is logged, on the first attempt only;
`kill:RANK:STEP:every` on every attempt; `stop:...` SIGSTOPs it instead (a stalled rank,
for the hang watchdog, plait/launch/watchdog.py); `extra:...` makes it enter one collective the
others never do (equally: the others skipped one), so that from then on the ranks' calls
on that dim are out of step; `slow:RANK:SECONDS` makes that rank sleep SECONDS inside
every step, as it takes its micro-batches (a straggler, for plait/train/stragglers.py).
Read here, by the rank entry, nowhere else.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.checkpoint.format import checkpoints

FAILURE_FILE_ENV = "PLAIT_FAILURE_FILE"  # where the torchrun shim says which rank failed
FAULT_ENV = "PLAIT_TEST_FAULT"
FAULT_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}  # a dead or a stalled rank


# ---- the launcher's side ---------------------------------------------------------------
def exit_text(code: int | None) -> str:
    """'status 1', 'signal SIGKILL' (a negative code: killed by it), 'status 143 (SIGTERM)'."""
    if code is None:
        return "an unknown status"
    with contextlib.suppress(ValueError):
        if code < 0:
            return f"signal {signal.Signals(-code).name}"
        if code > 128:
            return f"status {code} ({signal.Signals(code - 128).name})"
    return f"status {code}"


def write_failure(failures: dict, path: str | None) -> None:
    """In the torchrun shim: record the first rank to fail (torch's ProcessFailures by
    global rank) for the launcher. A rank killed by a signal counts first among those
    that failed within the same second (the others most likely lost their peer)."""
    if not path or not failures:
        return
    rank, first = min(failures.items(), key=lambda kv: (kv[1].timestamp, kv[1].exitcode >= 0))
    data = {"rank": int(rank), "local_rank": first.local_rank, "exitcode": first.exitcode,
            "failed": sorted(int(r) for r in failures), "detected_at": time.time()}
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


@dataclass
class Restart:
    """One restart, as the summary's `restart_log` holds it."""

    attempt: int  # the attempt that now starts (1 = the first restart)
    rank: int | None  # the rank that died first (None: unknown, e.g. the agent died)
    exit: str
    last_step: int | None  # the last step rank 0 logged before the failure
    resumed_from: int  # the step the next attempt starts at
    checkpoint: str | None
    lost_steps: int  # steps logged after the checkpoint: trained again
    detected_at: float | None  # wall clock: the agent saw the failure
    down_at: float  # every rank of the failed attempt gone
    relaunched_at: float = 0.0
    who: str | None = None  # what died, where not a rank (a whole node: multinode_elastic)

    def line(self, max_restarts: int) -> str:
        who = self.who or (f"rank {self.rank}" if self.rank is not None
                           else "the launcher's agent")
        after = f" after step {self.last_step}" if self.last_step is not None else ""
        src = f"checkpoint {self.checkpoint}" if self.checkpoint else "no checkpoint yet"
        return (f"plait: restart {self.attempt} of {max_restarts}: {who} died ({self.exit})"
                f"{after}; resuming from step {self.resumed_from} ({src}); "
                f"{self.lost_steps} steps lost")


@dataclass
class Progress:
    """What survives the attempts: the rows before each resume point, the restarts."""

    state_dir: Path
    rows: list[dict] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)

    def state_file(self, attempt: int) -> Path:
        path = self.state_dir / f"state-{attempt}.json"
        path.write_text(json.dumps({"attempt": attempt, "rows": self.rows, "restarts": [
            r.__dict__ for r in self.restarts]}))
        return path

    def attempt_rows(self, attempt: int) -> list[dict]:
        path = self.state_dir / f"state-{attempt}.json.rows"
        with contextlib.suppress(OSError):
            return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
        return []


def read_failure(path: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return {}


def run_elastic(max_restarts: int, checkpoint_dir: str, rank_args: list[str],
                launch: Callable[[list[str], dict[str, str], list[int]], int]) -> int:
    """Launch the ranks (`launch(rank_args, extra_env, received_signals)` returns the exit
    status) and relaunch them after a failure, up to `max_restarts` times."""
    progress = Progress(Path(tempfile.mkdtemp(prefix="plait-elastic-")))
    args = list(rank_args)
    try:
        for attempt in range(max_restarts + 1):
            failure_file = progress.state_dir / f"failure-{attempt}.json"
            received: list[int] = []
            code = launch([*args, "--elastic-state", str(progress.state_file(attempt))],
                          {FAILURE_FILE_ENV: str(failure_file)}, received)
            if code == 0 or code == 2 or received:  # done, bad input, stopped by the user
                return code
            restart = next_attempt(attempt, progress, read_failure(failure_file),
                                    Path(checkpoint_dir))
            if attempt == max_restarts:
                who = f"rank {restart.rank}" if restart.rank is not None else "the job"
                print(f"plait: {who} died ({restart.exit}); no restarts left "
                      f"(--max-restarts {max_restarts}); the last checkpoint is "
                      f"{restart.checkpoint or 'none'}", file=sys.stderr, flush=True)
                return 1
            print(restart.line(max_restarts), file=sys.stderr, flush=True)
            restart.relaunched_at = time.time()
            progress.restarts.append(restart)
            if restart.checkpoint:  # the newest committed one (the flag given last wins)
                args = [*rank_args, f"--resume={Path(checkpoint_dir).resolve()}"]
        return 1
    finally:
        shutil.rmtree(progress.state_dir, ignore_errors=True)


def next_attempt(attempt: int, progress: Progress, failure: dict, root: Path,
                 new_rows: list[dict] | None = None) -> Restart:
    """After attempt `attempt` failed: where the next one resumes, what was lost.
    `new_rows`: the rows rank 0 logged in that attempt, where another node's launcher
    holds them (default: this launcher's own progress file)."""
    down_at = time.time()
    committed = [(step, path) for step, path, done in checkpoints(root) if done]
    new_rows = progress.attempt_rows(attempt) if new_rows is None else new_rows
    rows = progress.rows + new_rows
    first = rows[0]["step"] if rows else 0
    step, path = committed[0] if committed else (first, None)
    progress.rows = [r for r in rows if r["step"] < step]
    last = rows[-1]["step"] if rows else None
    lost = sum(1 for r in new_rows if r["step"] >= step)
    return Restart(attempt + 1, failure.get("rank"), exit_text(failure.get("exitcode")),
                   last, step, str(path) if path else None, lost,
                   failure.get("detected_at"), down_at)


# ---- the rank's side -------------------------------------------------------------------
class ElasticState:
    """What the launcher hands a rank of attempt N: the rows kept from earlier attempts
    (rank 0 writes them first to its metrics), the restarts so far (for the summary), and
    the progress file rank 0 logs each row to."""

    def __init__(self, path: str):
        data = json.loads(Path(path).read_text())
        self.attempt: int = data["attempt"]
        self.rows: list[dict] = data["rows"]
        self.restarts: list[dict] = data["restarts"]
        self._log = Path(path + ".rows")

    def log(self, row: dict) -> None:
        if self.restarts and "resumed_at" not in self.restarts[-1]:
            self.restarts[-1]["resumed_at"] = time.time()  # the first step after it done
        with open(self._log, "a") as f:
            f.write(json.dumps(row) + "\n")

    def summary(self) -> dict:
        return {"restarts": len(self.restarts),
                "lost_steps": sum(r["lost_steps"] for r in self.restarts),
                "restart_log": self.restarts}


class _SlowBatches:
    """The run's batches, handed out `seconds` late each step (inside the step's timing,
    outside any collective: compute time, as a slow device's would be)."""

    def __init__(self, batches: Any, seconds: float):
        self._batches, self._seconds = batches, seconds

    def local_batch(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self._seconds)
        return self._batches.local_batch(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batches, name)


def slowed(batches: Any, rank: int) -> Any:
    """Test-only (`PLAIT_TEST_FAULT=slow:RANK:SECONDS`, module doc): this rank's batches,
    late by SECONDS every step; anything else leaves them as they are."""
    parts = os.environ.get(FAULT_ENV, "").split(":")
    if len(parts) == 3 and parts[0] == "slow" and int(parts[1]) == rank:
        return _SlowBatches(batches, float(parts[2]))
    return batches


def inject_fault(rank: int, step: int, attempt: int,
                 extra_collective: Callable[[], None] | None = None) -> None:
    """Test-only (`PLAIT_TEST_FAULT`, module doc): SIGKILL (kill) or SIGSTOP (stop) this
    rank after `step`, or enter `extra_collective` there (extra), which no other rank does."""
    parts = os.environ.get(FAULT_ENV, "").split(":")
    if len(parts) < 3 or parts[0] not in (*FAULT_SIGNALS, "extra"):
        return
    every = parts[3:] == ["every"]
    if int(parts[1]) == rank and int(parts[2]) == step and (attempt == 0 or every):
        sys.stdout.flush()
        sys.stderr.flush()
        if parts[0] == "extra":
            if extra_collective is not None:
                extra_collective()
            return
        os.kill(os.getpid(), FAULT_SIGNALS[parts[0]])
