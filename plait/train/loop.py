"""The training loop: one function for every layout, the single-process case included.

config -> model built on meta, materialised from name-seeded init -> strategies applied ->
optimizer over local parameters -> for each step: micro-batches forward/backward, data
parallel gradient sync, global grad norm, clip, AdamW, metrics (loss, tokens/s, ledger).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from plait import comm
from plait.comm.ledger import OUTSIDE_STEP
from plait.config import Config
from plait.device.memory import MemoryTracker
from plait.mesh import ParallelMesh
from plait.parallel.optimizer import GradSyncOptimizer, make_optimizer
from plait.parallel.pipeline.measure import pipeline_report
from plait.parallel.pipeline.partition import build_pipeline
from plait.parallel.pipeline.runtime import PipelineRuntime
from plait.parallel.replicated import ReplicatedOptimizer  # noqa: F401 - importable here
from plait.placement import PlacementTable
from plait.train.data import GlobalBatches
from plait.train.optim import clip_coefficient, lr_at

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class TrainResult:
    metrics: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    model: torch.nn.Module | None = None  # the Transformer, or this rank's pipeline stages
    optimizer: GradSyncOptimizer | None = None
    pipeline: dict | None = None  # pp > 1: measured timeline and bubble (see measure.py)
    # train(capture_first_grads=True): the first step's full gradients by name, summed
    # over the mesh, before clipping (what the parity oracle compares)
    first_grads: dict[str, torch.Tensor] | None = None
    placements: PlacementTable | None = None  # where each of this rank's parameters lives

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]


def full_state(model: torch.nn.Module, optimizer: GradSyncOptimizer | None = None,
               mesh: ParallelMesh | None = None, placements: PlacementTable | None = None
               ) -> dict[str, torch.Tensor]:
    """Full fp32 parameters by name, gathered from their shards where they are sharded (dp
    shards of ZeRO, by the optimizer; tp shards too when `mesh` is given: then collective
    over tp). A pipeline rank returns its own stages' parameters, by the model's names.
    `placements`: the run's (TrainResult.placements), needed where tp splits parameters."""
    if optimizer is not None:
        state = optimizer.full_state()
    else:
        state = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return _by_model_name(model, mesh, placements, state)


def full_grads(model: torch.nn.Module, optimizer: GradSyncOptimizer, mesh: ParallelMesh,
               placements: PlacementTable) -> dict[str, torch.Tensor]:
    """Full fp32 gradients by name, as the optimizer is about to see them (synced over dp,
    before clipping); gathered like `full_state`. Collective over dp (ZeRO) and tp."""
    return _by_model_name(model, mesh, placements, optimizer.full_grads())


def _by_model_name(model: torch.nn.Module, mesh: ParallelMesh | None,
                   placements: PlacementTable | None, state: dict[str, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
    if mesh is not None and mesh.size("tp") > 1:
        from plait.parallel.tensor import gather_full_state
        if placements is None:
            raise ValueError("gathering tp-split parameters needs the run's placements")
        state = gather_full_state(model, mesh, placements, state)
    if hasattr(model, "model_names"):  # pipeline stages: "stages.3.layers.5.x" -> "layers.5.x"
        return {model.model_names[n]: v for n, v in state.items() if n in model.model_names}
    return state


def ledger_summary(mesh: ParallelMesh, steps: int) -> dict:
    """Per-step averages of the ledger by collective and dim, and totals."""
    rows = {k: {kk: vv / steps for kk, vv in v.items()} for k, v in mesh.ledger.summary().items()}
    totals = mesh.ledger.totals()
    return {"per_step": rows, "sent_bytes_per_step": totals["sent"] / steps,
            "received_bytes_per_step": totals["received"] / steps,
            "comm_seconds_per_step": totals["seconds"] / steps}


def train(cfg: Config, mesh: ParallelMesh, batches: GlobalBatches,
          on_step: Callable[[dict], None] | None = None, start_step: int = 0,
          capture_first_grads: bool = False) -> TrainResult:
    """Train for cfg.train.steps steps on this rank; every rank returns the same metrics.

    `capture_first_grads`: keep the first step's full gradients (result.first_grads)."""
    t = cfg.train
    # the model cut into this rank's pipeline stages (pp=1: one stage, the whole model)
    placements = PlacementTable()  # where each parameter lives, set by the strategies
    pipe = build_pipeline(cfg, mesh.coord("pp"), DTYPES[t.precision], placements)
    model = pipe.model
    # -- tensor/sequence parallel: module swaps before anything holds the parameters --
    # Each stage applies the plan on the tp group of its own pp coordinate: the first holds
    # the vocab-parallel embedding, the last the vocab-parallel head and loss.
    if cfg.parallel.tp > 1:
        from plait.parallel.tensor import apply_tensor_parallel
        pp = cfg.parallel.pp > 1
        for stage in pipe.stages.values():
            # a tp slice of a stage's parameter keeps the stage's placement (distinct per pp)
            stage.loss_fn = apply_tensor_parallel(stage, mesh, sp=cfg.parallel.sp,
                                                  partial=pp, placements=placements).loss_sum
        if not pp:  # the stage shares the model's blocks; re-point the ends
            model.embed, model.head = pipe.stages[0].embed, pipe.stages[0].head
    # -- end tensor parallel --
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    param_count = sum(q.numel() for _, q in named)
    opt = make_optimizer(model, mesh, cfg, placements, pipe)
    n_micro = cfg.microbatches()
    mbs = cfg.micro_batch_size()
    # gradient accumulation is the one-stage case of the same runtime
    # what crosses a stage boundary, as the stages say (sequence parallel splits it)
    boundary = {st.boundary_shape(mbs, t.seq_len) for st in pipe.stages.values()}
    if len(boundary) != 1:
        raise RuntimeError(f"stages of one rank disagree on the boundary shape: {boundary}")
    runtime = PipelineRuntime(pipe.schedule, pipe.stages, mesh, boundary.pop(),
                              DTYPES[t.precision],
                              before_weight_grad=opt.before_backward,
                              after_weight_grad=opt.after_backward)
    tokens_per_step = t.global_batch * t.seq_len
    result = TrainResult(model=model, placements=placements)

    for step in range(start_step, t.steps):
        mesh.ledger.step = step
        tracker = MemoryTracker(opt.memory_sources) if step == t.memory_step else None
        if tracker is not None:
            tracker.__enter__()
        start = time.perf_counter()
        local = batches.local_batch(step, mesh.coord("dp"), mesh.size("dp"))
        micro = [local[mb * mbs:(mb + 1) * mbs] for mb in range(n_micro)]
        loss_sum = runtime.step(micro, tokens_per_step)
        opt.finish_gradients()
        norm = opt.grad_norm()
        if capture_first_grads and step == start_step:  # a check's, not the step's, bytes
            mesh.ledger.step = OUTSIDE_STEP
            result.first_grads = full_grads(model, opt, mesh, placements)
            mesh.ledger.step = step
        lr = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        memory = {}
        if tracker is not None:
            memory["pre_optimizer"] = tracker.sample("pre_optimizer").bytes
            tracker.phase = "optimizer"  # the update's temporaries are optimizer memory
        opt.step(lr, grad_scale=clip_coefficient(norm, t.grad_clip))
        opt.zero_grad()
        # the logged loss is the global-batch mean: sum the partial sums of the last
        # stages (pp) and of the replicas (dp)
        comm.all_reduce(loss_sum, mesh, "pp", tag="metrics")
        comm.all_reduce(loss_sum, mesh, "dp", tag="metrics")
        if tracker is not None:
            tracker.__exit__(None, None, None)
            memory["peak"] = tracker.peak.bytes
            memory["peak_total"] = tracker.peak_total
        elapsed = time.perf_counter() - start
        sent = sum(r.sent for r in mesh.ledger.for_step(step))
        row = {"step": step, "loss": float(loss_sum), "tokens": tokens_per_step,
               "step_time": elapsed, "tokens_per_s": tokens_per_step / elapsed,
               "grad_norm": norm, "lr": lr, "comm_sent_bytes": sent}
        if memory:
            row["memory"] = memory
        result.metrics.append(row)
        if on_step is not None:
            on_step(row)
        result.optimizer = opt
    steps_run = max(t.steps - start_step, 1)
    times = [m["step_time"] for m in result.metrics[1:]] or [m["step_time"]
                                                             for m in result.metrics]
    result.summary = {
        "summary": True,
        "layout": mesh.describe(),
        "world_size": mesh.world_size,
        "steps": steps_run,
        "final_loss": result.metrics[-1]["loss"] if result.metrics else None,
        "mean_step_time": sum(times) / len(times) if times else None,
        "tokens_per_s": tokens_per_step * len(times) / sum(times) if times else None,
        "param_count": param_count,
        "ledger": ledger_summary(mesh, steps_run),
        "config": cfg.to_dict(),  # what `plait report` predicts from (plait/observe/report.py)
    }
    if cfg.parallel.pp > 1:  # measured bubble beside the simulator's prediction, the timeline
        result.pipeline = pipeline_report(runtime, pipe.partition, mesh)
        result.summary["pipeline"] = result.pipeline["summary"]
    return result
