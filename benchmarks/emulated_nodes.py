"""Training on emulated nodes, measured: `plait train` on `plait cluster` (two network
namespaces of two ranks each, each node's link shaped to a rate), and what the run used:
its step time, the bytes that crossed each node's link (the interface's counters) beside
the ledger's inter-node bytes, the CPU its processes used, and the other work sharing the
machine. Shared by the benchmarks that compare layouts across nodes
(benchmarks/cluster_topology.py, benchmarks/hybrid_links.py).

Step time: the median of the steps after the first WARMUP (on a shared machine the median
resists a disturbed step). CPU: every process in the run's namespaces (/proc/PID/stat),
between the metrics row of step WARMUP and the next-to-last one's, over steps and ranks; of
it "sys", the kernel's part (the emulated links' and the loopback's TCP stacks), and
"gloo", the backend's threads'.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

from helpers import token_file  # noqa: E402

from plait.files import PARTIAL_SUFFIX  # noqa: E402

NODES = 2
RANKS_PER_NODE = 2
WARMUP = 5  # steps not measured: the step median and the CPU window start after them

# the model: `tiny` with these fields replaced (vocabulary 256: the test token file's). The
# default is tiny's own shape; the flags of the benchmarks give larger ones (the closed
# loop's h 256 prices compute within 15 % at world <= 2; across emulated nodes the links'
# and collectives' CPU and the link model weigh in too).
SIZE = {"hidden": 64, "layers": 2, "heads": 4, "ffn": 176, "seq": 128, "global_batch": 16}


def model_flags(size: dict[str, int], recompute: str, zero: int = 0, dp: int = 2) -> list[str]:
    """The model and batch flags, one meaning in `plait plan` and `plait train` (the
    emitted config carries the shape); each of the dp replicas runs its share of the batch
    as one micro-batch."""
    return ["--model", "tiny", "--vocab", "256", "--hidden", str(size["hidden"]),
            "--layers", str(size["layers"]), "--heads", str(size["heads"]),
            "--kv-heads", str(size["heads"]), "--ffn", str(size["ffn"]),
            "--seq", str(size["seq"]), "--global-batch", str(size["global_batch"]),
            "--microbatch", str(size["global_batch"] // dp), "--precision", "fp32",
            "--recompute", recompute, "--zero", str(zero)]


def add_run_flags(ap: argparse.ArgumentParser, mbit: float) -> None:
    """The flags of a run across emulated nodes: the link, the steps, the model's size."""
    ap.add_argument("--mbit", type=float, default=mbit,
                    help=f"each node's link (default {mbit:g})")
    ap.add_argument("--steps", type=int, default=30,
                    help=f"default 30; the first {WARMUP} are not measured")
    ap.add_argument("--recompute", default="selective", choices=("none", "selective", "full"))
    for k, v in SIZE.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v, metavar="N",
                        help=f"default {v}")


def parse_run_flags(ap: argparse.ArgumentParser, dp: int) -> argparse.Namespace:
    """The parsed flags, the model's size as `args.size`; refused: too few steps to
    measure, a batch the dp replicas cannot split."""
    args = ap.parse_args()
    args.size = {k: getattr(args, k) for k in SIZE}
    if args.steps < WARMUP + 3:
        ap.error(f"--steps: give at least {WARMUP + 3} (the first {WARMUP} are not measured)")
    if args.size["global_batch"] % dp:
        ap.error(f"--global-batch: give a multiple of {dp} (dp {dp})")
    return args


def plait(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`plait ARGS` in a fresh process; its stderr's tail on a failure."""
    r = subprocess.run([sys.executable, "-m", "plait.cli", *args], capture_output=True,
                       text=True, timeout=timeout, cwd=root)
    if r.returncode:
        raise SystemExit(f"plait {' '.join(args[:3])} ... failed:\n{r.stderr[-3000:]}")
    return r


def _runnable_groups(own: str) -> int:
    """Scheduling entities with a runnable task now: with autogroup (Linux's default here:
    /proc/sys/kernel/sched_autogroup_enabled) the scheduler shares the cores among
    sessions first, so a session counts once, whatever its runnable tasks (torchrun starts
    each rank in a session of its own); without it, each task. `own` (this sampler's
    group) is left out."""
    groups = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] != "R":
                continue
            group = (stat.parent / "autogroup").read_text().split()[0] if AUTOGROUP \
                else stat.parent.name
        except (OSError, IndexError):
            continue  # ended meanwhile
        if group != own:
            groups.add(group)
    return len(groups)


AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled").is_file() and \
    Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"


def background_load(seconds: float = 3.0) -> float:
    """Runnable scheduling entities of other work (`_runnable_groups`), averaged over
    `seconds` just before a run (this benchmark's own session left out)."""
    own = Path("/proc/self/autogroup").read_text().split()[0] if AUTOGROUP else str(os.getpid())
    counts = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        counts.append(_runnable_groups(own))
        time.sleep(0.05)
    return statistics.mean(counts)


def _stat_cpu(stat: Path) -> tuple[float, float]:
    """(user + system, system) CPU seconds of a /proc stat file."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, int(fields[12]) / tick


def _cpu_seconds(prefix: str) -> tuple[float, float, float]:
    """CPU seconds of every process in the namespaces named `prefix`*: all (user +
    system), the system part, and that of the backend's threads (gloo's: their names
    start with gloo or pt_gloo)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    total, system, backend = 0.0, 0.0, 0.0
    for name in (x.split()[0] for x in names.splitlines() if x.startswith(prefix)):
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            try:
                cpu, sys_cpu = _stat_cpu(Path(f"/proc/{pid}/stat"))
                for task in Path(f"/proc/{pid}/task").iterdir():
                    if (task / "comm").read_text().startswith(("gloo", "pt_gloo")):
                        backend += _stat_cpu(task / "stat")[0]
            except OSError:
                continue  # ended meanwhile
            total, system = total + cpu, system + sys_cpu
    return total, system, backend


def _watch_cpu(proc: subprocess.Popen, partial: Path, steps: int, out: dict) -> None:
    """CPU seconds of the run's processes when the metrics hold WARMUP rows and steps - 1."""
    prefix, marks = f"plaitc-{proc.pid}-", {WARMUP: None, steps - 1: None}
    while proc.poll() is None and any(v is None for v in marks.values()):
        try:
            rows = partial.read_text().count("\n")
        except OSError:
            rows = 0
        for k in marks:
            if marks[k] is None and rows >= k:
                marks[k] = (rows, _cpu_seconds(prefix))
        time.sleep(0.02)
    if all(marks.values()):
        (r0, (c0, s0, g0)), (r1, (c1, s1, g1)) = marks[WARMUP], marks[steps - 1]
        if r1 > r0:
            rank_steps = (r1 - r0) * NODES * RANKS_PER_NODE
            out["cpu_per_rank_step"] = (c1 - c0) / rank_steps
            out["sys_per_rank_step"] = (s1 - s0) / rank_steps
            out["gloo_per_rank_step"] = (g1 - g0) / rank_steps


def measure(config: Path, mbit: float, steps: int, work: Path) -> dict:
    """Train `config` for `steps` on NODES emulated nodes with links of `mbit`: the step
    time (s), the bytes a node sent between nodes per step (the busier node's counter over
    the whole run, start-up included, over the steps), its ranks' inter-node bytes by the
    ledger (rank 0's, times the node's ranks: every rank of these layouts sends alike),
    rank 0's ledger rows per step ("op@dim"), the losses, and the load beside it."""
    metrics = work / f"{config.stem}.jsonl"
    load = background_load()
    cmd = [sys.executable, "-m", "plait.cli", "cluster", "--nnodes", str(NODES),
           "--inter-node-mbit", str(mbit), "--", "--config", str(config), "--data",
           str(token_file()), "--steps", str(steps), "--quiet", "--metrics-out",
           str(metrics), "--timeout", "300"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=root)
    cpu: dict = {}
    watcher = threading.Thread(target=_watch_cpu, daemon=True, args=(
        proc, metrics.with_name(metrics.name + PARTIAL_SUFFIX), steps, cpu))
    watcher.start()
    _, stderr = proc.communicate(timeout=900)
    watcher.join(timeout=5)
    if proc.returncode:
        raise SystemExit(f"plait cluster failed:\n{stderr[-3000:]}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    summary, steps_rows = rows[-1], rows[:-1]
    sent = [int(b.replace(",", "")) for b in re.findall(r"node \d+ sent ([\d,]+) B", stderr)]
    per_step = summary["ledger"]["per_step"]
    ledger_inter = sum(row["sent_inter"] for row in per_step.values())  # rank 0, per step
    return {"step": statistics.median(s["step_time"] for s in steps_rows[WARMUP:]),
            "wire_per_step": max(sent) / steps, "load": load,
            "loadavg": os.getloadavg()[0], "cpu": cpu.get("cpu_per_rank_step"),
            "sys": cpu.get("sys_per_rank_step"), "gloo": cpu.get("gloo_per_rank_step"),
            "ledger_inter_per_step": RANKS_PER_NODE * ledger_inter,  # a node's ranks
            "ledger_rows": per_step, "losses": [s["loss"] for s in steps_rows]}
