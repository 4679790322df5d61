"""The GPU check's speed-up sections (benchmarks/gpu_check.py): what `--compile` and
`--async-tp` are worth on this machine's GPUs, each beside the same run without it.

`section_compile` (one GPU): the throughput section's model and batch (gpu_check.py),
eager and with every block compiled by inductor: tokens/s and MFU over the steps after
the first, and the first step's extra seconds (compilation).
`section_async_tp` (two GPUs or more, NCCL): the same model at tp = the GPUs seen with
sequence parallel, plain and async: tokens/s, MFU and rank 0's exposed and hidden tp
communication per step (the ledger's overlap figures, docs/async_tp.md).
On CPU (`--device cpu --smoke`) the same code runs on gloo ranks, tiny, compiled by
aot_eager (no C++ build): the code paths only.
"""

from __future__ import annotations

import copy
import statistics
from pathlib import Path

from plait.launch.forked import run_ranks

WARMUP = 1  # the first step (compilation, allocator warm-up) is left out of tokens/s


def _rates(cfg, times: list[float], peak: float) -> tuple[float, float]:
    """(tokens/s, MFU) over the steps after the warm-up."""
    from plait.throughput import tokens_per_step

    step = statistics.mean(times[WARMUP:]) if len(times) > WARMUP else times[-1]
    tps = tokens_per_step(cfg.train.global_batch, cfg.train.seq_len) / step
    return tps, tps * cfg.model.flops_per_token(cfg.train.seq_len) / peak / cfg.parallel.tp


def _base(args):
    """Section 1's config: its model and batch, the least recompute the planner fits."""
    import gpu_check

    from plait.device import resolve_device

    gpu, _ = gpu_check._gpu_preset(args, resolve_device(args.device, 0))
    return gpu_check._fitting_config(args, gpu)[0]


def _peak(args) -> float:
    import gpu_check

    from plait.device import resolve_device
    from plait.plan.hardware import get_gpu

    device = resolve_device(args.device, 0)
    gpu, _ = gpu_check._gpu_preset(args, device)
    return get_gpu(gpu, peak_flops=args.peak_tflops and args.peak_tflops * 1e12).peak_flops


def _backend(args) -> dict:
    return {"train__compile_backend": "aot_eager"} if args.smoke else {}


def section_compile(args, tmp: Path) -> list[dict]:
    import gpu_check

    from plait.device import resolve_device
    from plait.mesh import ParallelMesh
    from plait.train.loop import train

    device = resolve_device(args.device, 0)
    device.activate()
    base = _base(args)
    path = gpu_check._token_file(tmp, base.model.vocab_size, 4 * base.train.global_batch *
                                 (base.train.seq_len + 1) * base.train.steps)
    peak, rows, runs = _peak(args), [], {}
    for label, extra in (("eager", {}), ("compiled", {"train__compile": True,
                                                      **_backend(args)})):
        cfg = _with(base, **extra).check(1)
        result = train(cfg, ParallelMesh.build(cfg.parallel, device=device),
                       gpu_check._batches(cfg, path))
        runs[label] = [m["step_time"] for m in result.metrics]
    for label, times in runs.items():
        tps, mfu = _rates(base, times, peak)
        rows.append({"section": "compile", "check": f"{label}: tokens/s, MFU",
                     "measured": f"{tps:,.0f}, {mfu:.1%}", "expected": "-",
                     "result": f"{base.train.precision}, recompute {base.train.recompute}"})
    eager, compiled = (_rates(base, runs[k], peak)[0] for k in ("eager", "compiled"))
    first = runs["compiled"][0] - runs["eager"][0]
    rows.append({"section": "compile", "check": "speed-up (tokens/s)",
                 "measured": f"{compiled / eager:.2f}x",
                 "expected": "torchtitan: 1.16x (Llama 3 8B, 8 H100)",
                 "result": f"first step {first:+.1f} s (compilation)"})
    return rows


def _with(cfg, **settings):
    """A copy of `cfg` with `section.name=value` settings (keys as `train__compile`)."""
    out = copy.deepcopy(cfg)
    for key, value in settings.items():
        section, name = key.split("__")
        setattr(getattr(out, section), name, value)
    return out


def _tp_rank(rank: int, world: int, cfg, device_kind: str, path: str) -> dict:
    import gpu_check

    from plait.device import resolve_device
    from plait.mesh import ParallelMesh
    from plait.train.loop import train

    device = resolve_device(device_kind, rank)
    device.activate()
    mesh = ParallelMesh.build(cfg.parallel, device=device)
    result = train(cfg, mesh, gpu_check._batches(cfg, Path(path)))
    overlap = result.summary["ledger"]["overlap_per_step"].get("tp", {})
    return {"times": [m["step_time"] for m in result.metrics], "overlap": overlap}


def section_async_tp(args, tmp: Path) -> list[dict]:
    import gpu_check

    world = gpu_check._devices(args)
    base = _base(args)
    path = gpu_check._token_file(tmp, base.model.vocab_size, 4 * base.train.global_batch *
                                 (base.train.seq_len + 1) * base.train.steps)
    peak, rows = _peak(args), []
    backend = "nccl" if args.device == "cuda" else "gloo"
    for label, extra in (("tp + SP", {}), ("async tp", {"parallel__async_tp": True})):
        cfg = _with(base, parallel__tp=world, parallel__sp=True, **extra).check(world)
        out = run_ranks(_tp_rank, world, cfg, args.device, str(path),
                        timeout=args.section_timeout, backend=backend)[0]
        tps, mfu = _rates(cfg, out["times"], peak)
        ov = out["overlap"]
        rows.append({"section": "async-tp", "check": f"{label}, tp={world}: tokens/s, MFU",
                     "measured": f"{tps:,.0f}, {mfu:.1%}",
                     "expected": "torchtitan: 1.04-1.16x async over plain",
                     "result": f"tp exposed {ov.get('exposed', 0) * 1e3:.1f} ms, hidden "
                     f"{ov.get('hidden', 0) * 1e3:.1f} ms a step (rank 0)"})
    return rows
