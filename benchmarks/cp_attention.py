"""Context parallel on a long sequence: step time and peak memory per rank at cp = 1, 2, 4,
ring vs all-gather, and the attention work per rank, zigzag vs contiguous.

    python benchmarks/cp_attention.py [--cp 1 2 4] [--seq-len 1024] [--steps 4]
        [--write docs/results/cp_attention.md]

1. Training (`plait.train.loop.train`, the tiny model, 2 sequences of --seq-len tokens per
   step): mean step time (the first step left out) and, on step 1, the tracker's peak
   bytes per rank (all categories) and its activations, for each cp and mode.
2. The attention core alone, forward + backward on random q/k/v of the whole sequence:
   each rank's thread CPU seconds in block maths (`Ring.compute_s`: transfers and waits
   excluded; 2 shared cores make wall times of concurrent ranks mean little) and in the
   whole core call, repeated --reps times, best kept; max/mean over ranks for zigzag and
   contiguous, beside the counted work (`ContextLayout.work`).

torch's own `context_parallel` (torch 2.13) is not compared: on CPU/gloo a 2-rank
non-causal SDPA under it did not finish in 180 s (killed), and its causal path needs
CUDA kernels. gloo on CPU, one thread per rank. `--write PATH` also writes both tables as
markdown (docs/results/cp_attention.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import results  # noqa: E402

from plait.config import load_config  # noqa: E402
from plait.launch.forked import run_ranks  # noqa: E402
from plait.mesh import ParallelMesh  # noqa: E402
from plait.model.rope import Positions  # noqa: E402
from plait.parallel.context import ContextLayout, ContextParallelAttention  # noqa: E402
from plait.throughput import mean_step_time  # noqa: E402
from plait.train.data import GlobalBatches, TokenFile, synthetic_token_file  # noqa: E402
from plait.train.loop import train  # noqa: E402


def _cfg(args, cp: int, mode: str):
    return load_config(sets=[
        f"parallel.cp={cp}", f"parallel.cp_mode={mode}", f"train.steps={args.steps}",
        "train.global_batch=2", f"train.seq_len={args.seq_len}",
        f"model.max_seq_len={args.seq_len}", "model.vocab_size=256", "train.memory_step=1",
        "model.n_kv_heads=2"]).check(cp)


def _train(rank, world, args, path, mode):
    cfg = _cfg(args, world, mode)
    mesh = ParallelMesh.build(cfg.parallel)
    t = cfg.train
    res = train(cfg, mesh, GlobalBatches(TokenFile.open(path), t.seq_len, t.global_batch,
                                         t.seed, cfg.model.vocab_size))
    mem = res.metrics[1]["memory"]
    return {"time": mean_step_time([m["step_time"] for m in res.metrics]),
            "peak": mem["peak_total"], "activations": mem["peak"].get("activations", 0),
            "loss": res.losses[-1]}


def _core(rank, world, args, layout):
    mesh = ParallelMesh.build(load_config(sets=[f"parallel.cp={world}"]).parallel)
    b, h, kv, d, s = 1, 4, 2, 16, args.seq_len
    lay = ContextLayout(world, s, layout)
    core = ContextParallelAttention(mesh, lay, "ring")
    pos = lay.positions(mesh.coord("cp"), "cpu")
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(b, h, s // world, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(b, kv, s // world, d, generator=gen, requires_grad=True)
            for _ in range(2))
    best, best_total = float("inf"), float("inf")
    for _ in range(args.reps):
        core.ring.compute_s = 0.0
        c0 = time.thread_time()
        core(q, k, v, Positions(pos, torch.zeros(1), torch.zeros(1))).sum().backward()
        best_total = min(best_total, time.thread_time() - c0)
        best = min(best, core.ring.compute_s)  # the block maths alone
    return best, core.ring.work, best_total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    results.add_write_flag(ap)
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    train_rows, core_rows = [], []
    path = Path(tempfile.mkdtemp()) / "cp-bench.bin"
    synthetic_token_file(path, 40 * args.seq_len, 256, seed=3)
    print(f"training, tiny model (2 KV heads), 2 x {args.seq_len} tokens per step")
    print(f"{'cp':>3} {'mode':>10} {'step s':>8} {'peak MB/rank':>13} {'activ. MB':>10} "
          f"{'loss':>8}")
    for cp in args.cp:
        for mode in (("ring",) if cp == 1 else ("ring", "allgather")):
            rows = run_ranks(_train, cp, args, path, mode, timeout=900)
            peak = max(r["peak"] for r in rows) / 2**20
            act = max(r["activations"] for r in rows) / 2**20
            print(f"{cp:>3} {mode:>10} {rows[0]['time']:>8.3f} {peak:>13.2f} {act:>10.2f} "
                  f"{rows[0]['loss']:>8.4f}")
            train_rows.append((cp, "—" if cp == 1 else mode, f"{rows[0]['time']:.2f}",
                               f"{peak:.1f}", f"{act:.1f}"))
    print("\nattention core (ring), forward + backward, per-rank thread CPU seconds")
    print(f"{'cp':>3} {'layout':>10} {'max/mean blocks':>16} {'max/mean call':>14} "
          f"{'max/mean work':>14}  block ms per rank")
    for cp in [c for c in args.cp if c > 1]:
        for layout in ("zigzag", "contiguous"):
            rows = run_ranks(_core, cp, args, layout, timeout=900)
            times, work, calls = ([r[i] for r in rows] for i in range(3))
            ratio = [max(x) / statistics.mean(x) for x in (times, calls, work)]
            print(f"{cp:>3} {layout:>10} {ratio[0]:>16.2f} {ratio[1]:>14.2f} "
                  f"{ratio[2]:>14.2f}  " + " ".join(f"{x * 1e3:.1f}" for x in times))
            core_rows.append((cp, layout, f"{ratio[0]:.2f}", f"{ratio[1]:.2f}",
                              f"{ratio[2]:.2f}"))
    if args.write:
        results.write(
            args.write, "Context parallel on a long sequence", [
                f"Training the tiny model (2 KV heads), 2 sequences of {args.seq_len} tokens "
                f"a step, {args.steps} steps (the first left out), per rank:\n\n"
                + results.table(("cp", "mode", "step s", "peak MiB / rank",
                                 "activations MiB / rank"), train_rows),
                "The ring attention core alone, forward + backward, max / mean over the "
                "ranks (thread CPU seconds in block maths, best of the repeats):\n\n"
                + results.table(("cp", "layout", "block maths time", "whole call",
                                 "counted work"), core_rows)],
            "memory per rank falls about 1/cp (the all-gather mode holds the whole "
            "sequence's K/V and a mask during attention). Step time falls only with a core "
            "per rank: on fewer cores than ranks each of the ring's cp − 1 dependent hops "
            "waits for the peer to be scheduled. Zigzag chunks balance the causal work "
            "(max / mean 1.00 counted) where contiguous ones do not (1.50 at cp = 2, 1.75 at "
            "cp = 4); the measured time follows the count.",
            run=results.run_line(load0))


if __name__ == "__main__":
    main()
