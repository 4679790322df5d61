"""Where a two-rank step's collectives spend their time: each call
split into the wait for the other rank to arrive and the time after both have.

    python benchmarks/collective_waits.py [--layouts dp2,dp2z3,tp2sp] [--steps 14]
        [--write docs/results/collective_waits.md]

Trains the closed loop's model (benchmarks/plan_closed_loop.py: `tiny`, vocabulary 256,
sequence 64, global batch 8, fp32) on two forked gloo ranks (plait.launch.forked's harness),
one rank's setup first (`single`, `single4`: the same work as one dp rank) for the CPU
columns. Each rank's ledger records every collective's issue and completion on
perf_counter, one clock for the ranks of one host; matched call by call across the
ranks (both issue the same list), a call splits into
  peer late = the other rank's issue - this rank's (>= 0): the wait for the slower rank,
              the ranks' compute jitter (hypothesis a);
  after     = completion - the later issue: the collective itself with the backend's
              wake-up once both have come (hypothesis b),
to set beside the profile's alpha (`plait calibrate`: the fastest back-to-back call) and
its measure_sync (the same split after a compute segment). Per rank and step: wall time,
the main thread's CPU (time.thread_time) and the process's (time.process_time: gloo's
threads and the kernel's loopback work too). Steps after the first two; the load average
beside each layout (the machine is shared: a number is for its load). `--write PATH` also
writes the tables as markdown (docs/results/collective_waits.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root)]

import results  # noqa: E402

from plait.launch.forked import run_ranks  # noqa: E402

MODEL = ["model_name=tiny", "model.vocab_size=256", "model.dim=64", "model.n_layers=2",
         "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_dim=176",
         "model.max_seq_len=256", "train.seq_len=64", "train.global_batch=8",
         "train.precision=fp32", "train.recompute=none", "train.optimizer=adamw"]
LAYOUTS = {"single": (1, ["parallel.dp=1"]),
           "single4": (1, ["parallel.dp=1", "train.global_batch=4"]),  # one dp rank's work
           "dp2": (2, ["parallel.dp=2", "parallel.zero=0"]),
           "dp2z3": (2, ["parallel.dp=2", "parallel.zero=3"]),
           "tp2sp": (2, ["parallel.tp=2", "parallel.sp=true"])}
SKIP = 2  # steps left out: the first (setup) and the one after


def _rank(rank: int, world: int, sets: list[str], steps: int) -> dict:
    from plait.config import load_config
    from plait.mesh import ParallelMesh
    from plait.train.data import GlobalBatches, TokenFile, synthetic_token_file
    from plait.train.loop import TrainOptions, train

    cfg = load_config(sets=sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    with tempfile.TemporaryDirectory(prefix="plait-waits-") as tmp:
        data = TokenFile.open(synthetic_token_file(f"{tmp}/t.bin", 1 << 16, 256, seed=0))
        batches = GlobalBatches(data, cfg.train.seq_len, cfg.train.global_batch,
                                cfg.train.seed, 256)
        marks = [(time.perf_counter(), time.thread_time(), time.process_time())]
        train(cfg, mesh, batches, TrainOptions(on_step=lambda row: marks.append(
            (time.perf_counter(), time.thread_time(), time.process_time()))))
    recs = [(f"{r.op}@{r.dim}", r.start, r.end, r.step) for r in mesh.ledger.records]
    return {"marks": marks, "recs": recs}


def _split(out: list[dict], steps: int) -> dict[str, np.ndarray]:
    """Per kind of call: rows of (seconds, peer late, after), both ranks' calls."""
    mine, theirs = out[0]["recs"], out[1]["recs"]
    if [r[0] for r in mine] != [r[0] for r in theirs]:
        raise SystemExit("the ranks' ledgers list different collectives")
    rows: dict[str, list] = {}
    for a, b in zip(mine, theirs, strict=True):
        if a[3] < SKIP:
            continue
        both_in = max(a[1], b[1])
        for me, peer in ((a, b), (b, a)):
            rows.setdefault(me[0], []).append((me[2] - me[1], max(peer[1] - me[1], 0.0),
                                               me[2] - both_in))
    return {k: np.asarray(v) for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="single,single4,dp2,dp2z3,tp2sp")
    ap.add_argument("--steps", type=int, default=14)
    results.add_write_flag(ap)
    a = ap.parse_args()
    timed = a.steps - SKIP
    load0 = os.getloadavg()[0]
    steps_md, calls_md = [], []
    for name in a.layouts.split(","):
        world, flags = LAYOUTS[name]
        sets = [*MODEL, *flags, f"train.steps={a.steps}", "train.warmup_steps=1"]
        load = os.getloadavg()[0]
        out = run_ranks(_rank, world, sets, a.steps, timeout=600.0)
        print(f"== {name} (load average {load:.1f} at the start)")
        for r, o in enumerate(out):
            d = np.diff(np.asarray(o["marks"]), axis=0)[SKIP:] * 1e3
            print(f"  rank {r}: step {d[:, 0].mean():.1f} ms (fastest {d[:, 0].min():.1f}), "
                  f"main thread CPU {d[:, 1].mean():.1f} ms, process CPU {d[:, 2].mean():.1f}")
            steps_md.append((name, r, f"{load:.1f}", f"{d[:, 0].mean():.1f}",
                             f"{d[:, 0].min():.1f}", f"{d[:, 1].mean():.1f}",
                             f"{d[:, 2].mean():.1f}"))
        if world == 1:
            continue
        print("  | call | per rank-step | ms each: mean (median) | peer late: mean (median) "
              "| after both issued: mean (median, p10) | ms a step: total, peer late, after |")
        for kind, v in _split(out, a.steps).items():
            ms, per = v * 1e3, len(v) / timed / 2
            cells = (f"{per:.1f}", f"{ms[:, 0].mean():.3f} ({np.median(ms[:, 0]):.3f})",
                     f"{ms[:, 1].mean():.3f} ({np.median(ms[:, 1]):.3f})",
                     f"{ms[:, 2].mean():.3f} ({np.median(ms[:, 2]):.3f}, "
                     f"{np.percentile(ms[:, 2], 10):.3f})",
                     ", ".join(f"{ms[:, i].sum() / timed / 2:.1f}" for i in range(3)))
            print(f"  | {kind} | " + " | ".join(cells) + " |")
            calls_md.append((name, kind, *cells))
    if a.write:
        _write(a, steps_md, calls_md, load0)


def _write(a, steps_md: list, calls_md: list, load0: float) -> None:
    steps = results.table(("layout", "rank", "load", "step ms", "fastest ms",
                           "main thread CPU ms", "process CPU ms"), steps_md)
    calls = results.table(("layout", "call", "per rank-step", "ms each: mean (median)",
                           "peer late: mean (median)",
                           "after both issued: mean (median, p10)",
                           "ms a step: total, peer late, after"), calls_md)
    results.write(
        a.write, "Waiting at collectives: two ranks, call by call", [
            f"Per rank and step ({a.steps} steps, the first {SKIP} left out):\n\n{steps}",
            f"Each two-rank collective, matched call by call across the ranks:\n\n{calls}"],
        "a call's time split into the wait for the later rank to arrive (\"peer late\": the "
        "ranks' compute jitter) and the time after both issued it (the collective with the "
        "backend's wake-up). The planner prices both from `plait calibrate`'s measure_sync "
        "(docs/planner_cpu.md); set them beside the profile's α, its fastest back-to-back "
        "call. single and single4 are one rank doing one and two dp ranks' work, for the "
        "CPU columns.",
        run=results.run_line(load0))


if __name__ == "__main__":
    main()
