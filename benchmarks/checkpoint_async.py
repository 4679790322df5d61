"""Checkpoint cost, synchronous vs background (--async-checkpoint).

Two gloo ranks (dp=2, ZeRO-1) train a ~10M-parameter model and save every 3 steps. For
each mode it prints the time the training thread is blocked per save (sync: the whole
save; async: the host copy and the directory agreement, then the commit one step later),
and the wall time of each loop iteration (step + whatever the checkpoint adds to it):
the median of the iterations without a save, and the mean of those with one (sync: the
save; async: the step during which the thread writes, and the one that commits).

    python benchmarks/checkpoint_async.py [--steps 12] [--every 3] [--dim 256]
        [--write docs/results/checkpoint_async.md]

`--write PATH` also writes the table as markdown (docs/results/checkpoint_async.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import results  # noqa: E402

from plait.checkpoint import Checkpointing  # noqa: E402
from plait.config import load_config  # noqa: E402
from plait.launch.forked import run_ranks  # noqa: E402
from plait.mesh import ParallelMesh  # noqa: E402
from plait.model.transformer import build_model  # noqa: E402
from plait.train.data import GlobalBatches, TokenFile, synthetic_token_file  # noqa: E402
from plait.train.loop import TrainOptions, train  # noqa: E402


def _config(args):
    return load_config(sets=[
        "parallel.dp=2", "parallel.zero=1", f"train.steps={args.steps}",
        "train.global_batch=8", "train.seq_len=64", f"model.dim={args.dim}",
        "model.n_layers=8", "model.vocab_size=8192", f"model.ffn_dim={args.dim * 11 // 4}",
        "model.n_heads=4", "model.n_kv_heads=4"]).check(2)


def _rank(rank, world, args, data: Path, out: Path, background: bool) -> dict:
    cfg = _config(args)
    mesh = ParallelMesh.build(cfg.parallel)
    batches = GlobalBatches(TokenFile.open(data), cfg.train.seq_len, cfg.train.global_batch,
                            cfg.train.seed, cfg.model.vocab_size)
    ck = Checkpointing(dir=out, every=args.every, background=background)
    marks = [time.perf_counter()]
    train(cfg, mesh, batches, TrainOptions(on_step=lambda row: marks.append(time.perf_counter()),
                                           checkpoint=ck))
    return {"iterations": [b - a for a, b in zip(marks, marks[1:], strict=False)],
            "timings": ck.timings, "bytes": sum(f.stat().st_size for f in out.rglob("*.bin")
                                                if f.name == f"rank-{rank:05d}.bin")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--dim", type=int, default=256)
    results.add_write_flag(p)
    args = p.parse_args()
    load0, rows = os.getloadavg()[0], []
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="plait-ckpt-bench-"))
    data = synthetic_token_file(tmp / "tokens.bin", 200_000, 8192, seed=7)
    cfg = _config(args)
    build_model(cfg.model, seed=0, device="meta")  # warm torch's meta ops before the fork
    print(f"{cfg.model.num_params() / 1e6:.1f}M parameters, dp=2 ZeRO-1, save every "
          f"{args.every} of {args.steps} steps")
    print(f"{'mode':<6} {'saves':>5} {'blocked/save':>13} {'commit/save':>12} "
          f"{'iter (no save)':>15} {'iter (save)':>12} {'overhead':>9} {'MB/rank':>8}")
    for background in (False, True):
        out = tmp / ("async" if background else "sync")
        r0 = run_ranks(_rank, 2, args, data, out, background, timeout=1800)[0]
        saves = {t["step"] for t in r0["timings"]}
        its = r0["iterations"]  # iteration i ends at step i's on_step
        touched = saves | ({s + 1 for s in saves} if background else set())
        plain = [t for i, t in enumerate(its) if i + 1 not in touched and i > 0]
        with_save = [t for i, t in enumerate(its) if i + 1 in touched]
        blocked = statistics.mean(t["blocking_s"] for t in r0["timings"])
        commit = statistics.mean(t.get("commit_s", 0.0) for t in r0["timings"])
        base = statistics.median(plain)
        print(f"{'async' if background else 'sync':<6} {len(saves):>5} {blocked:>12.3f}s "
              f"{commit:>11.3f}s {base:>14.3f}s {statistics.mean(with_save):>11.3f}s "
              f"{statistics.mean(with_save) - base:>8.3f}s {r0['bytes'] / 1e6 / len(saves):>8.1f}")
        rows.append(("async" if background else "sync", f"{blocked:.2f} s",
                     f"{commit:.2f} s" if background else "-", f"{base:.2f} s",
                     f"{statistics.mean(with_save):.2f} s",
                     f"{statistics.mean(with_save) - base:.2f} s",
                     f"{r0['bytes'] / 1e6 / len(saves):.1f}"))
    shutil.rmtree(tmp, ignore_errors=True)
    if args.write:
        results.write(
            args.write, "Checkpoints: synchronous against background saves", [
                f"Two gloo ranks, dp = 2 ZeRO-1, {cfg.model.num_params() / 1e6:.1f}M "
                f"parameters, a save every {args.every} of {args.steps} steps:\n\n"
                + results.table(("mode", "blocked per save", "commit (next step)",
                                 "iteration without a save", "iteration with one",
                                 "overhead", "MB a rank a save"), rows)],
            "the time the training thread is blocked per save (sync: the whole save; async: "
            "the host copy and the directory agreement, then the commit one step later) and "
            "what a save adds to a loop iteration. On a CPU the writer thread needs the same "
            "cores the step uses, so the overhead moves less than the blocked time.",
            run=results.run_line(load0))


if __name__ == "__main__":
    main()
