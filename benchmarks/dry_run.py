"""Dry run at scale: the first and last pipeline rank of a 1,024-rank layout, on this CPU.

    python benchmarks/dry_run.py [--model llama3-8b] [--layout tp=8,pp=4,dp=32]
                                 [--seq-len 1024] [--microbatches 4] [--rank first,last]
                                 [--write docs/results/dry_run.md]

Each rank runs in a process of its own on torch's fake process group (plait/observe/
dry_run.py): it builds exactly that rank's stages, tensor-parallel slices and optimizer
state through `parallelize` (the stages allocated unwritten and only the kept slices
filled, so the host never holds a whole stage), trains on real tensors up to the step it
measures (`measure_step`: step 0 at ZeRO 0, so one step) with the memory tracker on, and
prints its measured memory by category beside the planner's eager-runtime prediction for
the same rank, the ledger's payload bytes per mesh dim beside the planner's, and the wall
time. fp32, ZeRO 0, micro-batches of one sequence. Run it under `/usr/bin/time -v` for
the peak RSS (the largest rank's) and the CPU time of both ranks. `--write PATH` also
writes the tables as markdown (docs/results/dry_run.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import results  # noqa: E402

from plait.config import load_config  # noqa: E402
from plait.device import resolve_device  # noqa: E402
from plait.observe.dry_run import dry_run_ranks, parse_ranks  # noqa: E402
from plait.train.data import synthetic_token_file  # noqa: E402

CATS = ("params", "grads", "optimizer", "comm", "activations")
PLANNER = {"params": ("parameters",), "grads": ("gradients",),
           "optimizer": ("optimizer states",), "comm": ("communication buffers",),
           "activations": ("activations", "logits")}


def _config(args):
    dims = dict(kv.split("=") for kv in args.layout.split(","))
    sets = [f"parallel.{k}={v}" for k, v in dims.items()]
    world = 1
    for v in dims.values():
        world *= int(v)
    dp = int(dims.get("dp", 1))
    return load_config(overrides={"model_name": args.model}, sets=[
        *sets, f"parallel.microbatches={args.microbatches}", f"train.seq_len={args.seq_len}",
        f"train.global_batch={dp * args.microbatches}"]
        ).check(world), world


def _gib(x: float) -> str:
    return f"{x / 2**30:8.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layout", default="tp=8,pp=4,dp=32")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--json-out", help="also write the ranks' results (a JSON list) here")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="intra-op threads of each rank's process on CPU (default: the cores)")
    p.add_argument("--rank", default="first,last",
                   help="ranks, one after the other: numbers, first, last (default first,last)")
    results.add_write_flag(p)
    args = p.parse_args()
    load0 = os.getloadavg()[0]
    cfg, world = _config(args)
    ranks, problems = parse_ranks(args.rank, world)
    if problems:
        p.error("; ".join(problems))
    outs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic_token_file(Path(tmp) / "t.bin", 4 * args.seq_len * 64,
                                    cfg.model.vocab_size, seed=1)
        for rank in ranks:  # each printed (and saved) as it ends: a rank takes minutes
            out, = dry_run_ranks(cfg, world, [rank], path, resolve_device(args.device),
                                 threads=args.threads)
            outs.append(out)
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(outs))
            _print(args, out)
    if args.write:
        _write(args, outs, load0)


def _write(args: argparse.Namespace, outs: list[dict], load0: float) -> None:
    """Memory by category (GiB) measured and predicted per rank; the ledger's bytes."""
    mem, wire = [], []
    for out in outs:
        pred, peak = out["predicted_memory"], out["memory"]["peak"]
        coords = ", ".join(f"{k} {v}" for k, v in out["coords"].items())
        who = f"{out['rank']} ({coords})"
        mem.append((f"{who} measured", *(f"{peak[c] / 2**30:.3f}" for c in CATS),
                    f"{out['memory']['peak_total'] / 2**30:.3f}", f"{out['seconds']:.0f} s",
                    f"{out['cpu_seconds']:.0f} s"))
        if "not_covered" not in pred:
            mem.append((f"{out['rank']} predicted",
                        *(f"{sum(pred[n] for n in PLANNER[c]) / 2**30:.3f}" for c in CATS),
                        f"{pred['total'] / 2**30:.3f}", "", ""))
        for dim, b in sorted(out["data_bytes_per_step"].items()):
            pb = out["predicted_bytes_per_step"].get(dim)
            wire.append((out["rank"], dim, f"{b:,.0f}", "-" if pb is None else f"{pb:,.0f}"))
    results.write(
        args.write, "Dry run at scale", [
            f"{args.model} {args.layout}, sequence {args.seq_len}, {args.microbatches} "
            f"micro-batches of one sequence, fp32, ZeRO 0, {args.threads} threads a rank; "
            "peak memory by category, GiB:\n\n" + results.table(
                ("rank (coords)", *CATS, "peak total", "wall", "CPU"), mem),
            "Data bytes per step per mesh dim, the ledger's and the planner's:\n\n"
            + results.table(("rank", "dim", "ledger", "planner"), wire)],
        "one rank of the layout built and trained on torch's fake process group: its "
        "memory by category beside the planner's eager-runtime prediction for that rank, "
        "and its ledger's payload bytes beside the planner's collectives for its pipeline "
        "rank (`plait.plan.rank_collectives`). Wall and CPU are the rank's own "
        "(`/usr/bin/time -v` around the command gives the peak RSS).",
        run=results.run_line(load0))


def _print(args: argparse.Namespace, out: dict) -> None:
    pred = out["predicted_memory"]
    print(f"{args.model} {args.layout} seq {args.seq_len} m {args.microbatches}: "
          f"rank {out['rank']} {out['coords']}, {out['param_count_local']:,} parameters, "
          f"{out['seconds']:.0f} s wall, {out['cpu_seconds']:.0f} s CPU")
    print(f"  {'category':<12} {'measured GiB':>12} {'predicted GiB':>14}")
    for c in CATS:
        pr = "-" if "not_covered" in pred else _gib(sum(pred[n] for n in PLANNER[c]))
        print(f"  {c:<12} {_gib(out['memory']['peak'][c]):>12} {pr:>14}")
    total = "-" if "not_covered" in pred else _gib(pred["total"])
    print(f"  {'peak total':<12} {_gib(out['memory']['peak_total']):>12} {total:>14}")
    if "moment" in pred:
        print(f"  predicted peak moment: {pred['moment']}")
    for dim, b in sorted(out["data_bytes_per_step"].items()):
        pb = out["predicted_bytes_per_step"].get(dim)
        print(f"  bytes/step {dim:<5} ledger {b:14,.0f}  planner "
              f"{'-' if pb is None else f'{pb:14,.0f}'}", flush=True)

if __name__ == "__main__":
    main()
