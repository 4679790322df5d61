"""`plait simulate` at scale: every schedule at 64 stages x 1,024 micro-batches (goal <= 1 s
wall each, Python start-up and imports included).

    python benchmarks/simulate_scale.py [--pp 64] [--microbatches 1024] [--runs 3]
        [--schedules 1f1b zb-v ...] [--steps 3 --optimizer-sync post_validation]
        [--write docs/results/simulate_scale.md]

Runs the command a user types, `python -m plait.cli simulate --schedule S --pp P
--microbatches M --json`, in a fresh process `--runs` times per schedule, and prints the
median wall time and CPU time (user + system) beside the goal, the bubble, and whether
torch was imported (it must not be). The machine's load average is printed with the
table: on a shared machine wall time is CPU time stretched by the load. No torch-native
peer exists for this; the goal is the reference. Tests never assert time. `--write PATH`
also writes the table as markdown (docs/results/simulate_scale.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plait.schedule.registry import SCHEDULE_NAMES  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import results  # noqa: E402

GOAL_S = 1.0
# the same command, asked afterwards whether torch (or numpy) was loaded on the way
PROBE = ("import sys, runpy; sys.argv = ['plait'] + sys.argv[1:]; "
         "import plait.cli.main as c; code = c.main(); "
         "sys.stderr.write('LOADED ' + ' '.join(m for m in ('torch', 'numpy') "
         "if m in sys.modules) + '\\n'); sys.exit(code)")


def run_once(argv: list[str]) -> tuple[float, float, dict]:
    """(wall s, user+sys CPU s, the JSON printed) of one `plait simulate` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "plait.cli", *argv], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        raise SystemExit(f"plait {' '.join(argv)} failed:\n{out.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(out.stdout)


def loaded_modules(argv: list[str]) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = [x for x in out.stderr.splitlines() if x.startswith("LOADED")]
    return line[-1][len("LOADED "):] if line else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--schedules", nargs="*", default=list(SCHEDULE_NAMES))
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--optimizer-sync", default="barrier")
    results.add_write_flag(ap)
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    print(f"plait simulate --pp {args.pp} --microbatches {args.microbatches} --steps "
          f"{args.steps} --optimizer-sync {args.optimizer_sync}; median of {args.runs} runs; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'schedule':<12} {'wall s':>7} {'cpu s':>7} {'goal':>7} {'met':>7} "
          f"{'bubble':>8}  torch/numpy loaded")
    rows = []
    for name in args.schedules:
        argv = ["simulate", "--schedule", name, "--pp", str(args.pp), "--microbatches",
                str(args.microbatches), "--steps", str(args.steps), "--optimizer-sync",
                args.optimizer_sync, "--json"]
        runs = [run_once(argv) for _ in range(args.runs)]
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        doc = runs[-1][2]
        bubble = (doc["steps"]["steady_bubble_fraction"] if "steps" in doc
                  and doc["steps"]["steady_bubble_fraction"] is not None
                  else doc["bubble_fraction"])
        met = "met" if wall <= GOAL_S else "not met"
        loaded = loaded_modules(argv) or "neither"
        print(f"{name:<12} {wall:7.2f} {cpu:7.2f} {'≤ ' + format(GOAL_S, '.1f') + ' s':>7} "
              f"{met:>7} {bubble:8.4f}  {loaded}")
        rows.append((name, wall, cpu, met, bubble, loaded))
    # one row per schedule: the command, the time, the goal, met?
    print("\ngoals:")
    load = os.getloadavg()
    for name, wall, cpu, met, _, _ in rows:
        print(f"| simulate_scale.py | `plait simulate --schedule {name} --pp {args.pp} "
              f"--microbatches {args.microbatches}` | {wall:.2f} s wall ({cpu:.2f} s CPU) | "
              f"≤ {GOAL_S:.1f} s | {met} | {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC "
              f"| {load[0]:.1f} |")
    if args.write:
        write(args, rows, load0)


def write(args: argparse.Namespace, rows: list, load0: float) -> None:
    head = (f"`plait simulate --schedule S --pp {args.pp} --microbatches {args.microbatches}"
            f" --steps {args.steps} --optimizer-sync {args.optimizer_sync} --json` in a fresh "
            f"process, the median of {args.runs} runs per schedule:")
    body = results.table(
        ("schedule", "wall s", "CPU s", "goal", "met?", "bubble", "torch / numpy loaded"),
        [(n, f"{w:.2f}", f"{c:.2f}", f"≤ {GOAL_S:.1f} s", m, f"{b:.4f}", mods)
         for n, w, c, m, b, mods in rows])
    results.write(
        args.write, "`plait simulate` at scale", [f"{head}\n\n{body}"],
        "the wall time of the whole command a user types, Python start-up and imports "
        "included, against the goal of 1 s; CPU time is user + system. On a shared machine "
        "wall time is CPU time stretched by the load, so the CPU column is the steadier "
        "one. `plait simulate` imports neither torch nor numpy.",
        run=results.run_line(load0))


if __name__ == "__main__":
    main()
