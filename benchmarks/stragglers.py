"""Stragglers named: how far healthy ranks stray from their peers, and how soon a slowed
rank is named (plait/train/stragglers.py).

    python benchmarks/stragglers.py [--steps 20] [--repeats 3] [--slow-ms 30]
        [--write docs/results/stragglers.md]

For each layout (4 ranks, gloo on CPU, one thread per rank, model tiny) plait trains
`--steps` steps healthy `--repeats` times, then once with rank 3 sleeping `--slow-ms` in
every step (the test-only fault `slow`, plait/launch/elastic.py). From every rank's
figures: per step and rank, the ratio and the excess of its compute over its peers'
median (the rule's two margins); the largest of each over the healthy runs; the longest run of
consecutive steps in which one healthy rank exceeded both margins (the rule names a rank
at `StragglerRule.steps`); the ranks named; in the slowed run, the step at which rank 3
was named and its ratio; and the exchange's own cost: the seconds a rank was blocked in
it per step (it runs a step behind, async).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import results
from common import batches

from plait.config import load_config
from plait.launch.elastic import FAULT_ENV, slowed
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.train.data import synthetic_token_file
from plait.train.loop import train
from plait.train.stragglers import StragglerRule, Stragglers, peer_medians

LAYOUTS = {
    "dp4": ["parallel.dp=4"],
    "dp2 x pp2": ["parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"],
    "dp2 x tp2": ["parallel.dp=2", "parallel.tp=2"],
}


def _cfg(args, sets):
    return load_config(overrides={"model_name": "tiny"}, sets=[
        f"train.steps={args.steps}", "train.global_batch=8", "train.seq_len=64",
        "model.vocab_size=256", "parallel.gpus_per_node=2", *sets]).check(4)


def _rank(rank, world, args, sets, path):
    cfg = _cfg(args, sets)
    mesh = ParallelMesh.build(cfg.parallel)
    res = train(cfg, mesh, slowed(batches(cfg, path), rank))
    exchange = [r.blocked for r in mesh.ledger.records
                if r.dim == "world" and r.op == "all_gather" and r.tag == "metrics"]
    return {"summary": res.summary, "metrics": res.metrics, "exchange_s": exchange,
            "groups": Stragglers.for_mesh(mesh).groups}


def _figures(outs) -> list[list[float]]:
    """Every rank's compute per step (each rank's own row)."""
    return [[o["metrics"][s]["compute_s"] for o in outs] for s in range(len(outs[0]["metrics"]))]


def _stray(compute: list[list[float]], groups: list[list[int]], rule: StragglerRule
           ) -> tuple[float, float, int]:
    """The largest ratio and excess (s) over the peers' median, and the longest streak
    of one rank over both margins, the first step left out."""
    ratio = excess = 0.0
    streak: dict[int, int] = {}
    longest = 0
    for step in compute[1:]:
        for ranks in groups:
            mine = [step[r] for r in ranks]
            for r, c, med in zip(ranks, mine, peer_medians(mine), strict=True):
                ratio, excess = max(ratio, c / med), max(excess, c - med)
                streak[r] = streak.get(r, 0) + 1 if rule.slow(c, med) else 0
                longest = max(longest, streak[r])
    return ratio, excess, longest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="healthy runs per layout")
    p.add_argument("--slow-ms", type=float, default=30.0)
    results.add_write_flag(p)
    args = p.parse_args()
    rule, load0, rows = StragglerRule(), os.getloadavg()[0], []
    header = ("layout", "compute ms (median)", "largest ratio", "largest excess ms",
              "longest streak", "named (healthy)", f"slowed {args.slow_ms:g} ms: named at step",
              "ratio", "exchange blocked ms/step")
    print(" | ".join(header))
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic_token_file(Path(tmp) / "t.bin", 200_000, 256, seed=3)
        for name, sets in LAYOUTS.items():
            runs = [run_ranks(_rank, 4, args, sets, path) for _ in range(args.repeats)]
            os.environ[FAULT_ENV] = f"slow:3:{args.slow_ms / 1e3}"
            try:
                slow = run_ranks(_rank, 4, args, sets, path)
            finally:
                del os.environ[FAULT_ENV]
            strays = [_stray(_figures(h), h[0]["groups"], rule) for h in runs]
            ratio, excess, longest = (max(s[i] for s in strays) for i in range(3))
            compute = [c for h in runs for c in _figures(h)[1:]]
            named = sorted({v["rank"] for h in runs
                            for v in h[0]["summary"]["stragglers"]["named"]})
            first = next((r for r in slow[0]["metrics"] if r.get("straggler")), None)
            exchange = statistics.mean(b for h in runs for o in h for b in o["exchange_s"][1:])
            row = (name, f"{statistics.median(c for s in compute for c in s) * 1e3:.1f}",
                   f"{ratio:.2f}", f"{excess * 1e3:.1f}", str(longest),
                   ", ".join(map(str, named)) or "none",
                   f"{first['straggler']['step']} (rank {first['straggler']['rank']})"
                   if first else "never", f"{first['straggler']['slower_by']:.2f}"
                   if first else "-", f"{exchange * 1e3:.2f}")
            print(" | ".join(row), flush=True)
            rows.append(row)
    if args.write:
        results.write(
            args.write, "Stragglers: healthy ranks against their peers, and a slowed rank",
            [f"Model tiny, 4 ranks (gloo, CPU, two a node), seq 64, global batch 8, "
             f"{args.steps} steps, {args.repeats} healthy runs a layout (the largest over "
             f"them) and one slowed; the rule: compute above {rule.relative:g}x and "
             f"{rule.absolute_s * 1e3:g} ms over the peers' median, {rule.steps} steps in a "
             "row. Healthy figures leave out the first step:\n\n"
             + results.table(header, rows)],
            "on a shared 2-core machine a healthy rank's compute strays from its peers' "
            "median by up to the largest ratio and excess shown, but not by both margins for "
            f"{rule.steps} steps in a row (the longest streak), so nobody is named; a rank "
            f"slowed by {args.slow_ms:g} ms a step is named at the step shown: the earliest "
            f"the rule allows is step {rule.steps - 1} ({rule.steps} in a row from step 0), "
            "and the first step, which warms caches, can hide the slowdown in its longer "
            "computes; the verdict travels with the next row. The exchange of figures blocks "
            "a rank for the milliseconds shown a step (it runs a step behind, async).",
            run=results.run_line(load0))


if __name__ == "__main__":
    main()
