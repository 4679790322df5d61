"""`plait train --fault-tolerance`: one launch per replica, a dead replica replaced
while the others train on.

    plait train (run_replicas)            hosts the job's store, writes the metrics
      ├─ torchrun shim, replica 0 (gen 0)  its own ranks, every other dimension inside
      ├─ torchrun shim, replica 1 (gen 0)
      └─ torchrun shim, replica 1 (gen 1)  a replacement, joining from a live replica

Each replica (a dp_replicate group) is its own torchrun launch with its own process
group, so a rank that dies takes down only its replica: torch's agent stops that
replica's other ranks, the survivors leave it out of the step's quorum
(plait/parallel/fault_tolerance.py), and this launcher starts a replacement (up to
`--max-restarts`, default 2 x dp_replicate) that joins at a step boundary with the
state of a live replica, sent over the network. A replica the survivors left out for not
answering (a stalled rank: SIGSTOP, a stuck kernel) is killed here first.

The launcher is the one process every failure leaves alive, so it hosts the store all
replicas agree on, and it writes what a person reads: each committed step's row (posted
by the replicas' leaders; the first of identical rows), one line for each membership
change, and the final line. This is the CLI layer: it starts processes and handles
signals.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from plait.device.network import bound_store
from plait.files import PartialFile
from plait.launch.local import (
    ATTEMPT_ENV,
    LOCALHOST,
    STOP_GRACE_S,
    STORE_ENV,
    LocalLaunch,
    die_with_parent,
    kill_tree,
    on_stop_signals,
)

STORE_PREFIX = "plait-ft"  # the replicas' keys (rows, joins, verdicts) in the job's store
JOIN_WAIT_S = 600.0  # a replacement's wait to be admitted (and a step's, for min_replicas)
REPLICA_FLAG = "--replica"  # hidden rank flag: REPLICA:GENERATION:REPLICAS


def replica_store(store: dist.Store) -> dist.Store:
    return dist.PrefixStore(STORE_PREFIX, store)


@dataclass(frozen=True)
class ReplicaArg:
    """A rank's `--replica INDEX:GENERATION:COUNT`: which replica it belongs to, how many
    replacements that replica has had, and dp_replicate."""

    index: int
    generation: int
    count: int

    @classmethod
    def parse(cls, text: str) -> ReplicaArg:
        index, generation, count = (int(x) for x in text.split(":"))
        return cls(index, generation, count)

    def global_rank(self, rank: int, world: int) -> int:
        """The rank as the whole job counts them (replica by replica)."""
        return self.index * world + rank

    def replicas(self, cfg, mesh, timeout_s: float):  # noqa: ANN001, ANN201
        """This rank's FaultTolerantReplicas, on the launcher's store (STORE_ENV)."""
        from plait.parallel.fault_tolerance import FaultTolerantReplicas

        host, _, port = os.environ[STORE_ENV].rpartition(":")
        client = dist.TCPStore(host, int(port), is_master=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
        return FaultTolerantReplicas(replica_store(client), self.index, self.generation,
                                     self.count, mesh, cfg.train.global_batch,
                                     cfg.parallel.replica_timeout_s,
                                     cfg.parallel.min_replicas, JOIN_WAIT_S)

    def post_row(self, replicas, row: dict) -> None:  # noqa: ANN001
        """A committed step's row for the launcher (the first replica to post it wins)."""
        store = replicas.store
        store.compare_set("row/first", "", str(row["step"]))
        store.compare_set(f"row/{row['step']}", "", json.dumps(row))

    def post_summary(self, replicas, summary: dict) -> None:  # noqa: ANN001
        """The replica's summary; its layout is the whole job's."""
        layout = f"dp_replicate={self.count} fault-tolerant x {summary['layout']}"
        replicas.store.set(f"summary/{self.index}", json.dumps({**summary, "layout": layout}))


@dataclass
class Replica:
    index: int
    generation: int
    proc: subprocess.Popen
    started: float
    stopping: bool = False  # killed by this launcher (left out of the quorum)
    joined: bool = True  # a replacement: False until the replicas say it joined


@dataclass
class Membership:
    """What the launcher saw, for the summary's `fault_tolerance.launcher`."""

    failures: list[dict] = field(default_factory=list)  # a replica's launch ended badly
    replacements: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"failures": self.failures, "replacements": self.replacements}


class ReplicaLauncher:
    """The replicas' launches, their rows and membership lines (module doc)."""

    def __init__(self, replicas: int, nproc: int, rank_args: list[str], timeout_s: float,
                 shim: list[str], extra: list[str], max_replacements: int,
                 metrics_out: str | None, quiet: bool, steps: int):
        self.count, self.nproc, self.rank_args = replicas, nproc, rank_args
        self.timeout_s, self.shim, self.extra = timeout_s, shim, extra
        self.max_replacements, self.quiet, self.steps = max_replacements, quiet, steps
        self.store = bound_store(LOCALHOST, 0, None, datetime.timedelta(seconds=timeout_s))
        self.ft = replica_store(self.store)
        self.metrics = PartialFile(metrics_out) if metrics_out else None
        self.rows: list[dict] = []
        self.live: dict[int, Replica] = {}
        self.seen = Membership()
        self.events_read = 0
        self.first_step: int | None = None  # the first row's step (a resume's start)
        self.summary: dict | None = None

    def start(self, index: int, generation: int) -> None:
        launch = LocalLaunch(self.nproc, [*self.rank_args, REPLICA_FLAG,
                                          f"{index}:{generation}:{self.count}"],
                             timeout_s=self.timeout_s, torchrun=self.shim, extra=self.extra,
                             store=self.store, run_id=f"r{index}g{generation}")
        env = {**launch.env, ATTEMPT_ENV: f"ft-{index}-{generation}"}
        proc = subprocess.Popen(launch.command, env=env, start_new_session=True,
                                preexec_fn=die_with_parent)
        self.live[index] = Replica(index, generation, proc, time.time(),
                                   joined=generation == 0)

    def run(self) -> int:
        for r in range(self.count):
            self.start(r, 0)
        received: list[int] = []

        def forward(signum: int, frame: object) -> None:
            for rep in self.live.values():
                (kill_tree if received else _signal)(rep.proc.pid, signum)
            received.append(signum)

        with on_stop_signals(forward):
            code = self._watch(received)
        return code

    def _watch(self, received: list[int]) -> int:
        done: list[int] = []
        deadline = None
        while self.live:
            self._read_rows()
            self._read_events()
            for r, rep in list(self.live.items()):
                code = rep.proc.poll()
                if code is None:
                    continue
                del self.live[r]
                if code == 0:
                    done.append(r)
                elif not received:
                    self._lost(rep, code, bool(done))
            if self.live and not any(rep.joined for rep in self.live.values()):
                for rep in self.live.values():  # replacements with nobody to join from
                    kill_tree(rep.proc.pid)
                if not done:
                    print("plait: no replica left to join from; the job ends",
                          file=sys.stderr, flush=True)
                    return 1
                self.live.clear()
            if received and deadline is None:
                deadline = time.monotonic() + STOP_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                for rep in self.live.values():
                    kill_tree(rep.proc.pid)
                deadline = float("inf")
            time.sleep(0.05)
        self._read_rows()
        if received:
            return 128 + received[0]
        complete = self.rows and self.rows[-1]["step"] == self.steps - 1
        return 0 if done and complete else 1

    def _lost(self, rep: Replica, code: int, finishing: bool) -> None:
        """A replica's launch ended with `code` != 0: say so, and replace it while the
        others train (not once one has finished: the job is done)."""
        at = time.time()
        self.ft.set(f"gone/{rep.index}.{rep.generation}", str(code))  # nobody waits for it
        self.seen.failures.append({"replica": rep.index, "generation": rep.generation,
                                   "exit": code, "ended_at": at, "killed_here": rep.stopping})
        why = "left out for not answering" if rep.stopping else f"exited with status {code}"
        left = self.max_replacements - len(self.seen.replacements)
        if finishing or not self.live:
            print(f"plait: replica {rep.index} {why}", file=sys.stderr, flush=True)
            return
        if left <= 0:
            print(f"plait: replica {rep.index} {why}; no replacements left (--max-restarts "
                  f"{self.max_replacements}); {len(self.live)} replicas go on",
                  file=sys.stderr, flush=True)
            return
        print(f"plait: replica {rep.index} {why}; {len(self.live)} replicas go on, a "
              f"replacement starts ({left - 1} left)", file=sys.stderr, flush=True)
        self.seen.replacements.append({"replica": rep.index, "generation": rep.generation + 1,
                                       "started_at": time.time()})
        self.start(rep.index, rep.generation + 1)

    def _read_rows(self) -> None:
        """Each committed step's row, in order, once; the summary at the end."""
        if self.first_step is None:
            if not self.ft.check(["row/first"]):
                return
            self.first_step = int(self.ft.get("row/first").decode())
        while self.ft.check([f"row/{self.first_step + len(self.rows)}"]):
            row = json.loads(self.ft.get(f"row/{self.first_step + len(self.rows)}").decode())
            row["posted_at"] = time.time()
            self.rows.append(row)
            if self.metrics is not None:
                self.metrics.write_line(json.dumps(row))
            if not self.quiet:
                print(f"step {row['step'] + 1}/{self.steps}  loss {row['loss']:.4f}  "
                      f"replicas {row.get('replicas', self.count)}/{self.count}  "
                      f"{row['tokens_per_s']:,.0f} tokens/s", flush=True)

    def _read_events(self) -> None:
        """Membership changes the replicas agreed on: a line each; a replica left out for
        not answering is killed (its ranks may be stalled, not dead)."""
        while self.ft.check([f"event/{self.events_read}"]):
            event = json.loads(self.ft.get(f"event/{self.events_read}").decode())
            self.events_read += 1
            who = ", ".join(str(r) for r in event["replicas"])
            if event["kind"] == "lost":
                print(f"plait: step {event['step']}: replica {who} left the quorum after "
                      f"{event['waited_s']:.1f} s; {event['members']} of {self.count} redo the "
                      "step with its micro-batches", file=sys.stderr, flush=True)
                for r in event["replicas"]:
                    rep = self.live.get(r)
                    if rep is not None and rep.generation == event["extra"]["generations"][str(r)]:
                        rep.stopping = True
                        kill_tree(rep.proc.pid)
            else:
                for r in event["replicas"]:
                    if r in self.live:
                        self.live[r].joined = True
                print(f"plait: step {event['step']}: replica {who} joined from replica "
                      f"{event['extra']['donor']}; {event['members']} of {self.count} train",
                      file=sys.stderr, flush=True)

    def finish(self, code: int) -> None:
        summaries = {r: json.loads(self.ft.get(f"summary/{r}").decode())
                     for r in range(self.count) if self.ft.check([f"summary/{r}"])}
        summary = next(iter(summaries.values()), None)
        if summary is not None:
            ft = summary.setdefault("fault_tolerance", {})
            ft["launcher"] = self.seen.to_json()
            # steps with no committed row between the first and the last: a redo keeps
            # every step, so any counted here were lost
            steps = [r["step"] for r in self.rows]
            ft["steps_lost"] = (steps[-1] - steps[0] + 1 - len(set(steps))) if steps else 0
            # rank 0 of each replica that finished: equal state digests, joiners included
            ft["state_digests"] = {str(r): s["fault_tolerance"]["state_digest"]
                                   for r, s in summaries.items()}
            self.summary = summary
        if self.metrics is None:
            return
        if code == 0 and summary is not None:
            self.metrics.write_line(json.dumps(summary))
            self.metrics.finish()
        else:
            self.metrics.abandon()


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def run_replicas(replicas: int, nproc: int, rank_args: list[str], timeout_s: float,
                 shim: list[str], extra: list[str], max_replacements: int | None,
                 metrics_out: str | None, quiet: bool, steps: int) -> int:
    """Train with fault-tolerant replicas (module doc); the exit status."""
    launcher = ReplicaLauncher(replicas, nproc // replicas, rank_args, timeout_s, shim, extra,
                               2 * replicas if max_replacements is None else max_replacements,
                               metrics_out, quiet, steps)
    code = launcher.run()
    launcher.finish(code)
    if code == 0 and launcher.summary is not None:
        from plait.train.progress import final_line

        ft = launcher.summary["fault_tolerance"]
        lost = [e for e in ft["events"] if e["kind"] == "lost"]
        note = (f" ({len(lost)} replica losses survived, {ft['steps_lost']} steps lost)"
                if lost or ft["launcher"]["failures"] else "")
        line = final_line(launcher.summary, launcher.rows,
                          metrics_out and launcher.metrics and metrics_out)
        print(line.replace(", loss", f"{note}, loss", 1), flush=True)
    elif code not in (0,) and code < 128:
        print(f"plait: fault-tolerant job failed: {len(launcher.rows)} of {steps} steps "
              "committed", file=sys.stderr, flush=True)
    return code

