"""Restarts across nodes: `plait train --nnodes N --node-rank K --master HOST:PORT
--max-restarts R --checkpoint-dir D`: a job survives a dead rank or a dead node.

Every node's launcher runs the same loop, torchrun-style: the attempts are rounds of a
rendezvous held in node 0's store, which node 0's launcher hosts for the whole job.

    each launcher, each attempt:
      arrive    n = add("arrivals", 1): this launcher's attempt is k = (n - 1) // N; wait
                until all N have arrived for k (N * (k + 1) arrivals), so that every rank
                of attempt k - 1, on every node, is gone
      agree     node 0 picks the newest COMMITTED checkpoint in D (plait/launch/elastic.py, as on
                one node) and publishes it; every node resumes from what node 0 published
      launch    torchrun on a rendezvous of its own (`--rdzv-id ...-a<k>`), the ranks'
                process group under a prefix of its own (`PLAIT_ATTEMPT`: no key of a dead
                attempt is read)
      fail      say how (`<k>/failure/<node>`), go back to arrive; after R restarts, exit 1

Counting arrivals, not attempts, is what lets a node come back: a launcher killed during
attempt k had arrived for k, so the fresh launcher a scheduler starts in its place (same
command; `plait cluster --max-restarts` does it on an emulated cluster) counts towards
k + 1 with the survivors, whose ranks lost their peers and ended. Node 0 reports the
restart (the rank that died first, or the node that vanished without a word) and keeps
the metrics whole as on one node: every node's report carries the rows its ranks logged
(torchrun's rendezvous orders nodes by address and agent process, so rank 0 may run on any
node), node 0 publishes the rows kept and the restarts with the resume point, and rank 0,
wherever it runs, writes them first, then the summary's `restarts` / `restart_log`.

Node 0 hosts the store: its loss ends the job (the other launchers say so and exit 1;
torch's c10d rendezvous has the same single point). Rerun every node with `--resume`.
A node that never arrives ends the others after 3 x `--timeout` seconds (the survivors'
ranks may take a process-group timeout and more to notice a peer that died starting up).

This is the CLI layer: it starts processes.
"""

from __future__ import annotations

import datetime
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from plait.device.network import bound_store
from plait.launch.elastic import FAILURE_FILE_ENV, Progress, Restart, next_attempt, read_failure
from plait.launch.local import ATTEMPT_ENV, launch_ranks
from plait.launch.nodes import NodeLaunch, NodeSpec

KEYS = "plait-job"  # the launchers' keys in node 0's store (the ranks': plait-<attempt>.*)
ARRIVALS = "arrivals"
POLL_S = 0.2
ARRIVAL_TIMEOUTS = 3  # a node that never arrives ends the others after 3 x --timeout


class StoreLost(Exception):
    """Node 0's store went away (its node died): the job cannot restart in place."""


def _call(fn, *args):  # noqa: ANN001, ANN202
    try:
        return fn(*args)
    except (RuntimeError, OSError, dist.DistStoreError) as e:
        raise StoreLost(str(e).splitlines()[0] if str(e) else type(e).__name__) from e


def arrive(store: dist.Store, nnodes: int, timeout_s: float) -> int:
    """Join the next attempt's round; its index once all `nnodes` have arrived (waiting
    up to `timeout_s`)."""
    n = _call(store.add, ARRIVALS, 1)
    attempt, target = (n - 1) // nnodes, nnodes * ((n - 1) // nnodes + 1)
    deadline = time.monotonic() + timeout_s
    while (have := _call(store.add, ARRIVALS, 0)) < target:
        if time.monotonic() > deadline:
            missing = target - have
            raise TimeoutError(f"attempt {attempt}: {missing} of {nnodes} nodes did not "
                               f"arrive within --timeout {timeout_s:g} s")
        time.sleep(POLL_S)
    return attempt


def _agree(store: dist.Store, spec: NodeSpec, attempt: int, progress: Progress,
           checkpoint_dir: str, max_restarts: int) -> str | None:
    """Node 0 decides where attempt `attempt` resumes, and with it the rows kept and the
    restarts so far; every node reads all three. The rendezvous orders nodes by address
    and agent process, not by --node-rank, so rank 0 (which writes the metrics) may run on
    any node in any attempt: each node's state file must hold the same history."""
    key = f"{attempt}/resume"
    if spec.node_rank == 0:
        resume = ""
        if attempt > 0:
            restart = _restart(store, spec, attempt, progress, Path(checkpoint_dir))
            print(restart.line(max_restarts), file=sys.stderr, flush=True)
            restart.relaunched_at = time.time()
            progress.restarts.append(restart)
            resume = restart.checkpoint or ""
        _call(store.set, key, json.dumps({"resume": resume, "rows": progress.rows,
                                          "restarts": [r.__dict__ for r in
                                                       progress.restarts]}))
    agreed = json.loads(_call(store.get, key))
    progress.rows = agreed["rows"]
    progress.restarts = [Restart(**r) for r in agreed["restarts"]]
    return agreed["resume"] or None


def _restart(store: dist.Store, spec: NodeSpec, attempt: int, progress: Progress,
             root: Path) -> Restart:
    """What failed in attempt - 1 (the earliest report; a node without one vanished)."""
    reports, silent = [], []
    for node in range(spec.nnodes):
        key = f"{attempt - 1}/failure/{node}"
        if _call(store.check, [key]):
            reports.append(json.loads(_call(store.get, key)))
        else:
            silent.append(node)
    killed = [r for r in reports if r.get("exitcode") is not None and r["exitcode"] < 0]
    first = min(killed or reports, key=lambda r: r.get("detected_at") or 0, default={})
    # the rows of the failed attempt: logged on the node that ran its rank 0
    rows = max((r.get("rows", []) for r in reports), key=len, default=[])
    restart = next_attempt(attempt - 1, progress, first, root, rows)
    if silent and not killed:  # its launcher died with its ranks: nobody saw how
        restart.rank, restart.who = None, f"node {silent[0]} (its launcher and ranks)"
        restart.exit = "no report from it"
    return restart


def run_elastic_nodes(spec: NodeSpec, max_restarts: int, checkpoint_dir: str,
                      rank_args: list[str], timeout_s: float, torchrun: list[str],
                      extra: list[str]) -> int:
    """This node's launcher over the job's attempts (module doc); the exit status."""
    NodeLaunch.announce(spec)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        host = bound_store(spec.address, spec.port, None, timeout) if spec.node_rank == 0 \
            else None
    except OSError as e:
        print(f"plait: --master {spec.host}:{spec.port}: cannot listen on {spec.address}:"
              f"{spec.port} ({e.strerror or e}); choose another port", file=sys.stderr)
        return 2
    progress = Progress(Path(tempfile.mkdtemp(prefix="plait-elastic-")))
    try:
        store = dist.PrefixStore(KEYS, dist.TCPStore(spec.host, spec.port, is_master=False,
                                                     timeout=timeout))
        return _attempts(spec, store, progress, max_restarts, checkpoint_dir, rank_args,
                         timeout_s, torchrun, extra)
    except StoreLost as e:
        print(f"plait: node {spec.node_rank} of {spec.nnodes}: lost the job's store on node 0 "
              f"({e}): node 0 hosts it, and its loss ends the job; rerun every node with "
              "--resume", file=sys.stderr, flush=True)
        return 1
    except TimeoutError as e:
        print(f"plait: node {spec.node_rank} of {spec.nnodes}: {e}; the job ends",
              file=sys.stderr, flush=True)
        return 1
    finally:
        shutil.rmtree(progress.state_dir, ignore_errors=True)
        del host  # node 0: the store closes last, after this launcher's ranks are gone


def _attempts(spec: NodeSpec, store: dist.Store, progress: Progress, max_restarts: int,
              checkpoint_dir: str, rank_args: list[str], timeout_s: float,
              torchrun: list[str], extra: list[str]) -> int:
    while True:
        # the others' ranks may take a process-group timeout (and a half) to notice
        attempt = arrive(store, spec.nnodes, ARRIVAL_TIMEOUTS * timeout_s)
        if attempt > max_restarts:  # a node came back after the last attempt failed
            print(f"plait: node {spec.node_rank}: no restarts left (--max-restarts "
                  f"{max_restarts})", file=sys.stderr, flush=True)
            return 1
        resume = _agree(store, spec, attempt, progress, checkpoint_dir, max_restarts)
        args = [*rank_args, f"--resume={Path(resume).resolve()}"] if resume \
            else list(rank_args)  # the flag given last wins
        failure_file = progress.state_dir / f"failure-{attempt}.json"
        launch = NodeLaunch(spec, [*args, "--elastic-state",
                                   str(progress.state_file(attempt))],
                            timeout_s, torchrun, extra, attempt=attempt)
        received: list[int] = []
        code = launch_ranks(launch.command, {**launch.env, ATTEMPT_ENV: str(attempt),
                                             FAILURE_FILE_ENV: str(failure_file)}, received)
        if code == 0 or code == 2 or received:  # done, bad input, stopped by the user
            return code
        report = {**read_failure(failure_file), "node": spec.node_rank,
                  "rows": progress.attempt_rows(attempt)}
        _call(store.set, f"{attempt}/failure/{spec.node_rank}", json.dumps(report))
        if attempt == max_restarts:
            print(f"plait: node {spec.node_rank} of {spec.nnodes}: the job failed in its "
                  f"last attempt; no restarts left (--max-restarts {max_restarts})",
                  file=sys.stderr, flush=True)
            return 1

