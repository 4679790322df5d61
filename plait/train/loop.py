"""The training loop: one function for every layout, the single-process case included.

config -> the plain model built on meta -> `parallelize` (plait/parallel/parallelize.py:
every strategy, in one order; this rank's stages materialised from name-seeded init on
the mesh's device; the gradient-sync + optimizer object) -> for each step: micro-batches
forward/backward through the pipeline runtime, data parallel gradient sync, global grad
norm, clip, AdamW, metrics (loss, tokens/s on the device's timer as plait/throughput.py
defines it, ledger).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from plait import comm
from plait.checkpoint import Checkpointing
from plait.checkpoint.init_from import load_initial
from plait.config import Config
from plait.dims import DIMENSIONS, LOSS_SUMMED
from plait.mesh import ParallelMesh
from plait.model.packed import kept_targets
from plait.model.precision import widened
from plait.model.transformer import build_model
from plait.muon import muon_summary
from plait.optim import clip_coefficient
from plait.parallel.context import documents_positions
from plait.parallel.expert import finish_moe_step
from plait.parallel.optimizer import GradSyncOptimizer
from plait.parallel.parallelize import ParallelModel, gather_split_state, model_dtype, parallelize
from plait.parallel.pipeline.measure import pipeline_report
from plait.parallel.pipeline.runtime import PipelineRuntime
from plait.parallel.post_validation import PostValidation
from plait.placement import PlacementTable
from plait.throughput import mean_step_time, tokens_per_second, tokens_per_step
from plait.train.data import GlobalBatches, TokenFile
from plait.train.held_out import HeldOut, held_out_count, perplexity
from plait.train.lr_schedule import lr_at
from plait.train.stop import StoppedAtBoundary, StopRequest, agreed_stop, save_on_stop
from plait.train.stragglers import Exchange, observe_step
from plait.train.timeline import NO_MARKS, Marks, StepMarks, gather_timeline

if TYPE_CHECKING:
    from plait.parallel.fault_tolerance import FaultTolerantReplicas


@dataclass
class TrainResult:
    metrics: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    model: torch.nn.Module | None = None  # the Transformer, or this rank's pipeline stages
    optimizer: GradSyncOptimizer | None = None
    pipeline: dict | None = None  # pp > 1: measured timeline and bubble (see measure.py)
    # TrainOptions(capture_first_grads=True): the first step's full gradients by name, summed
    # over the mesh, before clipping (what the parity oracle compares)
    first_grads: dict[str, torch.Tensor] | None = None
    placements: PlacementTable | None = None  # where each of this rank's parameters lives
    # TrainOptions(timeline=True): the last step's compute and communication spans of every rank
    # (plait/train/timeline.py; plait train --trace / --timeline draw it)
    timeline: dict | None = None
    # every rank's compute and wait per step, and the stragglers named (stragglers.py)
    stragglers: Exchange = field(default_factory=Exchange)

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
    owner = mesh if mesh is not None or optimizer is None else optimizer.mesh
    with owner.ledger.outside_step() if owner is not None else contextlib.nullcontext():
        if optimizer is not None:
            state = optimizer.full_state()
        else:
            state = {n: widened(p.detach()).clone() for n, p in model.named_parameters()}
        return _by_model_name(model, mesh, placements, state)


def full_grads(model: torch.nn.Module, optimizer: GradSyncOptimizer, mesh: ParallelMesh,
               placements: PlacementTable) -> dict[str, torch.Tensor]:
    """Full fp32 gradients by name, as the optimizer is about to see them (synced over dp,
    before clipping); gathered like `full_state`. Collective over dp (ZeRO) and tp."""
    with mesh.ledger.outside_step():  # a check's bytes, not the step's
        return _by_model_name(model, mesh, placements, optimizer.full_grads())


def _by_model_name(model: torch.nn.Module, mesh: ParallelMesh | None,
                   placements: PlacementTable | None, state: dict[str, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
    if mesh is not None:
        state = gather_split_state(model, mesh, placements, state)
    if hasattr(model, "model_names"):  # pipeline stages: "stages.3.layers.5.x" -> "layers.5.x"
        return {model.model_names[n]: v for n, v in state.items() if n in model.model_names}
    return state


def ledger_summary(mesh: ParallelMesh, steps: int) -> dict:
    """Per-step averages of the ledger by collective and dim, and totals."""
    rows = {k: {kk: vv / steps for kk, vv in v.items()} for k, v in mesh.ledger.summary().items()}
    totals = mesh.ledger.totals()
    return {"per_step": rows, "sent_bytes_per_step": totals["sent"] / steps,
            "received_bytes_per_step": totals["received"] / steps,
            "comm_seconds_per_step": totals["seconds"] / steps,
            "comm_exposed_seconds_per_step": totals["exposed"] / steps,
            # per mesh dim: issue-to-completion, exposed (waited for) and hidden seconds
            "overlap_per_step": {d: {k: v / steps for k, v in row.items()}
                                 for d, row in mesh.ledger.overlap_by_dim().items()}}


@dataclass
class TrainOptions:
    """What a caller adds to a run besides its configuration, mesh and batches."""

    on_step: Callable[[dict], None] | None = None  # each settled row, as it is logged
    start_step: int = 0
    # keep the first step's full gradients (result.first_grads)
    capture_first_grads: bool = False
    # resume from (the start step becomes the checkpoint's) and save into (plait/checkpoint)
    checkpoint: Checkpointing | None = None
    # checked at every step boundary (plait/train/stop.py); once any rank has recorded a
    # signal, every rank saves the steps done into `checkpoint` and raises StoppedAtBoundary
    stop: StopRequest | None = None
    # mark compute spans and keep the last step's timeline of every rank (result.timeline;
    # collective at the end)
    timeline: bool = False
    shard_init: bool = False  # see `parallelize`
    # this rank's fault-tolerant replica, where the job is one (`mesh` and `cfg` are the
    # replica's own): `parallelize` makes it the run's replica synchronisation
    replicas: FaultTolerantReplicas | None = None
    # the token file of train.eval_data, whose loss (plait/train/held_out.py) is added to
    # the row of every train.eval_every-th step and of the last
    held_out: TokenFile | None = None
    # a dry run's values come from a fake process group (whatever its buffers held): every
    # step updates whatever its norm, so that each step issues all of a step's collectives
    update_whatever_the_norm: bool = False


@dataclass
class _Run:
    """One run's parts, built once by `train` and read by each step."""

    cfg: Config
    mesh: ParallelMesh
    batches: GlobalBatches
    par: ParallelModel
    runtime: PipelineRuntime
    result: TrainResult
    options: TrainOptions
    marks: Marks
    # post-validation: the previous step is checked at this step's cut (plait/parallel/
    # post_validation.py)
    sync: PostValidation | None
    nonfinite_in_a_row: int = 0  # settled steps whose gradient norm was not finite


def train(cfg: Config, mesh: ParallelMesh, batches: GlobalBatches,
          options: TrainOptions | None = None) -> TrainResult:
    """Train for cfg.train.steps steps on this rank; every rank returns the same metrics.
    `options`: what the caller adds (TrainOptions: hooks, checkpoints, stop, replicas)."""
    t, o = cfg.train, options if options is not None else TrainOptions()
    checkpoint, stop = o.checkpoint, o.stop
    # the plain model, on meta: parallelize materialises only what this rank holds
    plain = build_model(cfg.model, seed=t.seed, device="meta")
    # the model's total, whatever the layout; the local count is this rank's share
    param_count = {"total": sum(q.numel() for q in plain.parameters() if q.requires_grad)}
    # which parameters Muon takes, said in the summary (the rule: plait/muon.py)
    optimizer_note = (muon_summary(plain.named_parameters(), t) if t.optimizer == "muon"
                      else None)
    par = parallelize(plain, mesh, cfg, shard_init=o.shard_init, replicas=o.replicas)
    model, opt = par.model, par.optimizer
    start_step = _starting_state(par, mesh, cfg, checkpoint, o.start_step)
    param_count["local"] = sum(q.numel() for q in model.parameters() if q.requires_grad)
    runtime = _training_runtime(cfg, mesh, par, batches)
    result = TrainResult(model=model, optimizer=opt, placements=par.placements)
    marks: Marks = StepMarks(par.stages, mesh) if o.timeline else NO_MARKS
    # post-validation: a step's row waits for its check, made inside the next step (at
    # each rank's cut), or at once where a checkpoint save or a stop must see settled
    # weights
    sync = (PostValidation(opt, mesh, t.grad_clip)
            if cfg.parallel.optimizer_sync == "post_validation" else None)
    run = _Run(cfg, mesh, batches, par, runtime, result, o, marks, sync)
    eager = stop is not None or (checkpoint is not None and checkpoint.dir is not None
                                 and bool(checkpoint.every))
    validation = _validation(cfg, mesh, par, o.held_out)
    waiting: dict | None = None  # the row whose update awaits its check
    for step in range(start_step, t.steps):
        if stop is not None:
            _stop_at_boundary(run, step, start_step)
        row = _train_step(run, step, o.capture_first_grads and step == start_step)
        par.replicas.after_step(step, row)
        if waiting is not None:  # validated at this step's cut
            _emit(run, _validated(waiting, sync))
        waiting = row if sync is not None else None
        due = validation is not None and _evaluates(t.eval_every, step, t.steps)
        if sync is not None and (eager or due or step == t.steps - 1):
            sync.validate()  # an evaluation reads the settled weights
            row, waiting = _validated(row, sync), None
        if due:
            _evaluate(row, validation, par, mesh, marks)
        if waiting is None:
            _emit(run, row)
    par.optimizer.settle()  # the last update's collectives (ZeRO-1/2's all-gathers)
    if checkpoint is not None:  # a background save of the last step
        checkpoint.finish()
    result.summary = _summary(cfg, mesh, result.metrics, max(t.steps - start_step, 1),
                              param_count, result.stragglers.finish())
    if optimizer_note is not None:
        result.summary["optimizer"] = optimizer_note
    result.summary.update(par.replicas.summary())
    if sync is not None:
        result.summary["post_validation"] = {"rollbacks": sync.rollbacks,
                                             "restarts": sum(runtime.steps_restarts)}
    _measured_outputs(result, cfg, mesh, runtime, par, marks if o.timeline else None)
    return result


def _training_runtime(cfg: Config, mesh: ParallelMesh, par: ParallelModel,
                      batches: GlobalBatches) -> PipelineRuntime:
    """The pipeline runtime of the training steps, the optimizer's hooks plugged in."""
    # gradient accumulation is the one-stage case of the same runtime; what crosses a
    # stage boundary is as the stages say (sequence parallel splits it)
    boundary = {st.boundary_shape(cfg.micro_batch_size(), cfg.train.seq_len)
                for st in par.stages.values()}
    if len(boundary) != 1:
        raise RuntimeError(f"stages of one rank disagree on the boundary shape: {boundary}")
    runtime = PipelineRuntime(par.schedule, par.stages, mesh, boundary.pop(), model_dtype(cfg),
                              before_weight_grad=par.optimizer.before_backward,
                              after_weight_grad=par.optimizer.after_backward,
                              positions=par.positions)
    runtime.documents = batches.end_of_document() if cfg.train.documents else None
    runtime.document_split = documents_positions(cfg, mesh)  # split by its documents
    return runtime


def _measured_outputs(result: TrainResult, cfg: Config, mesh: ParallelMesh,
                      runtime: PipelineRuntime, par: ParallelModel, marks: Marks | None
                      ) -> None:
    """The last step's timeline (`marks`: the StepMarks, with TrainOptions(timeline=True)) and,
    with pp, the measured bubble beside the simulator's."""
    timeline = marks is not None
    if timeline:  # marks are the StepMarks
        marks.remove()
        if result.metrics:  # every rank alike: the same steps ran
            result.timeline = gather_timeline(marks, runtime, mesh, result.metrics[-1]["step"],
                                              result.summary["layout"])
    if cfg.parallel.pp > 1:  # measured bubble beside the simulator's prediction, the timeline
        result.pipeline = pipeline_report(runtime, par.partition, mesh,
                                          cfg.parallel.optimizer_sync)
        result.summary["pipeline"] = result.pipeline["summary"]
        # the last step's measured computes, per rank (plait report draws them)
        result.summary["pipeline_timeline"] = [[list(e) for e in evs]
                                               for evs in result.pipeline["events"]]


def _starting_state(par: ParallelModel, mesh: ParallelMesh, cfg: Config,
                    checkpoint: Checkpointing | None, start_step: int) -> int:
    """The weights and state the run starts from: the initial source's (train.init_from),
    a live replica's (a replacement: over the network, no disk) or the checkpoint's being
    resumed; the step to start at."""
    if cfg.train.init_from is not None and (checkpoint is None or checkpoint.source() is None):
        load_initial(par, mesh, cfg, cfg.train.init_from)  # this rank's slices
    received = par.replicas.start()
    if received is not None:
        return received
    if checkpoint is not None:  # every rank reads what it now holds; no step has run
        start_step = checkpoint.restore(par, mesh, cfg, start_step)
    return start_step


def _validation(cfg: Config, mesh: ParallelMesh, par: ParallelModel,
                held_out: TokenFile | None) -> HeldOut | None:
    """The held-out evaluation of train.eval_data, where one is asked for. Its windows are
    counted in the whole job's global batches (a replica job's is a part)."""
    if held_out is None or cfg.train.eval_every is None:
        return None
    job_batch = par.replicas.job_batch()
    return HeldOut(cfg, mesh, par, held_out, held_out_count(cfg, held_out, job_batch))


def _evaluates(every: int | None, step: int, steps: int) -> bool:
    """Whether the validation loss follows step `step` (0-based): every `every` steps, the
    first after `every` of them, and after the run's last."""
    return every is not None and ((step + 1) % every == 0 or step == steps - 1)


def _evaluate(row: dict, validation: HeldOut, par: ParallelModel, mesh: ParallelMesh,
              marks: Marks) -> None:
    """The held-out loss on the updated weights, into the step's row; its collectives are
    not the step's, nor its forwards the timeline's."""
    par.optimizer.settle()  # ZeRO-1/2: the update's all-gathers, before these forwards
    with mesh.ledger.outside_step(), marks.excluded():
        loss = validation.loss()
    par.optimizer.release_gathered()  # ZeRO-3: the units its forwards gathered
    row.update(val_loss=loss, val_perplexity=perplexity(loss))


def _emit(run: _Run, row: dict) -> None:
    """A settled step's row: logged, checkpointed, handed to `on_step`; a streak of
    non-finite steps stops the run."""
    cfg, par, mesh, checkpoint = run.cfg, run.par, run.mesh, run.options.checkpoint
    run.result.metrics.append(row)
    step = row["step"]
    # outside the step: its collectives are tagged so. Replicas hold the same state: one
    # writes
    if checkpoint is not None and par.replicas.writes():
        progress = _progress(cfg, step + 1, row["lr"])
        par.replicas.progress(progress)
        checkpoint.after_step(step, par, mesh, cfg, progress)
    if run.options.on_step is not None:
        run.options.on_step(row)
    run.nonfinite_in_a_row = run.nonfinite_in_a_row + 1 if row.get("skipped") else 0
    # every rank alike: the norm is global
    if run.nonfinite_in_a_row >= max(cfg.train.max_nonfinite_steps, 1):
        if checkpoint is not None:
            checkpoint.finish()
        raise NonFiniteError(_nonfinite_message(step, run.nonfinite_in_a_row, checkpoint))


def _validated(row: dict, sync: PostValidation) -> dict:
    """A post-validated step's row completed with its verdict (plait/parallel/
    post_validation.py): the global loss and grad norm, skipped, rolled back."""
    out = sync.outcomes.pop(row["step"])
    row.update(loss=out.loss, grad_norm=out.grad_norm)
    if out.skipped:
        row["skipped"] = True
    if out.rolled_back:
        row["rolled_back"] = True
    return row


def _progress(cfg: Config, next_step: int, lr: float) -> dict:
    """What a checkpoint records of the run's position besides the state."""
    t = cfg.train
    return {"lr": lr, "data": {"next_step": next_step, "seed": t.seed,
                               "global_batch": t.global_batch, "seq_len": t.seq_len}}


def _stop_at_boundary(run: _Run, step: int, start_step: int) -> None:
    """Before step `step`: when any rank has recorded a stop signal, every rank saves the
    `step` steps done (when this run did any) and raises StoppedAtBoundary."""
    signum = agreed_stop(run.options.stop, run.mesh)
    if not signum:
        return
    saved, checkpoint = None, run.options.checkpoint
    if checkpoint is not None and step > start_step:
        saved = save_on_stop(checkpoint, run.par, run.mesh, run.cfg, step,
                             _progress(run.cfg, step, run.result.metrics[-1]["lr"]))
    raise StoppedAtBoundary(signum, step, saved)


def _train_step(run: _Run, step: int, capture: bool) -> dict:
    """One optimizer step: micro-batches through the runtime, gradient sync, norm, clip,
    update, the logged loss; its metrics row. `capture`: keep the full gradients.
    With post-validation (`run.sync`) the previous step is checked at this step's cut,
    this step's update is optimistic and its row's loss and grad norm wait for its check.
    `run.marks`: the timeline's markers, a point at the end of each part of the step."""
    cfg, mesh, par, marks, sync = run.cfg, run.mesh, run.par, run.marks, run.sync
    t, opt, result = cfg.train, par.optimizer, run.result
    marks.begin_step()
    # the whole job's rows, whichever replicas train them
    step_tokens = tokens_per_step(par.replicas.job_batch(), t.seq_len)
    mesh.ledger.step = step
    meter = mesh.device.memory_meter(opt.memory_sources) if step == t.memory_step else None
    if meter is not None:
        meter.__enter__()
    timer = mesh.device.timer()  # the device's work, not the host's launches
    start = timer.mark()
    loss_tokens = step_tokens  # packed documents: the targets kept (plait/model/packed.py)
    if run.runtime.documents is not None:
        loss_tokens = kept_targets(run.batches.rows(step), run.runtime.documents)
    loss_sum = _micro_batches(run, step, loss_tokens)
    marks.point("gradient sync")
    # dp alone: the norm's all-reduce (ZeRO's, expert parallel's) sums the logged loss too
    folded = mesh.size("dp") == mesh.world_size
    norm = float("nan")  # post-validation: later
    if sync is None:
        norm = opt.grad_norm(summed_with=loss_sum) if folded else opt.grad_norm()
    marks.point("grad norm")
    if capture:
        result.first_grads = full_grads(par.model, opt, mesh, par.placements)
    lr = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
    memory = {}
    if meter is not None:
        memory["pre_optimizer"] = meter.sample("pre_optimizer").bytes
        meter.phase = "optimizer"  # the update's temporaries are optimizer memory
    moe, skipped = {}, False
    if sync is not None:  # the optimistic update; the loss travels with the check
        sync.begin(step, lr, loss_sum)
        marks.point("optimizer")
    else:
        skipped, moe = _barrier_update(run, norm, lr, loss_sum, loss_summed=folded)
    if meter is not None:
        meter.__exit__(None, None, None)
        memory.update(peak=meter.peak.bytes, peak_total=meter.peak_total,
                      **meter.allocator_stats())
    elapsed = timer.elapsed(start, timer.mark())
    records = mesh.ledger.for_step(step)
    by_dim: dict[str, float] = {}
    for r in records:  # the step's bytes sent by this rank, per mesh dim
        by_dim[r.dim] = by_dim.get(r.dim, 0.0) + r.sent
    row = {"step": step, "loss": float(loss_sum), "tokens": step_tokens,
           "step_time": elapsed, "tokens_per_s": tokens_per_second(step_tokens, [elapsed]),
           "grad_norm": norm, "lr": lr,
           "comm_sent_bytes": sum(r.sent for r in records), "comm_sent_bytes_by_dim": by_dim}
    row.update(moe)
    if memory:
        row["memory"] = memory
    if skipped:
        row["skipped"] = True
    observe_step(row, mesh, result.stragglers)  # after the step's timing: collective
    return row


def _micro_batches(run: _Run, step: int, step_tokens: int) -> torch.Tensor:
    """The step's micro-batches through the runtime and the gradient sync; the rank's
    partial loss. Which rows this rank trains and how their gradients meet the other
    replicas' is the run's replica synchronisation (plait/parallel/replicas/)."""
    cfg, opt = run.cfg, run.par.optimizer
    mbs, n_micro = cfg.micro_batch_size(), cfg.microbatches()
    # post-validation: the previous step is checked at the cut of this step's runtime
    validate = run.sync.at_cut if run.sync is not None and run.sync.pending else None

    def through_runtime(rows: torch.Tensor) -> torch.Tensor:
        nonlocal validate
        loss = run.runtime.step([rows[mb * mbs:(mb + 1) * mbs] for mb in range(n_micro)],
                                step_tokens, validate=validate)
        validate = None  # checked once
        run.marks.point("micro-batches")
        opt.finish_gradients()
        return loss

    return run.par.replicas.gradients(
        step, lambda index, count: run.batches.local_batch(step, index, count), through_runtime)


def _barrier_update(run: _Run, norm: float, lr: float, loss_sum: torch.Tensor,
                    loss_summed: bool = False) -> tuple[bool, dict]:
    """The update after the global norm (the barrier), and the logged loss summed in
    place (`loss_summed`: the norm's all-reduce did it); (skipped, MoE metrics)."""
    cfg, mesh, par, marks = run.cfg, run.mesh, run.par, run.marks
    opt = par.optimizer
    # the logged loss is the global-batch mean: sum the partial sums over every dimension
    # whose ranks each hold a part (the last stages, the sequence's slices, the replicas:
    # plait/dims/). Before the update: ZeRO-1/2 leave its all-gathers in flight into the
    # next forward, and a collective issued after them would queue behind them on the group
    if not loss_summed:
        for dim in LOSS_SUMMED:
            comm.all_reduce(loss_sum, mesh, dim, tag="metrics")
    marks.point("metrics")
    # a non-finite gradient anywhere makes the global norm non-finite on every rank alike
    # (a NaN or inf loss comes from non-finite logits, whose gradients are too): skip
    # the update, as torch.amp's GradScaler does, and keep the weights and moments clean
    skipped = not math.isfinite(norm) and not run.options.update_whatever_the_norm
    if not skipped:
        opt.step(lr, grad_scale=clip_coefficient(norm, cfg.train.grad_clip))
    opt.zero_grad()
    marks.point("optimizer")
    moe = {}
    if cfg.model.n_experts:  # routing statistics, the balancing bias (plait/parallel/expert)
        moe = finish_moe_step(par.stages.values(), mesh, cfg.parallel.sp and cfg.parallel.tp > 1,
                              update_bias=not skipped)
    return skipped, moe


class NonFiniteError(RuntimeError):
    """Too many steps in a row had a non-finite gradient norm."""


def _nonfinite_message(step: int, streak: int, checkpoint: Checkpointing | None) -> str:
    saved = checkpoint and ((checkpoint.saved or [None])[-1] or checkpoint.resumed_from)
    keep = (f"the last checkpoint, {saved}, holds the weights before them (skipped steps "
            "change nothing)" if saved else "no checkpoint was written")
    return (f"steps {step - streak + 1}..{step}: {streak} non-finite gradient norms in a "
            f"row (train.max_nonfinite_steps); their updates were skipped and the run "
            f"stops; {keep}. Lower the learning rate or check the data")


def run_layout(cfg: Config, mesh: ParallelMesh) -> str:
    """The mesh's sizes and the settings that shape the run beside them, e.g. 'dp=2 x
    pp=1 x ... x tp=2, ZeRO-3, SP, async-TP, bf16, recompute full, compiled
    (inductor) (order innermost first: ...)':
    the summary, the final line and the timeline's title show it."""
    sizes, _, order = mesh.describe().partition(" (")
    p, t = cfg.parallel, cfg.train
    extra = [f"ZeRO-{p.zero}"] if p.zero else []
    extra += [w for d in DIMENSIONS for w in d.words(p)]  # their records' (Dimension.words)
    extra += [t.precision] + ([f"recompute {t.recompute}"] if t.recompute != "none" else [])
    extra += [f"compiled ({t.compile_backend})"] if t.compile else []
    return ", ".join([sizes, *extra]) + (f" ({order}" if order else "")


def _summary(cfg: Config, mesh: ParallelMesh, metrics: list[dict], steps_run: int,
             param_count: dict[str, int], stragglers: dict) -> dict:
    """The run's summary line: layout, final loss, mean step time and tokens/s (plait/
    throughput.py: the first step, which warms caches, left out when there are others),
    the ledger's per-step averages, every rank's compute and wait and the stragglers."""
    times = [m["step_time"] for m in metrics]
    validated = [m for m in metrics if "val_loss" in m]
    held_out = {"val_loss": validated[-1]["val_loss"],
                "val_perplexity": validated[-1]["val_perplexity"]} if validated else {}
    return {
        "summary": True,
        "layout": run_layout(cfg, mesh),
        "world_size": mesh.world_size,
        "steps": steps_run,
        "final_loss": metrics[-1]["loss"] if metrics else None,
        **held_out,  # the last validation (train.eval_every), where there was one
        "mean_step_time": mean_step_time(times),
        "tokens_per_s": tokens_per_second(
            tokens_per_step(cfg.train.global_batch, cfg.train.seq_len), times),
        "param_count": param_count["total"],  # the model's, on every layout
        "param_count_local": param_count["local"],  # rank 0's share (tp, pp split it)
        "ledger": ledger_summary(mesh, steps_run),
        "stragglers": stragglers,
        "config": cfg.to_dict(),  # what `plait report` predicts from (plait/observe/report.py)
    }
