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
from plait.config import Config
from plait.mesh import ParallelMesh
from plait.model.transformer import Transformer, build_model
from plait.parallel.data import DataParallel
from plait.train.data import GlobalBatches
from plait.train.optim import MixedPrecisionAdamW, clip_coefficient, lr_at
from plait.train.step import global_grad_norm, microbatch_loss

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class TrainResult:
    metrics: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    model: Transformer | None = None

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 parameters by name (data parallel holds them whole on every rank)."""
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def ledger_summary(mesh: ParallelMesh, steps: int) -> dict:
    """Per-step averages of the ledger by collective and dim, and totals."""
    rows = {k: {kk: vv / steps for kk, vv in v.items()} for k, v in mesh.ledger.summary().items()}
    totals = mesh.ledger.totals()
    return {"per_step": rows, "sent_bytes_per_step": totals["sent"] / steps,
            "received_bytes_per_step": totals["received"] / steps,
            "comm_seconds_per_step": totals["seconds"] / steps}


def train(cfg: Config, mesh: ParallelMesh, batches: GlobalBatches,
          on_step: Callable[[dict], None] | None = None, start_step: int = 0) -> TrainResult:
    """Train for cfg.train.steps steps on this rank; every rank returns the same metrics."""
    t, p = cfg.train, cfg.parallel
    model = build_model(cfg.model, seed=t.seed, dtype=DTYPES[t.precision])
    model.recompute = t.recompute == "full"
    # -- tensor/sequence parallel: module swaps before anything holds the parameters --
    loss_fn = None
    if p.tp > 1:
        from plait.parallel.tensor import apply_tensor_parallel
        loss_fn = apply_tensor_parallel(model, mesh, sp=p.sp).loss_sum
    # -- end tensor parallel --
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    dp = DataParallel(model, mesh, mode=p.data_parallel, bucket_mb=p.bucket_mb)
    optim = MixedPrecisionAdamW(named, (t.beta1, t.beta2), t.eps, t.weight_decay)
    n_micro = cfg.microbatches()
    mbs = cfg.micro_batch_size()
    tokens_per_step = t.global_batch * t.seq_len
    result = TrainResult(model=model)

    for step in range(start_step, t.steps):
        mesh.ledger.step = step
        start = time.perf_counter()
        local = batches.local_batch(step, mesh.coord("dp"), mesh.size("dp"))
        loss_sum = torch.zeros(1, dtype=torch.float64)
        for mb in range(n_micro):
            tokens = local[mb * mbs:(mb + 1) * mbs]
            loss = microbatch_loss(model, tokens, tokens_per_step, loss_fn)
            dp.before_backward(last_microbatch=mb == n_micro - 1)
            loss.backward()
            loss_sum += loss.detach().double()
        dp.finish()
        norm = global_grad_norm([q for _, q in named], mesh)
        lr = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        optim.step(lr, grad_scale=clip_coefficient(norm, t.grad_clip))
        model.zero_grad(set_to_none=True)
        # the logged loss is the global-batch mean: sum the replicas' partial sums
        comm.all_reduce(loss_sum, mesh, "dp", tag="metrics")
        elapsed = time.perf_counter() - start
        sent = sum(r.sent for r in mesh.ledger.for_step(step))
        row = {"step": step, "loss": float(loss_sum), "tokens": tokens_per_step,
               "step_time": elapsed, "tokens_per_s": tokens_per_step / elapsed,
               "grad_norm": norm, "lr": lr, "comm_sent_bytes": sent}
        result.metrics.append(row)
        if on_step is not None:
            on_step(row)
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
        "param_count": sum(q.numel() for _, q in named),
        "ledger": ledger_summary(mesh, steps_run),
    }
    return result
