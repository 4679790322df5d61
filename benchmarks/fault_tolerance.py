"""A replica lost and replaced without a restart: `plait train --fault-tolerance` under
SIGKILL and SIGSTOP, beside `--max-restarts` under the same SIGKILL.

Six runs of the same job (tiny model, 2 replicas of 2 ranks, ZeRO-2 inside each, one
step = one row): without --fault-tolerance (its cost per step); uninterrupted; a rank
of replica 1 SIGKILLed after step K; the same rank SIGSTOPped after step K (a stall:
left out after --replica-timeout); the SIGKILL under `--max-restarts 1
--checkpoint-every E` instead (every rank restarts from the last checkpoint); and, on an
emulated cluster of 2 nodes (`plait cluster`, one replica a node, where root and
iproute2 allow it), node 1 killed whole after step K (its rank stalls there, then every
process of its namespace is SIGKILLed: nobody marks its replica gone) and started again
by plait cluster, its replica rejoining. The fault is the test-only PLAIT_TEST_FAULT
(plait/launch/elastic.py): the rank signals itself right after step K's row, so the
fault's time is that row's.

    fault -> next step  wall time from the fault to the next step committed (the launcher
                        saw its row), beside the uninterrupted run's mean step
    join                a replacement's launch to its admission (state received)
    lost                steps trained twice
    final loss          beside the uninterrupted run's (relative difference)

    python benchmarks/fault_tolerance.py [--steps 300] [--at 10] [--write PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results import add_write_flag, run_line, table, write  # noqa: E402
from plait.train.data import synthetic_token_file  # noqa: E402

LAYOUT = ["--nproc", "4", "--dp-shard", "2", "--dp-replicate", "2", "--zero", "2",
          "--set", "model.tie_embeddings=false", "--set", "train.global_batch=16"]


def _run(args, data: Path, work: Path, name: str, fault: str | None, *flags: str) -> dict:
    metrics = work / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "plait.cli", "train", "--data", str(data), "--quiet",
           "--steps", str(args.steps), "--metrics-out", str(metrics), *LAYOUT, *flags]
    env = {**os.environ, **({"PLAIT_TEST_FAULT": fault} if fault else {})}
    start = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    wall = time.time() - start
    if r.returncode != 0:
        raise SystemExit(f"{name}: exit {r.returncode}\n{r.stderr[-3000:]}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    return {"rows": rows[:-1], "summary": rows[-1], "wall": wall, "stderr": r.stderr}


def _node_killed(args, data: Path, work: Path, *flags: str) -> dict | str:
    """Node 1 of a 2-node emulated cluster killed after step `args.at` (module doc); or
    why it cannot run here."""
    from plait.launch.cluster import capability_problem

    problem = capability_problem()
    if problem:
        return problem
    metrics, err_path = work / "node.jsonl", work / "node.err"
    layout = [a for a in LAYOUT if a not in ("--nproc", "4")]  # 2 ranks a node
    cmd = [sys.executable, "-m", "plait.cli", "cluster", "--nnodes", "2",
           "--inter-node-mbit", "1000", "--max-restarts", "1", "--", "--data", str(data),
           "--quiet", "--steps", str(args.steps), "--metrics-out", str(metrics), *layout,
           *flags]
    start = time.time()
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PLAIT_TEST_FAULT": f"stop:2:{args.at}"})
    killed_at = _kill_node_once_stopped(proc, err_path)
    code = proc.wait(timeout=900)
    if code != 0:
        raise SystemExit(f"node killed: exit {code}\n{err_path.read_text()[-3000:]}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    return {"rows": rows[:-1], "summary": rows[-1], "wall": time.time() - start,
            "killed_at": killed_at}


def _kill_node_once_stopped(proc: subprocess.Popen, err_path: Path) -> float:
    """SIGKILL every process of node 1's namespace once one of them has stopped; when."""
    import re

    while True:
        if proc.poll() is not None:
            raise SystemExit(f"node killed: ended first\n{err_path.read_text()[-3000:]}")
        found = re.search(r"plait: cluster (plaitc-\d+-[0-9a-f]+):", err_path.read_text())
        pids = subprocess.run(["ip", "netns", "pids", f"{found[1]}-n1"], capture_output=True,
                              text=True).stdout.split() if found else []
        if any(_state(pid) == "T" for pid in pids):
            for pid in pids:
                subprocess.run(["kill", "-9", pid], check=False)
            return time.time()
        time.sleep(0.1)


def _state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _fault_tolerant(run: dict, at: int) -> dict:
    rows, ft = run["rows"], run["summary"]["fault_tolerance"]
    posted = {r["step"]: r["posted_at"] for r in rows}
    replaced = ft["launcher"]["replacements"]  # a node started again is not a replacement
    launched = replaced[0]["started_at"] if replaced else run["killed_at"]
    joined = next((e for e in ft["events"] if e["kind"] == "joined"), None)
    join = (f"{joined['detected_at'] + joined['extra']['sent_s'] - launched:.1f} (at step "
            f"{joined['step']})" if joined else "not by the last step")
    return {"fault_to_next_s": posted[at + 1] - posted[at], "join": join,
            "lost": ft["steps_lost"]}


def _restarted(run: dict) -> dict:
    (log,) = run["summary"]["restart_log"]
    return {"fault_to_next_s": log["resumed_at"] - log["detected_at"],
            "lost": run["summary"]["lost_steps"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--at", type=int, default=10, help="the step after which the fault fires")
    ap.add_argument("--every", type=int, default=5, help="--max-restarts: checkpoint every")
    ap.add_argument("--replica-timeout", type=float, default=5.0)
    add_write_flag(ap)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="plait-ft-bench-"))
    data = synthetic_token_file(work / "tokens.bin", 200_000, 2048, seed=3)
    # the survivors go on at once (--min-replicas 1): the replacement joins when it is up
    ft = ["--fault-tolerance", "--replica-timeout", str(args.replica_timeout)]
    plain = _run(args, data, work, "plain", None)  # the same layout, no fault tolerance
    base = _run(args, data, work, "uninterrupted", None, *ft)
    kill = _run(args, data, work, "killed", f"kill:3:{args.at}", *ft)
    stop = _run(args, data, work, "stalled", f"stop:3:{args.at}", *ft)
    restart = _run(args, data, work, "restarted", f"kill:3:{args.at}", "--max-restarts", "1",
                   "--checkpoint-dir", str(work / "ck"), "--checkpoint-every", str(args.every))
    node = _node_killed(args, data, work, *ft)
    shutil.rmtree(work, ignore_errors=True)
    step_s = base["summary"]["mean_step_time"]
    plain_s = plain["summary"]["mean_step_time"]
    final = base["rows"][-1]["loss"]
    out = []
    runs = [("SIGKILL, fault tolerant", kill, _fault_tolerant(kill, args.at)),
            ("SIGSTOP, fault tolerant", stop, _fault_tolerant(stop, args.at)),
            ("SIGKILL, --max-restarts 1", restart, _restarted(restart))]
    if isinstance(node, dict):
        runs.append(("node killed (2-node cluster), fault tolerant", node,
                     _fault_tolerant(node, args.at)))
    for name, run, how in runs:
        diff = abs(run["rows"][-1]["loss"] - final) / final
        join = how.get("join", "-")
        out.append((name, f"{how['fault_to_next_s']:.1f}", join, how["lost"],
                    f"{run['wall']:.0f} / {base['wall']:.0f}", f"{diff:.1e}"))
    header = ("fault", "fault -> next step (s)", "join (s)", "steps lost",
              "wall (s) / uninterrupted", "final loss vs uninterrupted (rel)")
    text = table(header, out)
    steps = (f"uninterrupted mean step {step_s * 1e3:.0f} ms with --fault-tolerance, "
             f"{plain_s * 1e3:.0f} ms without (the same layout: hybrid sharding)")
    if isinstance(node, str):
        text += f"\n\nThe node-killed run did not run here: {node}."
    print(f"{args.steps} steps; {steps}\n{text}")
    if args.write:
        write(args.write, "Fault tolerance: a replica lost and replaced, against a restart", [
            f"2 replicas x 2 ranks (ZeRO-2 inside each), tiny model, {args.steps} steps, the "
            f"fault after step {args.at}, --replica-timeout {args.replica_timeout:g} s, "
            f"--max-restarts with a checkpoint every {args.every} steps; {steps}:\n\n" + text],
            "A SIGKILLed replica is left out as soon as its launch ends (the launcher marks "
            "it gone), so the next step costs little more than the step redone by the "
            "survivor; a SIGSTOPped one costs --replica-timeout first (the survivors' sum "
            "waits that long for it). A step under --fault-tolerance costs the verdict's "
            "round trip through the launcher's store beside the plain run's. Until the "
            "replacement joins, one replica trains the whole batch (steps take about twice "
            "as long). No step is lost either way, the final loss is the uninterrupted "
            "run's up to the order of the sums, and the replacement's join is its start-up "
            "(process launch, model build) plus one state transfer. A restart loses the "
            "steps since the last checkpoint and stops every rank for a relaunch. A node "
            "killed whole leaves no launcher to mark its replica gone: the survivor waits "
            "--replica-timeout (as for a stall) on its own, over the emulated network, and "
            "the join counts from the kill: plait cluster starting the node's launcher "
            "again, its replica's start-up, and the state sent across the node link.",
            run=run_line(load))


if __name__ == "__main__":
    main()
