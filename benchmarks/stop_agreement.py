"""What --checkpoint-on-stop costs a step: the stop agreement beside the tiny model's step.

    python benchmarks/stop_agreement.py [--calls 200] [--steps 20]

With --checkpoint-on-stop every step starts with one all-reduce (max) of 4 bytes over
the world (plait/train/stop.py, `agreed_stop`), so that every rank stops at the same step
boundary. For 2 and 4 ranks (gloo on CPU, one thread per rank) this prints the median
cost of one agreement (over 5 batches of --calls calls) beside the mean step time of the
suite's tiny model with data parallel on the same ranks (plait/throughput.py's mean, the
first step left out), and their ratio: the share of a step the option adds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

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
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic_token_file(Path(tmp) / "t.bin", 200_000, 2048, seed=1)
        print(f"{'ranks':>5} {'agreement':>12} {'step (tiny)':>12} {'share':>7}")
        for world in (2, 4):
            out = run_ranks(_rank, world, args.calls, args.steps, path)
            agree, step = out[0]
            print(f"{world:>5} {agree * 1e3:>9.2f} ms {step * 1e3:>9.1f} ms {agree / step:>7.1%}")


if __name__ == "__main__":
    main()
