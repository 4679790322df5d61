"""Bucketed data parallel (plait) vs torch DDP: same model, data, world size.

    python benchmarks/dp_vs_ddp.py [--world 4] [--steps 12] [--model small] [--runs 3]
    python benchmarks/dp_vs_ddp.py --first-bucket-ab [--runs 5]
        [--write docs/results/dp_vs_ddp.md]

Both train the same model from the same weights on the same global batches with AdamW and
grad clipping; gloo on CPU, one thread per rank. Prints the step time (each run's mean,
first 2 steps skipped as warm-up; the median of `--runs` runs, plait's and DDP's
alternated), the ratio plait/DDP beside its goal (<= 0.90), the losses'
agreement, and gradient bytes per step: plait's from its ledger, DDP's from a comm hook
that sizes each bucket in a separate counting pass (the hook is not present in the timed
run).

`--first-bucket-ab`: the A/B of bucketed DP's first-bucket cap (FIRST_BUCKET_MB, DDP's
1 MB convention) against no cap (the first bucket as big as the others, `bucket_mb`),
alternated with DDP run by run; it prints the medians of the three and both ratios.
`--write PATH` also writes the goal's row as markdown (docs/results/dp_vs_ddp.md).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import results
import torch
import torch.distributed as dist
from common import (
    WARMUP,
    batches,
    bench_config,
    max_loss_gap,
    median_ms,
    met,
    performance_rows,
    torch_adamw,
    torch_loop,
)

from plait.config import FIRST_BUCKET_MB
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model.transformer import build_model
from plait.throughput import mean_step_time
from plait.train.data import synthetic_token_file
from plait.train.loop import train


def _cfg(args, world):
    return bench_config(args.model, world, args.steps, args.seq_len, args.vocab,
                        "parallel.data_parallel=bucketed")


def _plait(rank, world, args, path, first_cap=True):
    if not first_cap:  # the A/B's other arm: the first bucket as big as the others
        import plait.parallel.data as data

        data.FIRST_BUCKET_MB = float("inf")
    cfg = _cfg(args, world)
    mesh = ParallelMesh.build(cfg.parallel)
    res = train(cfg, mesh, batches(cfg, path))
    grads = [r for r in mesh.ledger.records if r.tag == "grads" and r.step == 1]
    return {"times": [m["step_time"] for m in res.metrics], "losses": res.losses,
            "bytes": sum(r.sent for r in grads), "calls": len(grads)}


def _ddp(rank, world, args, path, count_bytes=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = _cfg(args, world)
    model = build_model(cfg.model, seed=cfg.train.seed)
    named = list(model.named_parameters())
    ddp = DDP(model, bucket_cap_mb=cfg.parallel.bucket_mb)
    sent = []
    if count_bytes:
        def hook(state, bucket):
            b = bucket.buffer()
            sent.append(2 * (world - 1) / world * b.numel() * b.element_size())
            return dist.all_reduce(b, async_op=True).get_future().then(lambda f: f.value()[0])
        ddp.register_comm_hook(None, hook)
    out = torch_loop(ddp, [p for _, p in named], torch_adamw(named, cfg), cfg,
                     batches(cfg, path), rank, world, 1 if count_bytes else args.steps)
    return {**out, "bytes": sum(sent), "calls": len(sent)}


GOAL = 0.90  # plait / DDP step time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=3, help="timed runs of each, alternated")
    ap.add_argument("--first-bucket-ab", action="store_true",
                    help="A/B the first-bucket cap against one size for every bucket")
    results.add_write_flag(ap)
    args = ap.parse_args()
    args.load0 = os.getloadavg()[0]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic_token_file(Path(tmp) / "bench.bin", 400_000, args.vocab)
        if args.first_bucket_ab:
            _first_bucket_ab(args, path)
            return
        ddp_bytes = run_ranks(_ddp, args.world, args, path, count_bytes=True, timeout=600)[0]
        plait_runs, ddp_runs = [], []
        for _ in range(args.runs):  # alternate the two so that machine noise hits both alike
            plait_runs.append(run_ranks(_plait, args.world, args, path, timeout=600)[0])
            ddp_runs.append(run_ranks(_ddp, args.world, args, path, timeout=600)[0])
    p_ms, d_ms = median_ms(plait_runs), median_ms(ddp_runs)
    print(f"model {args.model}, world {args.world} (gloo, CPU), {args.steps} steps, "
          f"median of {args.runs} runs")
    print(f"{'':8}{'step ms':>10}{'grad bytes/step/rank':>24}{'calls':>7}")
    print(f"{'plait':8}{p_ms:>10.1f}{plait_runs[0]['bytes']:>24,.0f}{plait_runs[0]['calls']:>7}")
    print(f"{'DDP':8}{d_ms:>10.1f}{ddp_bytes['bytes']:>24,.0f}{ddp_bytes['calls']:>7}")
    ratio = p_ms / d_ms
    print(f"ratio plait/DDP step time: {ratio:.3f}  goal <= {GOAL:.2f}: {met(ratio, GOAL)}")
    print(f"max |loss difference| over steps: {max_loss_gap(plait_runs[0], ddp_runs[0]):.2e}")
    rows = [("dp_vs_ddp.py: bucketed DP / DDP, step time", f"{ratio:.3f}", f"≤ {GOAL:.2f}",
             met(ratio, GOAL))]
    print(performance_rows(rows))
    _write(args, rows)


def _write(args, rows: list) -> None:
    if not args.write:
        return
    results.write(
        args.write, "Bucketed data parallel against torch DDP",
        [f"Model {args.model}, world {args.world} (gloo, CPU), {args.steps} steps, the median "
         f"of {args.runs} alternated runs:\n\n" + results.goal_table(rows)],
        "plait's bucketed data parallel / DDP step time, the same model, weights and batches "
        "(goal ≤ 0.90). With --first-bucket-ab the bracket is the ratio with one bucket size "
        "for every bucket (no 1 MB first bucket). Both run the same work per rank; with more "
        "ranks than cores their step times differ by how the ranks' waits interleave.",
        run=results.run_line(args.load0))


def _first_bucket_ab(args, path) -> None:
    """Capped first bucket (A), no cap (B) and DDP, in turn `args.runs` times; medians."""
    runs: dict[str, list[dict]] = {"capped": [], "uncapped": [], "DDP": []}
    for _ in range(args.runs):
        runs["capped"].append(run_ranks(_plait, args.world, args, path, timeout=600)[0])
        runs["uncapped"].append(run_ranks(_plait, args.world, args, path, False,
                                          timeout=600)[0])
        runs["DDP"].append(run_ranks(_ddp, args.world, args, path, timeout=600)[0])
    ms = {k: median_ms(v) for k, v in runs.items()}
    print(f"model {args.model}, world {args.world} (gloo, CPU), {args.steps} steps, "
          f"median of {args.runs} runs, alternated")
    for name, value in ms.items():
        each = " ".join(f"{mean_step_time(r['times'], warmup=WARMUP) * 1e3:.1f}"
                        for r in runs[name])
        calls = (f"   gradient all-reduces/step: {runs[name][0]['calls']}"
                 if name != "DDP" else "")
        print(f"{name:10}{value:>10.1f} ms   runs: {each}{calls}")
    print(f"first bucket capped at {FIRST_BUCKET_MB:g} MB / DDP: {ms['capped'] / ms['DDP']:.3f}"
          f"   one bucket size / DDP: {ms['uncapped'] / ms['DDP']:.3f}   goal <= {GOAL:.2f}")
    print("keep the cap" if ms["capped"] <= ms["uncapped"] else "drop the cap")
    capped, one = ms["capped"] / ms["DDP"], ms["uncapped"] / ms["DDP"]
    rows = [("dp_vs_ddp.py: bucketed DP / DDP, step time",
             f"{capped:.3f} (one bucket size: {one:.3f})", f"≤ {GOAL:.2f}", met(capped, GOAL))]
    print(performance_rows(rows))
    _write(args, rows)


if __name__ == "__main__":
    main()
