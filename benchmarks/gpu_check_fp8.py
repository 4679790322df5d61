"""GPU check, section `fp8` (benchmarks/gpu_check.py runs it): the throughput section's
model and batch on one GPU, trained with `--precision bf16` and then `--precision fp8`
(the blocks' linears in float8, docs/float8.md), tokens/s and MFU of each beside
`plait plan --precision` of the same model, layout and batch on the GPU's preset.

MFU is against the bf16 dense peak for both runs (as the planner reports it), so the two
compare directly: fp8's is higher by the speed-up. A GPU without float8 tensor cores
(compute capability below 8.9: an A100) gets one line saying so and runs nothing; on CPU
(`--smoke`) both runs take the tiny sizes and the float8 GEMMs are emulated: the code
paths only, no speed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gpu_check

PRECISIONS = ("bf16", "fp8")
# torch._scaled_mm's float8 GEMMs need compute capability 8.9 (Ada) or more
FP8_CAPABILITY = (8, 9)


def no_float8(device) -> str | None:
    """Why this device has no float8 tensor cores (None: it has them, or is the CPU)."""
    if not device.is_cuda:
        return None
    import torch

    cap = torch.cuda.get_device_capability(device.torch)
    if cap >= FP8_CAPABILITY:
        return None
    return (f"skipped: {torch.cuda.get_device_name(device.torch)} is sm_{cap[0]}{cap[1]}, "
            f"float8 tensor cores need sm_{FP8_CAPABILITY[0]}{FP8_CAPABILITY[1]} or more "
            "(H100, H200, B200)")


def _measure(cfg, device, path: Path, peak: float) -> tuple[float, float]:
    """(tokens/s, MFU of the bf16 peak) of one training run of `cfg` on `device`."""
    from plait.mesh import ParallelMesh
    from plait.throughput import tokens_per_second, tokens_per_step
    from plait.train.loop import train

    result = train(cfg, ParallelMesh.build(cfg.parallel, device=device),
                   gpu_check._batches(cfg, path))
    times = [m["step_time"] for m in result.metrics]
    tps = tokens_per_second(tokens_per_step(cfg.train.global_batch, cfg.train.seq_len), times)
    del result
    if device.is_cuda:
        import torch

        torch.cuda.empty_cache()
    return tps, tps * cfg.model.flops_per_token(cfg.train.seq_len) / peak


def section_fp8(args, tmp: Path) -> list[dict]:
    from plait.device import resolve_device
    from plait.plan.hardware import get_gpu

    device = resolve_device(args.device, 0)
    why = no_float8(device)
    if why:
        return [gpu_check._note("fp8", why)]
    device.activate()
    gpu, source = gpu_check._gpu_preset(args, device)
    base, _ = gpu_check._fitting_config(args, gpu)  # the least recompute that fits (bf16)
    path = gpu_check._token_file(tmp, base.model.vocab_size, 4 * base.train.global_batch *
                                 (base.train.seq_len + 1) * base.train.steps)
    peak = get_gpu(gpu, peak_flops=args.peak_tflops and args.peak_tflops * 1e12).peak_flops
    got, plan = {}, {}
    for precision in PRECISIONS:
        cfg = replace(base, train=replace(base.train, precision=precision)).check(1)
        plan[precision] = gpu_check.planned(cfg, args, gpu, "--precision", precision)
        got[precision] = _measure(cfg, device, path, peak)
    t = base.train
    label = (f"{base.model.num_params() / 1e9:.2f} B params, seq {t.seq_len}, batch "
             f"{t.global_batch}, recompute {t.recompute}; planner: {gpu} ({source})")
    rows = [{"section": "fp8", "check": f"tokens/s {p}", "measured": f"{got[p][0]:,.0f}",
             "expected": f"{plan[p]['tokens_per_s']:,.0f} planned", "result": label}
            for p in PRECISIONS]
    speedup = got["fp8"][0] / got["bf16"][0]
    planned_speedup = plan["fp8"]["tokens_per_s"] / plan["bf16"]["tokens_per_s"]
    rows.append({"section": "fp8", "check": "MFU bf16 / fp8 (of the bf16 peak)",
                 "measured": f"{got['bf16'][1]:.1%} / {got['fp8'][1]:.1%}",
                 "expected": f"{plan['bf16']['mfu']:.1%} / {plan['fp8']['mfu']:.1%} planned",
                 "result": f"fp8 x{speedup:.2f} the bf16 tokens/s (planned "
                           f"x{planned_speedup:.2f})"})
    return rows
