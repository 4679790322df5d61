"""Measured overlap per mesh dim: how much of each layout's communication is exposed.

    python benchmarks/overlap.py [--model small] [--steps 6] [--seq-len 128] [--timeline-dir D]
        [--write docs/results/overlap.md]

For each layout (4 ranks, gloo on CPU, one thread per rank) plait trains `--steps` steps
and every rank's ledger gives, per mesh dim and step: communication seconds from issue
to completion, exposed seconds (the rank was blocked waiting: all of a synchronous call,
an async one's time in wait()) and hidden = total - exposed. Printed: rank 0's mean per
step over the steps after the first, and the exposed share of each dim's communication
beside the step time and the planner's exposed share for the same layout (what `plait
report` puts beside it: `plait.plan.estimate_config`). Naive DP and TP are synchronous
(exposed share 1.0 by construction); bucketed DP, ZeRO's reduce-scatters and ZeRO-3's
prefetched all-gathers hide part of theirs. `--timeline-dir D`: also each layout's last
step as `plait train --trace / --timeline` write it (D/LAYOUT.json, D/LAYOUT.png).
`--write PATH` also writes the table as markdown (docs/results/overlap.md).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import results
from common import batches

from plait.config import load_config
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.plan import estimate_config
from plait.throughput import mean_step_time
from plait.train.data import synthetic_token_file
from plait.train.loop import TrainOptions, train

LAYOUTS = {
    "dp4 naive": ["parallel.dp=4", "parallel.data_parallel=naive"],
    "dp4 bucketed": ["parallel.dp=4", "parallel.data_parallel=bucketed", "parallel.bucket_mb=4"],
    "dp4 zero-1": ["parallel.dp=4", "parallel.zero=1"],
    "dp4 zero-2": ["parallel.dp=4", "parallel.zero=2"],
    "dp4 zero-3": ["parallel.dp=4", "parallel.zero=3"],
    "tp4": ["parallel.tp=4"],
    "dp2 x tp2 +sp": ["parallel.dp=2", "parallel.tp=2", "parallel.sp=true"],
    "pp4 1f1b": ["parallel.pp=4", "parallel.schedule=1f1b", "parallel.microbatches=8"],
}


def _cfg(args, sets):
    return load_config(overrides={"model_name": args.model}, sets=[
        f"train.steps={args.steps}", "train.global_batch=16", f"train.seq_len={args.seq_len}",
        f"model.vocab_size={args.vocab}", *sets]).check(4)


def _rank(rank, world, args, sets, path, name):
    cfg = _cfg(args, sets)
    mesh = ParallelMesh.build(cfg.parallel)
    res = train(cfg, mesh, batches(cfg, path), TrainOptions(timeline=bool(args.timeline_dir)))
    if args.timeline_dir and rank == 0:
        from plait.observe.timeline import draw_step_timeline, write_chrome_trace

        stem = Path(args.timeline_dir) / name.replace(" ", "_").replace("+", "")
        write_chrome_trace(res.timeline, stem.with_suffix(".json"))
        draw_step_timeline(res.timeline, stem.with_suffix(".png"))
    steps = range(1, cfg.train.steps)  # the first step warms caches
    per_dim: dict[str, dict[str, float]] = {}
    for s in steps:
        for dim, row in mesh.ledger.overlap_by_dim(s).items():
            acc = per_dim.setdefault(dim, {"seconds": 0.0, "exposed": 0.0, "hidden": 0.0})
            for k, v in row.items():
                acc[k] += v / len(steps)
    step_time = mean_step_time([m["step_time"] for m in res.metrics])  # steps 1..
    return {"per_dim": per_dim, "step_time": step_time}


def planner_shares(cfg) -> dict[str, float]:
    """The planner's exposed share of each dim's communication time (as plait report)."""
    total: dict[str, float] = {}
    exposed: dict[str, float] = {}
    for c in estimate_config(cfg).collectives:
        total[c.dim] = total.get(c.dim, 0.0) + c.total
        exposed[c.dim] = exposed.get(c.dim, 0.0) + c.exposed
    return {d: exposed[d] / t for d, t in total.items() if t > 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--timeline-dir", help="write each layout's trace and PNG here")
    results.add_write_flag(p)
    args = p.parse_args()
    load0, rows = os.getloadavg()[0], []
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic_token_file(Path(tmp) / "t.bin", 200_000, args.vocab, seed=3)
        print(f"model {args.model}, 4 ranks (gloo, CPU), seq {args.seq_len}, global batch 16, "
              f"{args.steps} steps (mean of steps 1..); rank 0, ms per step")
        print(f"{'layout':<16} {'step':>8}  {'dim':<5} {'comm':>8} {'exposed':>8} "
              f"{'hidden':>8}  exposed share  planner")
        for name, sets in LAYOUTS.items():
            out = run_ranks(_rank, 4, args, sets, path, name)[0]
            planner = planner_shares(_cfg(args, sets))
            for i, (dim, row) in enumerate(sorted(out["per_dim"].items())):
                share = row["exposed"] / row["seconds"] if row["seconds"] else float("nan")
                head = f"{name:<16} {out['step_time'] * 1e3:8.1f}" if i == 0 else " " * 25
                pred = f"{planner[dim]:7.2f}" if dim in planner else "      -"
                print(f"{head}  {dim:<5} {row['seconds'] * 1e3:8.2f} "
                      f"{row['exposed'] * 1e3:8.2f} {row['hidden'] * 1e3:8.2f}  "
                      f"{share:13.2f}  {pred}")
                rows.append((name if i == 0 else "", f"{out['step_time'] * 1e3:.1f}"
                             if i == 0 else "", dim, f"{row['seconds'] * 1e3:.2f}",
                             f"{row['exposed'] * 1e3:.2f}", f"{row['hidden'] * 1e3:.2f}",
                             f"{share:.2f}", pred.strip()))
    if args.write:
        results.write(
            args.write, "Exposed and hidden communication per mesh dim", [
                f"Model {args.model}, 4 ranks (gloo, CPU), seq {args.seq_len}, global batch "
                f"16, {args.steps} steps (the mean of steps 1..); rank 0, ms a step:\n\n"
                + results.table(("layout", "step", "dim", "comm", "exposed", "hidden",
                                 "exposed share", "planner"), rows)],
            "the ledger's time per mesh dim from issue to completion, the part the rank was "
            "blocked (exposed) and the rest (hidden behind other work). Naive DP and TP are "
            "synchronous (share 1.00); bucketed DP, ZeRO's reduce-scatters and ZeRO-3's "
            "prefetched all-gathers hide part of theirs; a pipeline's transfers are in flight "
            "for most of their life (its comm sums concurrent transfers, so it can exceed the "
            "step). `world` is the grad norm's all-reduce. The planner column is `plait "
            "report`'s exposed share for the same layout on a GPU-like host, where a "
            "collective runs beside compute; on CPU/gloo the rank's own cores run both. "
            "Under load every time is stretched by time-slicing; the shares are what to read.",
            run=results.run_line(load0))


if __name__ == "__main__":
    main()
