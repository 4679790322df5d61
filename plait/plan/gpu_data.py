"""Per-GPU efficiency from public measurements (plait/plan/data/gpu_efficiency.json): the
GEMM ceiling and the GEMM size reaching half of it, fused attention's fraction of peak by
sequence length, NCCL's bus bandwidth inside a node (NVLink) and across nodes (one NIC per
GPU), the memory a device reports, and the best model FLOPs utilization a published run
of that GPU reached. Every value carries its source in the file; `hardware_lines` prints
the ones a plan used.

The GPU presets (plait/plan/hardware.py) keep their datasheet values; `published_gpu`
replaces the link bandwidths by the measured bus bandwidths (so `link_efficiency` is 1)
and the memory by what the device reports. `--efficiency fitted` keeps the older
constants fitted on one A100 paper (plait/plan/calibration.py) instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources
from typing import Any

from plait.plan.compute import Efficiency
from plait.plan.hardware import GB, GPU, GiB

DATA_FILE = "gpu_efficiency.json"
EFFICIENCY_MODES = ("published", "fitted")
# fused attention kernels with published sweeps (`--attention-kernel`; auto: the GPU's default)
ATTENTION_KERNELS = ("auto", "fa2", "cudnn", "fa3")
# an attention backward executes 2.5 x its forward's FLOPs (five GEMMs against two: Dao
# 2023, FlashAttention-2, sec. 4.1, the FLOP count of its benchmarks); the planner prices
# a layer's backward at twice its forward, so a kernel's fraction of peak is taken as the
# one that makes 3 forward-times equal forward + backward at the measured rates
BACKWARD_FLOPS = 2.5
ATTENTION_NAMES = {"fa2": "FlashAttention-2", "cudnn": "cuDNN", "fa3": "FlashAttention-3"}


@lru_cache(maxsize=1)
def load() -> dict[str, Any]:
    """The data file, read from the package."""
    text = resources.files("plait.plan").joinpath("data", DATA_FILE).read_text("utf-8")
    return json.loads(text)


def family_of(preset: str) -> str | None:
    """The data file's entry for a GPU preset name (None: no published numbers)."""
    for name, entry in load()["gpus"].items():
        if preset in entry["presets"]:
            return name
    return None


@dataclass(frozen=True)
class Published:
    """The published numbers of one GPU, ready for the cost model."""

    family: str
    gpu: GPU
    eff: Efficiency
    mfu_best: float | None
    entry: dict[str, Any]
    attention_kernel: str  # the fused attention kernel priced (ATTENTION_KERNELS' names)
    # the share of the isolated kernel rates a training step's kernels run at (the data
    # file's kernel_rate_in_training): `eff`'s GEMM, attention and HBM rates include it
    training_rate: float


def training_rate() -> float:
    """The data file's `kernel_rate_in_training`."""
    return float(load()["kernel_rate_in_training"]["value"])


def attention_kernel(fam: str, kernel: str = "auto") -> tuple[str, dict[str, Any]]:
    """(the kernel's name, its published sweep) for GPU family `fam`: `kernel`, or the
    family's default for auto; a family may take another's sweeps (`kernels_of`, as
    fractions of that GPU's peak)."""
    att = load()["gpus"][fam]["attention"]
    src = load()["gpus"][att["kernels_of"]]["attention"] if "kernels_of" in att else att
    name = src["default"] if kernel == "auto" else kernel
    if name not in src["kernels"]:
        raise ValueError(f"--attention-kernel {kernel}: no published {name} sweep for the "
                         f"{fam.upper()}; give one of {', '.join(sorted(src['kernels']))} "
                         "or auto")
    return name, {**src["kernels"][name], "peak": src.get("measured_peak_tflops")}


def attention_points(fam: str, kernel: str = "auto") -> tuple[tuple[float, float], ...]:
    """((seq, fraction of peak), ...) of a forward and backward of the kernel, in the
    planner's convention (the backward priced at twice the forward): 3 / (1/f + 2.5/b)
    over the peak, f and b the measured forward and backward TFLOP/s."""
    _, k = attention_kernel(fam, kernel)
    if "fwd_bwd_fraction" in k:  # a forward + backward rate, the FLOPs counted 1 + 2.5
        return tuple((float(s), 3.0 * float(f) / (1.0 + BACKWARD_FLOPS))
                     for s, f in k["fwd_bwd_fraction"])
    back = dict(k["backward"])
    return tuple((float(s), 3.0 / (1.0 / f + BACKWARD_FLOPS / back[s]) / k["peak"])
                 for s, f in k["forward"])


def published(gpu: GPU, attention: str = "auto",
              rate: float | None = None) -> Published | None:
    """`gpu` (a preset, possibly with overrides already applied to other fields) with the
    measured bus bandwidths and usable memory, and the efficiency constants (fused
    attention: kernel `attention`, ATTENTION_KERNELS), the kernels' isolated rates times
    `rate` (default: the data file's training rate); None for a GPU without published numbers
    (a measured profile, an unknown name)."""
    fam = family_of(gpu.name)
    if fam is None:
        return None
    doc = load()
    e = doc["gpus"][fam]
    nominal_gib = round(gpu.hbm_bytes / GB)  # presets are named by their nominal size
    lat = doc["latency"]
    g = replace(gpu, nvlink_bw=e["nvlink_busbw"]["value"],
                internode_bw=e["internode_busbw"]["value"],
                hbm_bytes=nominal_gib * GiB * doc["hbm_usable"]["ratio"],
                nvlink_alpha=lat["nvlink_alpha_s"], internode_alpha=lat["internode_alpha_s"])
    rate = training_rate() if rate is None else rate
    eff = Efficiency(gemm_max=rate * e["gemm_max"]["value"],
                     gemm_half=e["gemm_half_flops"]["value"],
                     link_efficiency=1.0, elementwise_passes=0.0,
                     attention_curve=tuple((s, rate * f)
                                           for s, f in attention_points(fam, attention)),
                     hbm_fraction=rate * e["hbm_achievable"]["value"],
                     launch_seconds=doc["kernel_launch"]["seconds"],
                     fp8_gemm_max=rate * (e["fp8_gemm_max"]["value"] or 0.0),  # 0: bf16's
                     fp8_gemm_half=e["fp8_gemm_half_flops"]["value"] or 0.0,
                     overlap_slowdown=doc["overlap_compute_slowdown"]["value"])
    return Published(fam, g, eff, e["mfu_published_best"]["value"], e,
                     attention_kernel(fam, attention)[0], rate)


def hardware_lines(gpu: GPU, pub: Published | None, mode: str) -> list[str]:
    """What the plan's hardware numbers are and where each comes from, one line each."""
    head = (f"Hardware numbers ({gpu.name}): peak {gpu.peak_flops / 1e12:,.0f} TFLOP/s bf16 "
            f"dense (datasheet), HBM {gpu.hbm_bytes / GiB:.1f} GiB at "
            f"{gpu.hbm_bw / 1e9:,.0f} GB/s")
    if pub is None:
        why = ("--efficiency fitted: the constants fitted on Korthikanti et al. 2022's eight "
               "A100 runs (plait/plan/calibration.py), links = datasheet x the fitted "
               "link efficiency" if mode == "fitted" else "a measured profile (--hardware)")
        return [head + f"; {why}."]
    e, doc, rate = pub.entry, load(), pub.training_rate
    pts = pub.eff.attention_curve
    att_src = e["attention"]["source"]
    return [
        head + " (usable: what the device reports, nominal GiB x 79.11/80: the data "
        "file's hbm_usable).",
        f"  Kernels in a training step at {rate:.1%} of the isolated rates below (GEMM "
        f"ceiling {pub.eff.gemm_max:.1%} of peak, attention and HBM likewise): "
        f"{doc['kernel_rate_in_training']['source']}.",
        f"  GEMM ceiling {e['gemm_max']['value']:.1%} of peak, half of it at "
        f"{pub.eff.gemm_half:.3g} FLOPs a GEMM: {e['gemm_max']['source']}; "
        f"{e['gemm_half_flops']['source']}.",
        f"  Fused attention ({ATTENTION_NAMES[pub.attention_kernel]}, --attention-kernel) "
        f"{pts[0][1] / rate:.0%} of peak at seq {pts[0][0]:.0f} to {pts[-1][1] / rate:.0%} at "
        f"{pts[-1][0]:.0f}, forward and backward: {att_src}.",
        f"  Memory-bound kernels at {e['hbm_achievable']['value']:.1%} of the HBM bandwidth "
        f"({gpu.hbm_bw * e['hbm_achievable']['value'] / 1e9:,.0f} GB/s): "
        f"{e['hbm_achievable']['source']}; {pub.eff.launch_seconds * 1e6:.0f} us of CPU "
        f"a kernel launch: {doc['kernel_launch']['source']}.",
        f"  NCCL bus bandwidth {gpu.nvlink_bw / 1e9:,.0f} GB/s inside a node: "
        f"{e['nvlink_busbw']['source']}; {gpu.internode_bw / 1e9:,.0f} GB/s per GPU "
        f"across nodes: {e['internode_busbw']['source']}.",
    ]
