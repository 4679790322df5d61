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
# batch, heads, seq, head dim: as many (sequence, head) pairs as a training micro-batch
# has (the tiny models' 8 x 4), laid out as plait's attention passes them ((b, s, h, d)
# transposed: not contiguous), whose per-call overhead one contiguous head would misstate
ATTENTION = [(8, 4, 64, 16), (4, 4, 128, 16), (2, 4, 256, 32)]
QUICK_ATTENTION = [(8, 4, 64, 16), (2, 4, 256, 32)]
# (hidden, ffn, batch, seq) of two 2-layer models whose block's element-wise operations
# are replayed one by one: tensors of a few KiB (the floor) and of a few hundred KiB
ELEMENTWISE_MODELS = [(16, 32, 2, 16), (64, 176, 8, 64)]
COLLECTIVE_BYTES = [1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22]
QUICK_BYTES = [1 << 12, 1 << 16, 1 << 20]
DEVICE = "cpu"  # this machine's CPU, gloo; a GPU's calibrate is not built yet


def _best_seconds(fn: Any, repeats: int, min_time: float) -> float:
    """The best time of `repeats` runs, each run as many calls as fill `min_time`, in this
    thread's CPU seconds: on one intra-op thread a call's work is this thread's, and its
    CPU time leaves out the time other processes of a shared machine held the core."""
    fn()  # warm-up
    t0 = time.thread_time()
    fn()
    one = max(time.thread_time() - t0, 1e-7)
    calls = max(1, int(min_time / one))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - t0) / calls)
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
            # a linear layer of k inputs and n outputs over m tokens: its forward x w^T, its
            # input gradient dy w and its weight gradient dy^T x, in the layouts autograd
            # passes them (transposed views): each 2mkn FLOPs; the shape's time is their mean
            x, dy, w = (torch.randn(*s, generator=gen, device=DEVICE).to(dtype)
                        for s in ((m, k), (m, n), (n, k)))
            calls = (lambda x=x, w=w: x @ w.t(), lambda dy=dy, w=w: dy @ w,
                     lambda dy=dy, x=x: dy.t() @ x)
            sec = sum(_best_seconds(c, reps, min_t) for c in calls) / len(calls)
            out["gemm"].append({"m": m, "k": k, "n": n, "dtype": str(dtype).split(".")[1],
                                "seconds": sec})
    for batch, heads, s, d in (QUICK_ATTENTION if quick else ATTENTION):
        q, k, v = (torch.randn(batch, s, heads, d, generator=gen, device=DEVICE)
                   .transpose(1, 2) for _ in range(3))
        sec = _best_seconds(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True), reps, min_t)
        out["attention"].append({"batch": batch, "heads": heads, "seq": s, "head_dim": d,
                                 "seconds": sec,  # causal: half the score matrix
                                 "flops": 4.0 * s * s * batch * heads * d / 2})
    out["elementwise"] = [_elementwise_replay(*size, reps=3 if quick else 5)
                          for size in ELEMENTWISE_MODELS]
    src = torch.ones(8 << 20, dtype=torch.float32, device=DEVICE)  # 32 MiB, past the caches
    dst = torch.empty_like(src)
    sec = _best_seconds(lambda: dst.copy_(src), reps, min_t)
    out["memory"] = {"bytes": 2.0 * src.numel() * 4, "seconds": sec}  # read + write
    return out


# operations that move no data (views, allocations) or are priced elsewhere (GEMMs and the
# attention kernel: their own curves)
NO_TRAFFIC = {"view", "_unsafe_view", "transpose", "t", "expand", "as_strided", "slice",
              "select", "unsqueeze", "squeeze", "detach", "alias", "permute", "split",
              "split_with_sizes", "unbind", "reshape", "lift_fresh", "empty", "empty_like",
              "empty_strided", "mm", "addmm", "bmm"}


def _count_ops(fn: Any) -> tuple[int, int]:
    """(the aten operations `fn` dispatches, forward and autograd's backward alike; the
    bytes the element-wise ones among them read and write: every tensor argument and
    result, views, GEMMs and attention left out)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        n = 0
        traffic = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.n += 1
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name not in NO_TRAFFIC and "attention" not in name:
                self.traffic += sum(t.numel() * t.element_size() for t in
                                    tree_flatten((args, kwargs, out))[0]
                                    if isinstance(t, torch.Tensor))
            return out

    with Count() as mode:
        fn()
    return mode.n, mode.traffic


def _elementwise_replay(dim: int, ffn: int, batch: int, seq: int, reps: int
                        ) -> dict[str, float]:
    """plait's block forward + backward (2 layers, fp32) captured by a dispatch mode; each
    element-wise operation (NO_TRAFFIC and attention left out) replayed alone on copies of
    its arguments, best of `reps`: their count, the bytes they read and write, and the
    sum of their seconds (the real mix: broadcasts, reductions, strided views; what a
    streaming copy's bandwidth would overstate)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map

    from plait.model.loss import token_loss
    from plait.model.presets import ModelConfig
    from plait.model.transformer import build_model

    cfg = ModelConfig(vocab_size=64, dim=dim, n_layers=2, n_heads=2, n_kv_heads=2,
                      ffn_dim=ffn, max_seq_len=seq)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 64, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    calls: list[tuple[Any, Any, Any, int]] = []

    def copy(t: Any) -> Any:
        return t.detach().clone() if isinstance(t, torch.Tensor) else t

    class Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.overloadpacket.__name__
            if name not in NO_TRAFFIC and "attention" not in name:
                nbytes = sum(t.numel() * t.element_size() for t in
                             tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor))
                calls.append((func, tree_map(copy, args), tree_map(copy, kwargs), nbytes))
            return out

    with Capture():
        token_loss(model(tokens[:, :-1]), tokens[:, 1:], batch * seq).backward()
    seconds = sum(_best_seconds(lambda f=f, a=a, k=k: f(*a, **k), reps, 2e-4)
                  for f, a, k, _ in calls)
    return {"hidden": dim, "ops": len(calls), "bytes": float(sum(c[3] for c in calls)),
            "seconds": seconds}


def _runtime_steps(layers: int, steps: int, count: bool) -> tuple[int, list[float]]:
    """plait's own training step (`plait.train.loop.train` on one rank: micro-batches,
    grad norm, clip, AdamW, zero_grad, the logged loss) of a model so small that its GEMMs
    cost nothing: (the aten operations of its last step, counted, when `count`; else
    this thread's CPU seconds of every step, the first with the setup: _best_seconds)."""
    import tempfile

    from torch.utils._python_dispatch import TorchDispatchMode

    from plait.config import load_config
    from plait.mesh import ParallelMesh
    from plait.train.data import GlobalBatches, TokenFile, synthetic_token_file
    from plait.train.loop import train

    cfg = load_config(sets=["model_name=tiny", "model.vocab_size=64", "model.dim=16",
                            f"model.n_layers={layers}", "model.n_heads=2",
                            "model.n_kv_heads=2", "model.ffn_dim=32", "model.max_seq_len=16",
                            "train.seq_len=16", "train.global_batch=2", f"train.steps={steps}",
                            "train.warmup_steps=1", "train.precision=fp32"]).check(1)
    with tempfile.TemporaryDirectory(prefix="plait-calibrate-") as tmp:
        data = TokenFile.open(synthetic_token_file(f"{tmp}/tokens.bin", 4096, 64, seed=0))
        batches = GlobalBatches(data, 16, 2, cfg.train.seed, 64)
        ops, cpu = [0], [time.thread_time()]

        def cpu_times(row: dict) -> None:  # this thread's CPU seconds per step (docstring)
            now = time.thread_time()
            times.append(now - cpu[0])
            cpu[0] = now

        times: list[float] = []

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                ops[0] += 1
                return func(*args, **(kwargs or {}))

        def on_step(row: dict) -> None:
            if row["step"] == steps - 2:
                ops[0] = 0  # the last step's operations only (its row's emit included)

        if count:
            with Count():
                train(cfg, ParallelMesh.build(cfg.parallel), batches, on_step=on_step)
        else:
            train(cfg, ParallelMesh.build(cfg.parallel), batches, on_step=cpu_times)
    return ops[0], times


def measure_dispatch(quick: bool) -> dict[str, Any]:
    """Operations plait's own block issues forward and backward (counted on 1- and 2-layer
    models: the difference is one layer's) and those of the rest of plait's training step
    (grad norm, clip, optimizer, zero_grad, the logged loss: `optimizer_ops_*`); the
    seconds per operation of plait's training step of a model so small that its GEMMs cost
    nothing (the dispatch floor: the fastest of its steps / its operations)."""
    import torch

    from plait.model.loss import token_loss
    from plait.model.presets import ModelConfig
    from plait.model.transformer import build_model
    from plait.plan.memory import layer_activations
    from plait.plan.shape import from_model_config

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 17), generator=gen, device=DEVICE)
    for layers in (1, 2):
        cfg = ModelConfig(vocab_size=64, dim=16, n_layers=layers, n_heads=2, n_kv_heads=2,
                          ffn_dim=32, max_seq_len=16)
        model = build_model(cfg, seed=0)

        def step(model=model) -> None:
            token_loss(model(tokens[:, :-1]), tokens[:, 1:], 32).backward()

        out[f"step_ops_{layers}"], out[f"elementwise_bytes_{layers}"] = _count_ops(step)
        whole, _ = _runtime_steps(layers, 3, count=True)
        out[f"optimizer_ops_{layers}"] = whole - out[f"step_ops_{layers}"]
    _, times = _runtime_steps(2, 8 if quick else 30, count=False)
    out["step_seconds"] = min(times[1:])  # the first step warms up
    out["runtime_step_ops"] = out["step_ops_2"] + out["optimizer_ops_2"]
    # what the planner's proxy for element-wise traffic says a layer of this model saves
    # (fp32, flash: SDPA's tensors), the unit of `elementwise_passes`
    out["layer_saved_bytes"] = float(layer_activations(
        from_model_config(cfg, seq=16), 2, 1, 1, False, "none", 4, "flash"))
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
    out["overlap"] = [_overlap(mesh, reps)]  # the largest group's (the last mesh built)
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
    from plait.testing import run_ranks

    sizes, reps = (QUICK_BYTES, 3) if quick else (COLLECTIVE_BYTES, 15)
    return run_ranks(_collectives_rank, ranks, sizes, reps, timeout=120.0)[0]


def calibrate(ranks: int, quick: bool = False) -> dict[str, Any]:
    """The profile of this machine: raw measurements and their fit."""
    from plait.plan.profile import PROFILE_VERSION, fit_profile

    t0 = time.perf_counter()
    raw = measure_compute(quick)
    raw["dispatch"] = measure_dispatch(quick)
    raw["collectives"] = measure_collectives(ranks, quick)
    raw["overlap"] = raw["collectives"].pop("overlap", [None])[0]
    today = datetime.date.today().isoformat()
    return {"version": PROFILE_VERSION, "name": f"cpu-{platform.machine()}-{today}",
            "date": today, "device": "cpu", "threads_per_rank": 1, "ranks": ranks,
            "ranks_per_node": max(os.cpu_count() or 1, ranks),
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
