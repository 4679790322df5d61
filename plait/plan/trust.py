"""What a plan's numbers rest on: the hardware numbers it used and their sources
(`provenance`), the step time as the range published runs like it measured
(`step_range`: plait/plan/error_band.py), and a flag where a predicted MFU is above what
any published run of that GPU reached, naming the term that drives it (`mfu_flags`).
"""

from __future__ import annotations

from typing import Any

from plait.plan import error_band
from plait.plan.compute import Efficiency
from plait.plan.estimate import Estimate
from plait.plan.gpu_data import Published, hardware_lines, published
from plait.plan.hardware import Cluster
from plait.plan.stack import Stack


def plan_published(cluster: Cluster, mode: str, profiled: bool, attention: str = "auto"
                   ) -> Published | None:
    """The published numbers the plan used (None: `--efficiency fitted` or a profile), with
    fused attention kernel `attention`."""
    if mode == "fitted" or profiled:
        return None
    return published(cluster.gpu, attention)


def provenance(cluster: Cluster, pub: Published | None, mode: str) -> list[str]:
    return hardware_lines(cluster.gpu, pub, mode)


def step_range(est: Estimate, cluster: Cluster, pub: Published | None, stack: Stack,
               moe: bool) -> list[str]:
    """The first layout's step time with the held-out error of the published runs like it
    (the published numbers' path only: the errors were measured on it), and the terms of
    it (`moe`: the model routes experts) no scored run used."""
    if pub is None:
        return []
    lay = est.layout
    terms = error_band.terms_of(lay.sizes, lay.schedule, lay.zero, lay.recompute, moe)
    return error_band.range_lines(float(est.step_time), pub.family, cluster.n_gpus,
                                  error_band.stack_of(stack.fused_kernels)) \
        + error_band.untested_lines(terms)


def _driver(e: Estimate) -> str:
    """The step time's terms as shares, largest first: which one a too-high MFU rests on."""
    step = float(e.step_time)
    shares = sorted(((float(v) / step, k) for k, v in e.time.items() if float(v) > 0),
                    reverse=True)
    return ", ".join(f"{k} {s:.0%}" for s, k in shares[:3])


def mfu_flags(ests: list[Estimate], cluster: Cluster, pub: Published | None,
              eff: Efficiency) -> list[str]:
    """One line if any shown layout's predicted MFU is above the best published run of its
    GPU (the data file's `mfu_published_best`) or above the GEMM ceiling (no run can beat
    its matmuls), naming the layouts and the terms the first one's step is made of."""
    best = pub.mfu_best if pub else None
    limit = min(x for x in (best, eff.gemm_max) if x is not None)
    high = [(k, e) for k, e in enumerate(ests, 1) if float(e.mfu) > limit]
    if not high:
        return []
    k, e = high[0]
    which = ", ".join(f"#{j} {float(x.mfu):.1%}" for j, x in high)
    if float(e.mfu) > eff.gemm_max:
        return [f"IMPLAUSIBLE: predicted MFU ({which}) above the GEMM ceiling "
                f"{eff.gemm_max:.1%}; #{k}'s step is {_driver(e)}."]
    src = pub.entry["mfu_published_best"]["source"] if pub else ""
    return [f"CHECK: predicted MFU ({which}) is above the best published run on a "
            f"{cluster.gpu.name} ({best:.1%}: {src}). #{k}'s step is {_driver(e)}: compute "
            "at the GEMM and attention efficiencies below and the memory-bound kernels at "
            "their bytes, with an eager stack's unfused intermediates and the GPU's gaps "
            "between kernels priced at zero, so treat its time as a lower bound (--explain "
            "shows each term)."]


def add_arguments(group: Any) -> None:
    group.add_argument("--explain", action="store_true",
                       help="print the terms of the first layout's step time: each "
                       "GEMM's efficiency, attention's, each collective's bandwidth, "
                       "the overlaps assumed")
