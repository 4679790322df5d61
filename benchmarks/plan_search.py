"""Full `plait plan` search: Llama 3 405B on 16,384 H100s, 16M-token batch (target < 1 s).

    PYTHONPATH=. python benchmarks/plan_search.py
Prints the wall time of the search (enumeration, vectorised scoring of every layout,
simulation of the best) and the number of layouts considered. Tests never assert time.
"""

from __future__ import annotations

import time

from plait.plan.calibration import EFFICIENCY
from plait.plan.estimate import Training
from plait.plan.hardware import Cluster, get_gpu
from plait.plan.search import search
from plait.plan.shape import from_preset


def main() -> None:
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
    print(f"best: {best.layout.label()} {best.layout.schedule} ZeRO-{best.layout.zero} "
          f"{best.layout.recompute}: {float(best.step_time):.3f} s/step, MFU "
          f"{float(best.mfu):.1%}")


if __name__ == "__main__":
    main()
