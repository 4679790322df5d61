"""The planner's inputs for a plait Config's layout: `config_inputs` (what `evaluate`
takes), `estimate_config` (its estimate) and `predict_memory` (its memory by category,
closed form or the eager runtime's). The runtime side's tests, the dry run and `plait
report` set these beside what a run measured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plait.dims import DIMENSIONS
from plait.plan.basis import Layout, Training
from plait.plan.estimate import Estimate, evaluate
from plait.plan.hardware import GPU, Cluster
from plait.plan.shape import Shape, from_model_config

if TYPE_CHECKING:
    from plait.config import Config

# memory does not depend on speed: a placeholder device large enough to hold anything
PLACEHOLDER_GPU = GPU("host", 1e12, 1e15, 1e11, 1e10, 1e10, gpus_per_node=1 << 20)


def predict_memory(cfg: Config, kernels: str = "fused", data_windows: int = 0
                   ) -> dict[str, float]:
    """Predicted peak bytes per category on the most loaded rank for a plait Config.

    kernels="fused" (default, GPU planning): the search's model, below. kernels="eager":
    what plait's own CPU runtime holds at its peak moment (plait/plan/runtime_memory.py,
    sizes in plait/plan/runtime_memory_sizes.py); tests/test_predict_vs_measured.py
    compares it with the runtime's MemoryTracker, tests/test_plan_memory_agree.py its
    model states with the fused model's.
    `data_windows` (eager only): windows of the token file, for the loader's permutation.

    Categories are the ledger's: parameters, gradients, optimizer states, activations
    (+ logits), communication buffers, and "total". The runtime's attention is SDPA, which
    keeps no score matrix: the fused model plans it with the flash kernel
    (activations.RUNTIME_ATTENTION), and the config's recompute mode and recompute_ops
    mean the same in both (shape.selective_terms is the runtime's selective list).
    The fused activation terms assume fused RMSNorm/SwiGLU kernels, which eager CPU code
    exceeds: compare a CPU run with kernels="eager".
    """
    if kernels == "eager":
        from plait.plan.runtime_memory import eager_memory

        return eager_memory(cfg, data_windows)  # type: ignore[return-value]
    if kernels != "fused":
        raise ValueError(f"kernels={kernels!r}; use 'fused' (GPU stack) or 'eager' (plait's "
                         "CPU runtime)")
    est = estimate_config(cfg)
    out = {k: float(v) for k, v in est.memory.items()}
    out["total"] = float(est.memory_total)
    return out


def config_inputs(cfg: Config) -> tuple[Shape, Cluster, Training, Layout, Any]:
    """(shape, cluster, training, layout, efficiency) `evaluate` takes for a plait Config's
    layout: the runtime's attention (SDPA, planned as flash), its recompute and order."""
    from plait.dims import a2a_degree
    from plait.plan.activations import RUNTIME_ATTENTION
    from plait.plan.calibration import EFFICIENCY  # memory does not use it; evaluate does
    from plait.schedule.registry import natural_virtual_stages

    p, t = cfg.parallel, cfg.train
    shape = from_model_config(cfg.model, t.seq_len, cfg.model_name)
    precision = t.precision if t.precision in ("fp32", "fp8", "fp64") else "bf16"
    if precision == "fp8" and t.fp8_compute != "bf16":  # float8 GEMMs around fp32/float64
        precision = f"fp8-{t.fp8_compute}"
    lay = Layout({d.name: getattr(p, d.name) for d in DIMENSIONS}, mbs=cfg.micro_batch_size(),
                 schedule=p.schedule, v=natural_virtual_stages(p.schedule, p.virtual_stages),
                 zero=p.zero,
                 recompute=t.recompute, sp=p.sp, cp_mode=p.cp_mode,
                 runtime_recompute=t.recompute, attention=RUNTIME_ATTENTION,
                 recompute_ops=tuple(t.recompute_ops), order=tuple(p.order),
                 zero3_gather=p.zero3_gather, cp_a2a=a2a_degree(p),
                 async_tp=p.async_tp, overlap_fb=p.overlap_fb)
    block = t.fp8_block if t.precision == "fp8" and t.fp8_recipe == "blockwise" else 0
    train = Training(t.global_batch, precision, optimizer_sync=p.optimizer_sync,
                     fp8_block=block)
    return shape, Cluster(PLACEHOLDER_GPU, p.world_size), train, lay, EFFICIENCY


def estimate_config(cfg: Config) -> Estimate:
    """The planner's `evaluate` for the layout of a plait Config (memory, collectives)."""
    return evaluate(*config_inputs(cfg), simulate=cfg.parallel.pp > 1)
