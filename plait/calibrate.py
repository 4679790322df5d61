"""`plait calibrate --out profile.json`: measure this machine in the planner's terms.

On one intra-op thread (the runtime's: each rank owns one; docs/architecture.md, Facts):
GEMM throughput over shapes from skinny to square, fp32 and bf16 (the efficiency curve of
plait/plan/compute.py); causal attention (SDPA) forward throughput; memory bandwidth (a
large copy); the operations plait's block and optimizer issue and the seconds each costs
when its tensors are tiny (the dispatch floor); and, with `--ranks N` >= 2 (gloo, forked
ranks through plait.testing's harness), every collective through plait.comm.ops for
each group size dividing N, its seconds and algorithmic bytes read back from the rank's
ledger. Each measurement is the best of a few repeats (the machine is shared: the best
is the least disturbed). The fit (plait/plan/profile.py) is written with the raw
numbers; `plait plan --hardware profile.json` plans with it.

Measures a few seconds by default; `--quick` (tests) fewer shapes and repeats. CPU only:
measuring a GPU (CUDA kernels, NCCL) is not built yet.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from functools import partial
from typing import Any

# (m, k, n): the tiny models' GEMMs (tokens x hidden x 3 hidden, x ffn, ...) up to 512^3.
# Calls stay a few ms long so that the best of several repeats is one the shared machine's
# scheduler did not interrupt; bf16 (often emulated on a CPU: tens of times slower) gets
# the small ones only.
GEMM_SHAPES = [(64, 64, 64), (128, 64, 192), (256, 64, 176), (256, 128, 128),
               (256, 256, 256), (512, 64, 192), (512, 128, 384), (512, 256, 256),
               (512, 512, 512)]
BF16_SHAPES = [(64, 64, 64), (128, 64, 192), (256, 128, 128)]
QUICK_GEMMS = [(64, 64, 64), (256, 128, 128), (512, 256, 256)]
ATTENTION = [(4, 64, 16), (4, 256, 16), (4, 512, 32)]  # heads, seq, head dim (batch 1)
QUICK_ATTENTION = [(4, 64, 16), (4, 256, 16)]
COLLECTIVE_BYTES = [1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22]
QUICK_BYTES = [1 << 12, 1 << 16, 1 << 20]
DEVICE = "cpu"  # this machine's CPU, gloo; a GPU's calibrate is not built yet


def _best_seconds(fn: Any, repeats: int, min_time: float) -> float:
    """The best time of `repeats` runs, each run as many calls as fill `min_time`."""
    fn()  # warm-up
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, int(min_time / one))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def measure_compute(quick: bool) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    reps, min_t = (3, 0.002) if quick else (7, 0.005)
    out: dict[str, Any] = {"gemm": [], "attention": []}
    gen = torch.Generator().manual_seed(0)
    shapes = {torch.float32: QUICK_GEMMS if quick else GEMM_SHAPES,
              torch.bfloat16: QUICK_GEMMS[:2] if quick else BF16_SHAPES}
    for dtype, dtype_shapes in shapes.items():
        for m, k, n in dtype_shapes:
            a = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
            b = torch.randn(k, n, generator=gen, device=DEVICE).to(dtype)
            out["gemm"].append({"m": m, "k": k, "n": n, "dtype": str(dtype).split(".")[1],
                                "seconds": _best_seconds(lambda a=a, b=b: a @ b, reps, min_t)})
    for heads, s, d in (QUICK_ATTENTION if quick else ATTENTION):
        q, k, v = (torch.randn(1, heads, s, d, generator=gen, device=DEVICE)
                   for _ in range(3))
        sec = _best_seconds(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True), reps, min_t)
        out["attention"].append({"heads": heads, "seq": s, "head_dim": d, "seconds": sec,
                                 "flops": 4.0 * s * s * heads * d / 2})  # causal: half
    src = torch.ones(8 << 20, dtype=torch.float32, device=DEVICE)  # 32 MiB, past the caches
    dst = torch.empty_like(src)
    sec = _best_seconds(lambda: dst.copy_(src), reps, min_t)
    out["memory"] = {"bytes": 2.0 * src.numel() * 4, "seconds": sec}  # read + write
    return out


def _count_ops(fn: Any) -> int:
    """The aten operations `fn` dispatches (forward and autograd's backward alike)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.n += 1
            return func(*args, **(kwargs or {}))

    with Count() as mode:
        fn()
    return mode.n


def measure_dispatch(quick: bool) -> dict[str, Any]:
    """Operations plait's own block and optimizer issue (counted on 1- and 2-layer models:
    the difference is one layer's) and the seconds per operation of a training step of a
    model so small that its GEMMs cost nothing (the dispatch floor)."""
    import torch

    from plait.model.loss import token_loss
    from plait.model.presets import ModelConfig
    from plait.model.transformer import build_model
    from plait.optim import MixedPrecisionAdamW

    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 17), generator=gen, device=DEVICE)
    for layers in (1, 2):
        cfg = ModelConfig(vocab_size=64, dim=16, n_layers=layers, n_heads=2, n_kv_heads=2,
                          ffn_dim=32, max_seq_len=16)
        model = build_model(cfg, seed=0)
        opt = MixedPrecisionAdamW(list(model.named_parameters()), (0.9, 0.95), 1e-8, 0.1)

        def step(model=model) -> None:
            token_loss(model(tokens[:, :-1]), tokens[:, 1:], 32).backward()

        out[f"step_ops_{layers}"] = _count_ops(step)
        out[f"optimizer_ops_{layers}"] = _count_ops(lambda opt=opt: opt.step(1e-3))
        if layers == 2:
            out["step_seconds"] = _best_seconds(step, 3 if quick else 7, 0.005)
    return out


def _collectives_rank(rank: int, world: int, sizes: list[int], reps: int) -> dict[str, list]:
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
                start = len(mesh.ledger.records)
                for _ in range(reps + 1):
                    call()
                recs = mesh.ledger.records[start + 1:]  # the first is a warm-up
                out.setdefault(f"{op}@{g}", []).append(
                    {"payload": recs[0].payload, "sent": recs[0].sent,
                     "seconds": min(r.seconds for r in recs)})
    return out


def measure_collectives(ranks: int, quick: bool) -> dict[str, list]:
    if ranks < 2:
        return {}
    from plait.testing import run_ranks

    sizes, reps = (QUICK_BYTES, 3) if quick else (COLLECTIVE_BYTES, 7)
    return run_ranks(_collectives_rank, ranks, sizes, reps, timeout=120.0)[0]


def calibrate(ranks: int, quick: bool = False) -> dict[str, Any]:
    """The profile of this machine: raw measurements and their fit."""
    from plait.plan.profile import PROFILE_VERSION, fit_profile

    t0 = time.perf_counter()
    raw = measure_compute(quick)
    raw["dispatch"] = measure_dispatch(quick)
    raw["collectives"] = measure_collectives(ranks, quick)
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
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import json

    from plait.files import output_problems, write_text_atomic

    problems = output_problems("--out", args.out)
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
          + f"; {prof['measure_seconds']:.1f} s; written to {args.out}")
    return 0
