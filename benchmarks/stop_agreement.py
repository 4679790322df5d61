"""What --checkpoint-on-stop costs a step: the stop agreement beside the tiny model's step.

    python benchmarks/stop_agreement.py [--calls 200] [--steps 20]
        [--write docs/results/stop_agreement.md]

With --checkpoint-on-stop every step starts with one all-reduce (max) of 4 bytes over
the world (plait/train/stop.py, `agreed_stop`), so that every rank stops at the same step
boundary. For 2 and 4 ranks (gloo on CPU, one thread per rank) this prints the median
cost of one agreement (over 5 batches of --calls calls) beside the mean step time of the
suite's tiny model with data parallel on the same ranks (plait/throughput.py's mean, the
first step left out), and their ratio: the share of a step the option adds. `--write
PATH` also writes the table as markdown (docs/results/stop_agreement.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import results
from common import batches

from plait.config import load_config
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.throughput import mean_step_time
from plait.train.data import synthetic_token_file
from plait.train.loop import train
from plait.train.stop import StopRequest, agreed_stop


def _rank(rank: int, world: int, calls: int, steps: int, path: Path) -> tuple[float, float]:
    cfg = load_config(sets=[f"parallel.dp={world}", "train.global_batch=8", "train.seq_len=64",
                            f"train.steps={steps}"]).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    stop, per_call = StopRequest(), []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            agreed_stop(stop, mesh)
        per_call.append((time.perf_counter() - start) / calls)
    res = train(cfg, mesh, batches(cfg, path))
    return statistics.median(per_call), mean_step_time([m["step_time"] for m in res.metrics])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--steps", type=int, default=20)
    results.add_write_flag(p)
    args = p.parse_args()
    load0, rows = os.getloadavg()[0], []
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic_token_file(Path(tmp) / "t.bin", 200_000, 2048, seed=1)
        print(f"{'ranks':>5} {'agreement':>12} {'step (tiny)':>12} {'share':>7}")
        for world in (2, 4):
            out = run_ranks(_rank, world, args.calls, args.steps, path)
            agree, step = out[0]
            print(f"{world:>5} {agree * 1e3:>9.2f} ms {step * 1e3:>9.1f} ms {agree / step:>7.1%}")
            rows.append((world, f"{agree * 1e3:.2f} ms", f"{step * 1e3:.1f} ms",
                         f"{agree / step:.1%}"))
    if args.write:
        results.write(
            args.write, "What --checkpoint-on-stop adds to a step", [
                f"gloo on CPU, one thread per rank; the median of 5 batches of {args.calls} "
                f"agreements; the tiny model's mean step over {args.steps} steps:\n\n"
                + results.table(("ranks", "agreement", "step (tiny)", "share"), rows)],
            "with --checkpoint-on-stop every step starts with one 4-byte all-reduce (max) "
            "over the world, so that every rank stops at the same step boundary; the share "
            "is that call's cost over the tiny model's step. A loaded machine makes the call "
            "slower (a peer must be scheduled to answer).",
            run=results.run_line(load0))


if __name__ == "__main__":
    main()
