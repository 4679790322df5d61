"""plait hybrid sharding (ZeRO-3 inside each dp_shard group, the reduced shards
all-reduced over dp_replicate) vs torch FSDP2 on a 2-D DeviceMesh (HSDP).

    python benchmarks/hsdp_vs_torch.py [--shard 2] [--replicate 2] [--steps 10]
        [--model small] [--runs 3] [--write docs/results/hsdp_vs_torch.md]

The same split on shard x replicate gloo ranks: plait `--dp-shard N --dp-replicate M
--zero 3`; torch `fully_shard` per block, then the whole, on
`init_device_mesh("cpu", (M, N), mesh_dim_names=("replicate", "shard"))` with every module
resharded after its forward (ZeRO-3 frees what it gathered). The shard groups are the
same consecutive ranks in both. Same model, weights, data, AdamW and clipping, one thread
per rank, fp32; step time and peak memory measured as zero_vs_torch.py measures them
(benchmarks/common.py: the median of `--runs` alternated runs; the exact peak of live
tensor bytes on rank 0 during step 1). Ratios are plait / torch, beside the goals of
ZeRO-3 against FSDP2 (time <= 0.75, memory <= 1.00): the same strategy, split the same
way. The losses of both, step by step, show they train the same thing. `--write PATH`
also writes the goals' rows and the losses as markdown (docs/results/hsdp_vs_torch.md).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import results
import torch
from common import alternated, each_ms, max_loss_gap, met, performance_rows

from plait.train.data import synthetic_token_file

TIME_GOAL, MEMORY_GOAL = 0.75, 1.00  # ZeRO-3 against FSDP2's (zero_vs_torch.py)


def _setting(args: argparse.Namespace) -> str:
    return (f"Model {args.model}, dp = {args.world} as dp_shard {args.shard} × dp_replicate "
            f"{args.replicate} (gloo, CPU), fp32, {args.steps} steps, the median of "
            f"{args.runs} alternated run{'s' if args.runs > 1 else ''}")


def _loss_rows(mine: dict, theirs: dict) -> list[tuple]:
    return [(step, f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.1e}")
            for step, (a, b) in enumerate(zip(mine["losses"], theirs["losses"]))]


def _goal_rows(runs: dict) -> list[tuple[str, str, str, str]]:
    time_ratio = runs["plait_ms"] / runs["peer_ms"]
    memory_ratio = runs["plait_peak"] / runs["peer_peak"]
    name = "hsdp_vs_torch.py: hybrid ZeRO-3 / HSDP"
    return [(f"{name}, step time", f"{time_ratio:.3f}", f"≤ {TIME_GOAL:.2f}",
             met(time_ratio, TIME_GOAL)),
            (f"{name}, peak memory", f"{memory_ratio:.3f}", f"≤ {MEMORY_GOAL:.2f}",
             met(memory_ratio, MEMORY_GOAL))]


def report(runs: dict, args: argparse.Namespace) -> None:
    print(_setting(args))
    mine, theirs = runs["mine"], runs["theirs"]
    print(f"{'plait ms':>10}{'HSDP ms':>10}{'time ratio':>12}{'plait peak':>14}"
          f"{'HSDP peak':>14}{'mem ratio':>11}{'loss gap':>10}")
    print(f"{runs['plait_ms']:>10.1f}{runs['peer_ms']:>10.1f}"
          f"{runs['plait_ms'] / runs['peer_ms']:>12.3f}"
          f"{runs['plait_peak'] / 2**20:>10.2f} MiB{runs['peer_peak'] / 2**20:>10.2f} MiB"
          f"{runs['plait_peak'] / runs['peer_peak']:>11.3f}"
          f"{max_loss_gap(mine[0], theirs[0]):>10.1e}")
    print(f"runs (ms): plait {each_ms(mine)}, HSDP {each_ms(theirs)}")
    print(results.table(("step", "plait loss", "HSDP loss", "gap"),
                        _loss_rows(mine[0], theirs[0])))
    print(performance_rows(_goal_rows(runs)))


def write(path: str, runs: dict, args: argparse.Namespace, load0: float) -> None:
    results.write(
        path, "Hybrid sharding against torch's HSDP",
        [f"{_setting(args)}:\n\n" + results.goal_table(_goal_rows(runs)),
         f"Each run's step time (ms), in the order run: plait {each_ms(runs['mine'])}; HSDP "
         f"{each_ms(runs['theirs'])}. Peaks: plait {runs['plait_peak']:,} B, HSDP "
         f"{runs['peer_peak']:,} B.",
         "The losses of the first timed run of each:\n\n" + results.table(
             ("step", "plait loss", "HSDP loss", "gap"),
             _loss_rows(runs["mine"][0], runs["theirs"][0]))],
        "plait / torch step time and peak memory (exact live tensor bytes on rank 0 during "
        "step 1, the same tracker for both): plait's ZeRO-3 inside each dp_shard group with "
        "the reduced shards all-reduced over dp_replicate, against FSDP2's `fully_shard` "
        "per block on a (replicate, shard) DeviceMesh, resharding after every forward. The "
        "goals are ZeRO-3's against FSDP2. In fp32 plait holds 1/dp_shard of the parameters "
        "more than HSDP: its parameter shard beside the fp32 master shard that Adam updates "
        "(HSDP's parameters are the optimizer's). The losses agree to the reduction order. With "
        "more ranks than cores the ranks time-slice, so single ratios move by a few per cent "
        "between runs.",
        run=results.run_line(load0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard", type=int, default=2, help="dp_shard: ranks a shard group")
    ap.add_argument("--replicate", type=int, default=2, help="dp_replicate: shard groups")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=3, help="timed runs of each, alternated")
    results.add_write_flag(ap)
    args = ap.parse_args()
    if args.shard < 1 or args.replicate < 2:
        ap.error("give --shard >= 1 and --replicate >= 2 (replicate 1 is zero_vs_torch.py's "
                 "ZeRO-3 against FSDP2)")
    args.world = args.shard * args.replicate
    load0 = os.getloadavg()[0]
    torch.set_num_threads(1)
    sets = ("parallel.zero=3", f"parallel.dp_shard={args.shard}",
            f"parallel.dp_replicate={args.replicate}")
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic_token_file(Path(tmp) / "bench.bin", 400_000, args.vocab)
        runs = alternated(args, path, sets, "hsdp", args.replicate)
    report(runs, args)
    if args.write:
        write(args.write, runs, args, load0)


if __name__ == "__main__":
    main()
