"""Full `plait plan` search: Llama 3 405B on 16,384 H100s, 16M-token batch (target < 1 s).

    python benchmarks/plan_search.py [--write docs/results/plan_search.md]

Prints the wall time of the search (enumeration, vectorised scoring of every layout,
simulation of the best) and the number of layouts considered. Tests never assert time.
`--write PATH` also writes the result as markdown (docs/results/plan_search.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import results  # noqa: E402

from plait.plan.calibration import EFFICIENCY  # noqa: E402
from plait.plan.estimate import Training  # noqa: E402
from plait.plan.hardware import Cluster, get_gpu  # noqa: E402
from plait.plan.search import search  # noqa: E402
from plait.plan.shape import from_preset  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    results.add_write_flag(ap)
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    shape = from_preset("llama3-405b")
    cluster = Cluster(get_gpu("h100-sxm"), 16384)
    train = Training(16 * 2**20 // shape.seq)  # 16M tokens = 2048 sequences of 8192
    runs = []
    for _ in range(3):
        from plait.plan import bubble
        bubble._simulate.cache_clear()
        bubble._build.cache_clear()
        t0 = time.perf_counter()
        res = search(shape, cluster, train, EFFICIENCY, top=5)
        runs.append(time.perf_counter() - t0)
    best = res.top[0]
    print(f"llama3-405b on 16384 x h100-sxm, {train.global_batch} x {shape.seq} tokens")
    print(f"layouts considered: {res.considered:,}  fitting: {res.feasible:,}")
    print(f"search wall time: best {min(runs):.3f} s, runs {', '.join(f'{r:.3f}' for r in runs)}"
          f" (target < 1 s)")
    best_text = (f"{best.layout.label()} {best.layout.schedule} ZeRO-{best.layout.zero} "
                 f"{best.layout.recompute}: {float(best.step_time):.3f} s/step, MFU "
                 f"{float(best.mfu):.1%}")
    print(f"best: {best_text}")
    if args.write:
        results.write(
            args.write, "`plait plan`'s search at scale", [
                f"llama3-405b on 16,384 × h100-sxm, {train.global_batch} × {shape.seq} "
                "tokens, three searches (caches cleared before each):\n\n" + results.table(
                    ("layouts considered", "fitting", "best s", "runs s", "target",
                     "best layout"),
                    [(f"{res.considered:,}", f"{res.feasible:,}", f"{min(runs):.3f}",
                      ", ".join(f"{r:.3f}" for r in runs), "< 1 s", best_text)])],
            "the wall time of the planner's whole search (enumeration, vectorised scoring "
            "of every layout, simulation of the best), in process, without start-up.",
            run=results.run_line(load0))


if __name__ == "__main__":
    main()
