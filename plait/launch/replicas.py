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
from dataclasses import dataclass

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
from plait.launch.nodes import NodeLaunch, NodeSpec

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


@dataclass(frozen=True)
class Site:
    """This launcher's node of the job and the replicas it starts there (whole replicas:
    replicas / nnodes of them a node, consecutive)."""

    node: int
    nnodes: int
    replicas: range
    interface: tuple[str, str] | None  # (name, address) the ranks listen on; None: loopback

    @classmethod
    def of(cls, nodes: NodeSpec | None, count: int) -> Site:
        if nodes is None:
            return cls(0, 1, range(count), None)
        per_node = count // nodes.nnodes
        return cls(nodes.node_rank, nodes.nnodes,
                   range(nodes.node_rank * per_node, (nodes.node_rank + 1) * per_node),
                   (nodes.interface, nodes.address))

    def node_of(self, replica: int) -> int:
        return replica // len(self.replicas)


def job_store(nodes: NodeSpec | None, timeout_s: float) -> dist.TCPStore:
    """The store every replica agrees on: hosted by this launcher on one node (loopback)
    or on node 0 (its address), joined by the others."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if nodes is None:
        return bound_store(LOCALHOST, 0, None, timeout)
    if nodes.node_rank == 0:
        return bound_store(nodes.address, nodes.port, None, timeout)
    return dist.TCPStore(nodes.host, nodes.port, is_master=False, timeout=timeout)


class ReplicaLauncher:
    """The replicas' launches, their rows and membership lines (module doc)."""

    def __init__(self, replicas: int, nproc: int, rank_args: list[str], timeout_s: float,
                 shim: list[str], extra: list[str], max_replacements: int,
                 metrics_out: str | None, quiet: bool, steps: int,
                 nodes: NodeSpec | None = None):
        self.count, self.nproc, self.rank_args = replicas, nproc, rank_args
        self.timeout_s, self.shim, self.extra = timeout_s, shim, extra
        self.max_replacements, self.quiet, self.steps = max_replacements, quiet, steps
        self.site = Site.of(nodes, replicas)
        self.store = job_store(nodes, timeout_s)
        self.ft = replica_store(self.store)
        self.writer = self.site.node == 0  # the rows, the lines, the metrics
        self.metrics = PartialFile(metrics_out) if metrics_out and self.writer else None
        self.rows: list[dict] = []
        self.live: dict[int, Replica] = {}
        self.members = set(range(replicas))  # as the replicas' events say
        self.events_read = 0
        self.first_step: int | None = None  # the first row's step (a resume's start)
        self.summary: dict | None = None

    def start(self, index: int) -> None:
        generation = self.ft.add(f"generation/{index}", 1) - 1  # a node started again: > 0
        launch = LocalLaunch(self.nproc, [*self.rank_args, REPLICA_FLAG,
                                          f"{index}:{generation}:{self.count}"],
                             timeout_s=self.timeout_s, torchrun=self.shim, extra=self.extra,
                             store=self.store, run_id=f"r{index}g{generation}",
                             interface=self.site.interface)
        env = {**launch.env, ATTEMPT_ENV: f"ft-{index}-{generation}"}
        proc = subprocess.Popen(launch.command, env=env, start_new_session=True,
                                preexec_fn=die_with_parent)
        self.live[index] = Replica(index, generation, proc, time.time(),
                                   joined=generation == 0)

    def run(self) -> int:
        if self.ft.check(["end"]):  # a node started again after the job ended
            return int(self.ft.get("end").decode())
        for r in self.site.replicas:
            self.start(r)
        received: list[int] = []

        def forward(signum: int, frame: object) -> None:
            for rep in self.live.values():
                (kill_tree if received else _signal)(rep.proc.pid, signum)
            received.append(signum)

        with on_stop_signals(forward):
            done = self._watch(received)
            if received:
                return 128 + received[0]
            if self.site.nnodes == 1:
                self._read_rows()
                complete = self.rows and self.rows[-1]["step"] == self.steps - 1
                return 0 if done and complete else 1
            return self._end_of_job(done, received)

    def _watch(self, received: list[int]) -> list[int]:
        """Until this node's replicas have ended; the ones that finished."""
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
            if self.live and self._nobody_to_join():
                for rep in self.live.values():  # replacements with nobody to join from
                    kill_tree(rep.proc.pid)
                if self.site.nnodes > 1:
                    print(f"plait: node {self.site.node}: the job ended before replica "
                          f"{', '.join(map(str, self.live))} joined", file=sys.stderr,
                          flush=True)
                elif not done:
                    print("plait: no replica left to join from; the job ends",
                          file=sys.stderr, flush=True)
                self.live.clear()
            if received and deadline is None:
                deadline = time.monotonic() + STOP_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                for rep in self.live.values():
                    kill_tree(rep.proc.pid)
                deadline = float("inf")
            time.sleep(0.05)
        return done

    def _nobody_to_join(self) -> bool:
        """Only replacements are left, and no replica anywhere to join from: on one node,
        none of this launcher's has joined; across nodes, the job has ended."""
        if self.site.nnodes > 1:
            return self.ft.check(["end"])
        return not any(rep.joined for rep in self.live.values())

    def _end_of_job(self, done: list[int], received: list[int]) -> int:
        """Across nodes: this node's replicas have ended (`done`: those that finished). Node
        0 waits for the rows to be whole and for every node holding a member to be done,
        then says how the job ended (`end`); the others wait for that and exit with it."""
        self.ft.set(f"done/{self.site.node}", "ok" if done else "failed")
        if not self.writer:
            while not self.ft.check(["end"]) and not received:
                time.sleep(0.2)
            if received:
                return 128 + received[0]
            self.ft.add("ended", 1)
            return int(self.ft.get("end").decode())
        waited_from = None
        while not received:
            self._read_rows()
            self._read_events()
            said = [k for k in range(self.site.nnodes) if self.ft.check([f"done/{k}"])]
            complete = bool(self.rows) and self.rows[-1]["step"] == self.steps - 1
            holding = {self.site.node_of(r) for r in self.members}
            if (complete and holding <= set(said)) or len(said) == self.site.nnodes:
                break
            waited_from = waited_from or (time.monotonic() if complete else None)
            if waited_from and time.monotonic() - waited_from > self.timeout_s:
                break  # a node holding a member never said it was done
            time.sleep(0.2)
        if received:
            return 128 + received[0]
        code = 0 if complete and self.ft.check([f"summary/{r}" for r in self.members]) else 1
        self.ft.set("end", str(code))
        waiting = len(said) - 1  # the other nodes that said done wait for `end`
        acknowledged = time.monotonic() + STOP_GRACE_S
        while self.ft.add("ended", 0) < waiting and time.monotonic() < acknowledged:
            time.sleep(0.1)
        return code

    def _lost(self, rep: Replica, code: int, finishing: bool) -> None:
        """A replica's launch ended with `code` != 0: say so, and replace it while the
        others train (not once one has finished: the job is done)."""
        self.ft.set(f"gone/{rep.index}.{rep.generation}", str(code))  # nobody waits for it
        self._note("failures", {"replica": rep.index, "generation": rep.generation,
                                "exit": code, "ended_at": time.time(),
                                "killed_here": rep.stopping, "node": self.site.node})
        why = "left out for not answering" if rep.stopping else f"exited with status {code}"
        if finishing or (self.site.nnodes == 1 and not self.live) or self.ft.check(["end"]):
            print(f"plait: replica {rep.index} {why}", file=sys.stderr, flush=True)
            return
        used = self.ft.add("replacements", 1)  # one budget for the whole job
        if used > self.max_replacements:
            print(f"plait: replica {rep.index} {why}; no replacements left (--max-restarts "
                  f"{self.max_replacements}); the other replicas go on",
                  file=sys.stderr, flush=True)
            return
        print(f"plait: replica {rep.index} {why}; the other replicas go on, a replacement "
              f"starts ({self.max_replacements - used} left)", file=sys.stderr, flush=True)
        self._note("replacements", {"replica": rep.index, "generation": rep.generation + 1,
                                    "started_at": time.time(), "node": self.site.node})
        self.start(rep.index)

    def _note(self, kind: str, record: dict) -> None:
        """A launcher's failure or replacement, for the summary node 0 writes."""
        k = self.ft.add(f"seen/{kind}", 1) - 1
        self.ft.set(f"seen/{kind}/{k}", json.dumps(record))

    def _seen(self, kind: str) -> list[dict]:
        return [json.loads(self.ft.get(f"seen/{kind}/{k}").decode())
                for k in range(self.ft.add(f"seen/{kind}", 0))]

    def _read_rows(self) -> None:
        """Each committed step's row, in order, once; the summary at the end (node 0)."""
        if not self.writer:
            return
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
            if not self.quiet:  # numbered from 0, as every step line and event is
                val = (f"  val loss {row['val_loss']:.4f}  val ppl {row['val_perplexity']:.2f}"
                       if "val_loss" in row else "")
                print(f"step {row['step']:>5} of {self.steps}  loss {row['loss']:.4f}  "
                      f"replicas {row.get('replicas', self.count)}/{self.count}  "
                      f"{row['tokens_per_s']:,.0f} tokens/s{val}", flush=True)

    def _read_events(self) -> None:
        """Membership changes the replicas agreed on: a line each (node 0); a replica of
        this node left out for not answering is killed (its ranks may be stalled, not
        dead)."""
        while self.ft.check([f"event/{self.events_read}"]):
            event = json.loads(self.ft.get(f"event/{self.events_read}").decode())
            self.events_read += 1
            who = ", ".join(str(r) for r in event["replicas"])
            if event["kind"] == "lost":
                self.members -= set(event["replicas"])
                say = (f"plait: step {event['step']}: replica {who} left the quorum after "
                       f"{event['waited_s']:.1f} s; {event['members']} of {self.count} redo "
                       "the step with its micro-batches")
                for r in event["replicas"]:
                    rep = self.live.get(r)
                    if rep is not None and rep.generation == event["extra"]["generations"][str(r)]:
                        rep.stopping = True
                        kill_tree(rep.proc.pid)
            else:
                self.members |= set(event["replicas"])
                for r in event["replicas"]:
                    if r in self.live:
                        self.live[r].joined = True
                say = (f"plait: step {event['step']}: replica {who} joined from replica "
                       f"{event['extra']['donor']}; {event['members']} of {self.count} train")
            if self.writer:
                print(say, file=sys.stderr, flush=True)

    def finish(self, code: int) -> None:
        if not self.writer:
            return
        summaries = {r: json.loads(self.ft.get(f"summary/{r}").decode())
                     for r in range(self.count) if self.ft.check([f"summary/{r}"])}
        summary = next(iter(summaries.values()), None)
        if summary is not None:
            ft = summary.setdefault("fault_tolerance", {})
            ft["launcher"] = {"failures": self._seen("failures"),
                              "replacements": self._seen("replacements")}
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
                 metrics_out: str | None, quiet: bool, steps: int,
                 nodes: NodeSpec | None = None) -> int:
    """Train with fault-tolerant replicas (module doc); the exit status. `nproc`: the
    job's ranks, on every node."""
    if nodes is not None:
        NodeLaunch.announce(nodes)
    budget = 2 * replicas if max_replacements is None else max_replacements
    try:
        launcher = ReplicaLauncher(replicas, nproc // replicas, rank_args, timeout_s, shim,
                                   extra, budget, metrics_out, quiet, steps, nodes)
    except (OSError, RuntimeError, dist.DistStoreError) as e:
        where = f"{nodes.host}:{nodes.port}" if nodes else "loopback"
        print(f"plait: cannot host or reach the job's store on {where} "
              f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); check --master "
              "and that node 0 is up, or choose another port", file=sys.stderr)
        return 2
    try:
        code = launcher.run()
        launcher.finish(code)
    except (OSError, RuntimeError, dist.DistStoreError) as e:
        if nodes is None or nodes.node_rank == 0:
            raise
        print(f"plait: node {nodes.node_rank} of {nodes.nnodes}: lost the job's store on node 0 "
              f"({str(e).splitlines()[0] if str(e) else type(e).__name__}): node 0 hosts it, "
              "and its loss ends the job", file=sys.stderr, flush=True)
        for rep in launcher.live.values():
            kill_tree(rep.proc.pid)
        return 1
    if code == 0 and launcher.summary is not None:
        from plait.train.progress import final_line

        ft = launcher.summary["fault_tolerance"]
        lost = [e for e in ft["events"] if e["kind"] == "lost"]
        note = (f" ({len(lost)} replica losses survived, {ft['steps_lost']} steps lost)"
                if lost or ft["launcher"]["failures"] else "")
        line = final_line(launcher.summary, launcher.rows,
                          metrics_out and launcher.metrics and metrics_out)
        print(line.replace(", loss", f"{note}, loss", 1), flush=True)
    elif code not in (0,) and code < 128 and launcher.writer:
        print(f"plait: fault-tolerant job failed: {len(launcher.rows)} of {steps} steps "
              "committed", file=sys.stderr, flush=True)
    return code


def node_problems(nodes: NodeSpec, replicas: int) -> list[str]:
    """--fault-tolerance across nodes: each node holds whole replicas."""
    if replicas % nodes.nnodes:
        return [f"--fault-tolerance across {nodes.nnodes} nodes places whole replicas on each "
                f"node: --dp-replicate {replicas} must be a multiple of --nnodes "
                f"{nodes.nnodes} (a replica spanning nodes is not built); e.g. --dp-replicate "
                f"{nodes.nnodes * max(replicas // nodes.nnodes, 1)}"]
    return []
