"""`plait calibrate --out profile.json`: measure this machine in the planner's terms.

On one intra-op thread (the runtime's: each rank owns one; docs/architecture.md, Facts):
GEMM throughput over shapes from skinny to square, each as a linear layer's three GEMMs in
autograd's layouts, fp32 and bf16 (the efficiency curve of plait/plan/compute.py); causal
attention (SDPA) forward throughput at a training micro-batch's (batch, heads) in plait's
layout; memory bandwidth (a large copy); plait's own training step (plait/calibrate/steps.py:
the operations it dispatches, the bytes its element-wise operations move, their bandwidth
replayed, the dispatch floor); and, with `--ranks N` >= 2 (gloo, forked ranks through
plait.launch.forked's harness), every collective through plait.comm.ops for each group size
dividing N, its seconds and algorithmic bytes read back from the rank's ledger (and the
CPU seconds the rank's threads spent per call: the caller's and the backend's), how
much of a collective compute beside it hides, and what a collective issued after compute
costs beyond the fit's price (the ranks' compute jitter and the wait after the last
rank's arrival: steps.measure_sync), what posting a batch of pipeline
transfers holds a rank (steps.measure_post), the pipeline runtime's own time
before each compute action (steps.measure_gap: plait's runtime trained at pp = 2),
a few GEMMs on every rank at once (their throughput beside another rank's over alone),
and plait's floor step at tp = 2 on two ranks a core (calibrate/tp.py: a tp rank's CPU beyond
the per-operation and per-collective prices where ranks share cores).
Each measurement is the best of a few repeats (the machine is shared: the best is the least
disturbed; the gap: a median; the sync numbers: means over every call, a heavy-tailed
wait a step pays in full), compute in the thread's CPU seconds,
collectives on the wall clock. The fit (plait/plan/profile.py) is written
with the raw numbers; `plait plan --hardware profile.json` plans with it.

Measures 10-35 s (most of it the first training step's setup and the ranks' fork);
`--quick` (tests) fewer shapes and repeats. CPU only: measuring a GPU (CUDA kernels,
NCCL) is not built yet.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from functools import partial
from typing import Any

from plait.calibrate.steps import (
    ELEMENTWISE_MODELS,
    best_seconds,
    elementwise_replay,
    measure_dispatch,
    measure_gap,
    measure_post,
    measure_sync,
)
from plait.calibrate.tp import measure_tp_floor

# (m, k, n): the tiny models' GEMMs (tokens x hidden x 3 hidden, x ffn, ...) up to 512^3.
# Calls stay a few ms long so that the best of several repeats is one the shared machine's
# scheduler did not interrupt; bf16 (often emulated on a CPU: tens of times slower) gets
# the small ones only.
GEMM_SHAPES = [(64, 64, 64), (128, 64, 192), (256, 64, 176), (256, 128, 128),
               (256, 256, 256), (512, 64, 192), (512, 128, 384), (512, 256, 256),
               (512, 512, 512)]
BF16_SHAPES = [(64, 64, 64), (128, 64, 192), (256, 128, 128)]
QUICK_GEMMS = [(64, 64, 64), (256, 128, 128), (512, 256, 256)]
# timed again on every rank at once (_concurrent_gemms): small to the largest
CONCURRENT_SHAPES = [(128, 64, 192), (256, 128, 128), (512, 256, 256), (512, 512, 512)]
# batch, heads, seq, head dim: as many (sequence, head) pairs as a training micro-batch
# has (the tiny models' 8 x 4), laid out as plait's attention passes them ((b, s, h, d)
# transposed: not contiguous), whose per-call overhead one contiguous head would misstate
ATTENTION = [(8, 4, 64, 16), (4, 4, 128, 16), (2, 4, 256, 32)]
QUICK_ATTENTION = [(8, 4, 64, 16), (2, 4, 256, 32)]
COLLECTIVE_BYTES = [1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22]
QUICK_BYTES = [1 << 12, 1 << 16, 1 << 20]
DEVICE = "cpu"  # this machine's CPU, gloo; a GPU's calibrate is not built yet


def measure_compute(quick: bool) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    reps, min_t = (3, 0.002) if quick else (7, 0.005)
    out: dict[str, Any] = {"gemm": [], "attention": []}
    gen = torch.Generator().manual_seed(0)
    shapes = {torch.float32: QUICK_GEMMS if quick else GEMM_SHAPES,
              torch.bfloat16: QUICK_GEMMS[:2] if quick else BF16_SHAPES}
    for dtype, dtype_shapes in shapes.items():
        for m, k, n in dtype_shapes:
            out["gemm"].append({"m": m, "k": k, "n": n, "dtype": str(dtype).split(".")[1],
                                "seconds": linear_gemm_seconds(m, k, n, dtype, gen, reps,
                                                               min_t)})
    for batch, heads, s, d in (QUICK_ATTENTION if quick else ATTENTION):
        sec = _attention_seconds(batch, heads, s, d, gen, reps, min_t)
        out["attention"].append({"batch": batch, "heads": heads, "seq": s, "head_dim": d,
                                 "seconds": sec,  # causal: half the score matrix
                                 "flops": 3 * 4.0 * s * s * batch * heads * d / 2})
    out["elementwise"] = [elementwise_replay(*size, reps=3 if quick else 5)
                          for size in ELEMENTWISE_MODELS]
    src = torch.ones(8 << 20, dtype=torch.float32, device=DEVICE)  # 32 MiB, past the caches
    dst = torch.empty_like(src)
    sec = best_seconds(lambda: dst.copy_(src), reps, min_t)
    out["memory"] = {"bytes": 2.0 * src.numel() * 4, "seconds": sec}  # read + write
    return out


def linear_gemm_seconds(m: int, k: int, n: int, dtype: Any, gen: Any, reps: int,
                        min_t: float) -> float:
    """A linear layer of k inputs and n outputs over m tokens: its forward x w^T, its
    input gradient dy w and its weight gradient dy^T x, in the layouts autograd passes
    them (transposed views): each 2mkn FLOPs; the mean of their best thread CPU seconds."""
    import torch

    x, dy, w = (torch.randn(*s, generator=gen, device=DEVICE).to(dtype)
                for s in ((m, k), (m, n), (n, k)))
    calls = (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x)
    return sum(best_seconds(c, reps, min_t) for c in calls) / len(calls)


def _concurrent_gemms(mesh: Any, quick: bool) -> list[dict[str, Any]]:
    """The fp32 GEMMs of CONCURRENT_SHAPES timed as measure_compute times them, on every
    rank at once (started together): what a rank's GEMMs run at while the host's other
    cores run another rank's (shared caches, memory bandwidth, clocks), which a one-process
    calibration never sees. Best of repeats: an upper bound (a repeat the other rank did
    not overlap counts as well)."""
    import torch

    from plait.comm import ops

    reps, min_t = (3, 0.002) if quick else (7, 0.005)
    gen = torch.Generator().manual_seed(0)
    ops.all_reduce(torch.zeros(1, device=DEVICE), mesh, "tp", tag="calibrate")  # together
    return [{"m": m, "k": k, "n": n, "dtype": "float32",
             "seconds": linear_gemm_seconds(m, k, n, torch.float32, gen, reps, min_t)}
            for m, k, n in (QUICK_GEMMS if quick else CONCURRENT_SHAPES)]


def _attention_seconds(batch: int, heads: int, s: int, d: int, gen: Any, reps: int,
                       min_t: float) -> float:
    """Causal attention's forward + backward kernels on CPU, as plait's block calls them
    (q and k contiguous after RoPE, v and the output's gradient (b, s, h, d) transposed):
    the planner runs the core's forward time 3 times, and this kernel's backward costs
    1.8-2.6 x its forward here, not the GEMMs' 2 (autograd's own work is the dispatch
    floor's). Without the CPU flash kernel's backward op: 3 x the forward."""
    import torch

    aten = torch.ops.aten
    q, k = (torch.randn(batch, heads, s, d, generator=gen, device=DEVICE) for _ in range(2))
    v, grad = (torch.randn(batch, s, heads, d, generator=gen, device=DEVICE).transpose(1, 2)
               for _ in range(2))
    fwd = best_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True), reps, min_t)
    if not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return 3 * fwd
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    bwd = best_seconds(lambda: aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, True), reps, min_t)
    return fwd + bwd


def _collectives_rank(rank: int, world: int, sizes: list[int], reps: int, quick: bool
                      ) -> dict[str, list]:
    import torch

    from plait.comm import ops
    from plait.config import ParallelConfig
    from plait.mesh import ParallelMesh

    out: dict[str, list] = {}
    for g in (d for d in range(2, world + 1) if world % d == 0):
        mesh = ParallelMesh.build(ParallelConfig(tp=g, dp=world // g))
        for nbytes in sizes:
            x = torch.ones(nbytes // 4, device=DEVICE)
            shard = torch.empty(x.numel() // g, device=DEVICE)
            calls = {"all_reduce": partial(ops.all_reduce, x, mesh, "tp"),
                     "all_gather": partial(ops.all_gather, x, shard, mesh, "tp"),
                     "reduce_scatter": partial(ops.reduce_scatter, shard, x, mesh, "tp")}
            for op, call in calls.items():
                call()  # a warm-up
                start = len(mesh.ledger.records)
                cpu = []  # every thread of the rank's, per call: the caller's, gloo's
                for _ in range(reps):
                    c0 = time.process_time()
                    call()
                    cpu.append(time.process_time() - c0)
                recs = mesh.ledger.records[start:]
                out.setdefault(f"{op}@{g}", []).append(
                    {"payload": recs[0].payload, "sent": recs[0].sent,
                     "seconds": min(r.seconds for r in recs),
                     "cpu_seconds": statistics.median(cpu)})  # a disturbed call's polls
    out["overlap"] = [_overlap(mesh, reps)]  # the largest group's (the last mesh built)
    # a collective after compute on every rank, as the runtime issues it (calibrate/steps.py)
    out["sync"] = [measure_sync(mesh, "tp", 8 if quick else 40, 3 if quick else 6)]
    out["post"] = [measure_post(mesh, "tp", 8 if quick else 30, 2 if quick else 3)]
    out["gemm_concurrent"] = _concurrent_gemms(mesh, quick)
    if world % 2 == 0:  # the pipeline runtime's own time before each compute, at pp = 2
        out["pipeline_gap"] = [measure_gap(world, 4 if quick else 8, 2 if quick else 3)]
    return out


def _overlap(mesh: Any, reps: int) -> dict[str, float]:
    """Seconds of a 1 MiB all-reduce alone, of GEMMs about as long alone, and of the two
    together (the all-reduce issued asynchronously, the GEMMs run, then waited for): how
    much of a collective compute can hide on this machine (a GPU's copy engines and SMs
    run both at once; a CPU's gloo threads share the cores with the compute)."""
    import torch

    from plait.comm import ops

    x = torch.ones(1 << 18, device=DEVICE)
    a = torch.randn(256, 256, device=DEVICE)

    def sync() -> None:  # every rank starts each call together
        ops.all_reduce(torch.zeros(1, device=DEVICE), mesh, "tp", tag="calibrate")

    def best(fn: Any) -> float:
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    comm_s = best(lambda: ops.all_reduce(x, mesh, "tp"))
    one = best(lambda: a @ a)
    gemms = max(1, round(comm_s / max(one, 1e-7)))

    def compute() -> None:
        for _ in range(gemms):
            a @ a

    def both() -> None:
        handle = ops.all_reduce(x, mesh, "tp", async_op=True)
        compute()
        handle.wait()

    return {"comm_seconds": comm_s, "compute_seconds": best(compute),
            "both_seconds": best(both)}


def measure_collectives(ranks: int, quick: bool) -> dict[str, list]:
    if ranks < 2:
        return {}
    from plait.launch.forked import run_ranks

    sizes, reps = (QUICK_BYTES, 3) if quick else (COLLECTIVE_BYTES, 15)
    return run_ranks(_collectives_rank, ranks, sizes, reps, quick, timeout=120.0)[0]


def calibrate(ranks: int, quick: bool = False) -> dict[str, Any]:
    """The profile of this machine: raw measurements and their fit."""
    from plait.plan.profile import PROFILE_VERSION, fit_profile

    t0 = time.perf_counter()
    raw = measure_compute(quick)
    raw["dispatch"] = measure_dispatch(quick)
    raw["collectives"] = measure_collectives(ranks, quick)
    raw["overlap"] = raw["collectives"].pop("overlap", [None])[0]
    raw["sync"] = raw["collectives"].pop("sync", [None])[0]
    raw["post"] = raw["collectives"].pop("post", [None])[0]
    raw["pipeline_gap"] = raw["collectives"].pop("pipeline_gap", [None])[0]
    raw["gemm_concurrent"] = raw["collectives"].pop("gemm_concurrent", [])
    if ranks >= 2:  # a tp rank's CPU beyond the prices where two ranks share a core
        raw["tp_floor"] = measure_tp_floor(quick)
    today = datetime.date.today().isoformat()
    return {"version": PROFILE_VERSION, "name": f"cpu-{platform.machine()}-{today}",
            "date": today, "device": "cpu", "threads_per_rank": 1, "ranks": ranks,
            "ranks_per_node": max(os.cpu_count() or 1, ranks),
            "cores": len(os.sched_getaffinity(0)),  # the ranks' cores (plan/host_share.py)
            "memory_bytes": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
            "torch": __import__("torch").__version__, "python": platform.python_version(),
            "load_average": os.getloadavg()[0],  # the machine is shared: how busy it was
            "measure_seconds": time.perf_counter() - t0, "raw": raw, "fit": fit_profile(raw)}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("calibrate", help="measure this machine's GEMM, attention, "
                              "memory and collective speeds for plait plan --hardware",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the profile JSON to write")
    p.add_argument("--ranks", type=int, default=2, metavar="N",
                   help="gloo ranks for the collectives (default 2; 1: none measured)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    p.add_argument("--force", action="store_true", help="replace an existing --out profile "
                   "(by default plait refuses to)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import json

    from plait.files import artifact_problems, write_text_atomic

    problems = artifact_problems("--out", args.out, force=args.force)
    if not 1 <= args.ranks <= 8:
        problems.append(f"--ranks {args.ranks}: use 1 to 8 (one gloo rank per core is what "
                        "the runtime does)")
    if problems:
        for p in problems:
            print(f"plait calibrate: error: {p}", file=sys.stderr)
        return 2
    prof = calibrate(args.ranks, args.quick)
    write_text_atomic(args.out, json.dumps(prof, indent=1) + "\n")
    fit = prof["fit"]
    link = fit["link"]
    print(f"plait calibrate: {prof['name']}: fp32 GEMM peak {fit['gemm']['peak_flops'] / 1e9:.1f}"
          f" GFLOP/s (half at {fit['gemm']['gemm_half']:.3g} FLOPs), bf16 "
          f"{fit['bf16_peak_flops'] / 1e9:.1f}, attention x{fit['attention_scale']:.2f} of "
          f"the GEMM curve, memory {fit['memory_bw_Bps'] / 1e9:.1f} GB/s"
          + (f", all-reduce over {fit['link_group']}: {link['bandwidth_Bps'] / 1e9:.2f} GB/s, "
             f"alpha {link['alpha_s'] * 1e6:.0f} us" if link else "")
          + _sync_words(fit) + f"; {prof['measure_seconds']:.1f} s; written to {args.out}")
    return 0


def _sync_words(fit: dict[str, Any]) -> str:
    """The sync extra priced per segment (the mean over every call) with its repeats'
    spread (each repeat's mean), and the pipeline's gap."""
    spread = fit.get("sync_spread") or []
    priced = (fit.get("sync") or {}).get("sync_after") or [r["median"] for r in spread]
    words = ", ".join(f"{p * 1e3:.2f} ({r['low'] * 1e3:.2f} to {r['high'] * 1e3:.2f})"
                      f" after {r['compute_seconds'] * 1e3:g}"
                      for p, r in zip(priced, spread, strict=False))
    out = f"; sync extra ms {words} ms of compute" if words else ""
    if fit.get("pipeline_gap"):
        out += f"; pipeline gap {fit['pipeline_gap'] * 1e6:.0f} us a compute"
    return out
