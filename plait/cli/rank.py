"""One rank of a training job: `torchrun --nproc-per-node N -m plait.train [train flags]`.

Takes the same flags as `plait train` (without --nproc). Reads the launcher's RANK,
WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (this is the CLI layer), checks every input
on every rank before any collective (`check_rank_inputs`, as `plait train` does before
launching), resolves the device (`--device`: cuda:LOCAL_RANK with NCCL, or the CPU with
gloo), builds the mesh, trains; rank 0 shows progress, streams the metrics to
NAME.partial (renamed to NAME when the run completes), prints the summary and, even with
--quiet, one final line. A stop signal (plait/launch/local.py) ends the rank at its next Python
instruction with 128 + the signal, rank 0 saying after how many steps (with
--checkpoint-on-stop: at the next step boundary, once every rank saved that step,
plait/train/stop.py); an error is one line (its traceback with --debug) and a non-zero
exit, so the launcher brings the whole job down.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from plait import comm
from plait.checkpoint import Checkpointing
from plait.checkpoint.cli import preflight
from plait.checkpoint.format import CheckpointError
from plait.config import Config, ConfigError
from plait.device import Device, DeviceError, resolve_device
from plait.dims.dp_replicate import replica_layout
from plait.files import PartialFile
from plait.launch.elastic import ElasticState, inject_fault, slowed
from plait.launch.local import (
    STOP_SIGNALS,
    StopRequested,
    describe_error,
    die_with_parent,
    exit_with_parent,
    init_rank_process_group,
    raise_on_stop_signals,
    signal_name,
)
from plait.launch.replicas import REPLICA_FLAG, ReplicaArg
from plait.launch.watchdog import REPORT_MARGIN_S, Watchdog, store_client
from plait.mesh import ParallelMesh
from plait.plan.host_memory import host_memory_problem
from plait.train.checks import train_inputs
from plait.train.data import DataError, GlobalBatches, TokenFile
from plait.train.flags import add_train_args, resolve_data
from plait.train.loop import TrainOptions, run_layout, train
from plait.train.progress import (
    Gauges,
    compile_note,
    final_line,
    plait_warnings,
    print_summary,
    progress_reporter,
    steps_done_text,
)
from plait.train.sinks import MetricSinks
from plait.train.stop import StoppedAtBoundary, StopRequest


def write_pipeline_outputs(report: dict) -> None:
    """Measured bubble beside the simulator's prediction."""
    s = report["summary"]
    print(f"pipeline {s['schedule']} pp={s['pp']} m={s['microbatches']} "
          f"v={s['virtual_stages']}: {s['partition']}")
    print(f"  measured bubble {s['measured_bubble']:.1%} (span {s['measured_span'] * 1e3:.1f} "
          f"ms); simulated for the measured durations {s['simulated_bubble']:.1%} (span "
          f"{s['simulated_span'] * 1e3:.1f} ms); without the runtime's gap "
          f"{s['simulated_bubble_no_gap']:.1%}, without transfer costs or gap "
          f"{s['simulated_bubble_no_comm']:.1%}, with CPU times {s['simulated_bubble_cpu']:.1%}"
          f", replayed (each action its own duration) {s['simulated_bubble_replay']:.1%}")
    d = s["durations_ms"]
    print("  durations used, ms per stage: " + "; ".join(
        f"{k} " + " ".join(f"{x:.2f}" for x in d[k]) for k in ("F", "I", "W"))
        + f"; p2p {d['p2p']:.2f} (median of {d['p2p_samples']} transfers, "
        f"{d['p2p_waited']} waited for); post {d['post']:.2f} (CPU {d['post_cpu']:.2f}) "
        f"per batch of transfers; gap {d['gap']:.2f} before each compute")
    print("  measured idle: " + ", ".join(f"{k} {v:.1%}" for k, v in s["idle"].items())
          + "; CPU share of compute wall time: "
          + ", ".join(f"{k} {v:.0%}" for k, v in s["cpu_share"].items()))
    if "steady_bubble" in s:  # consecutive steps (measure.steady_state)
        print(f"  across steps: steady bubble {s['steady_bubble']:.1%} (simulated "
              f"{s['simulated_steady_bubble']:.1%}; each step its own means "
              f"{s['simulated_steady_bubble_per_step']:.1%}, replayed "
              f"{s['simulated_steady_bubble_replay']:.1%}; {s['optimizer_sync']}, "
              f"{s['between_ms']:.1f} ms between steps, the check at each rank's cut "
              + "/".join(f"{x:.1f}" for x in s["check_per_rank_ms"]) + " ms), period "
              f"{s['steady_period_ms']:.1f} ms, next step's first compute "
              f"{s['step_overlap_ms']:+.1f} ms before the last one's end; steps run "
              f"again after a failed post-validation check: {s['restarts']}")


def write_timeline_outputs(timeline: dict, trace: str | None, png: str | None) -> None:
    """--trace and --timeline: the last step's compute and communication, every rank."""
    from plait.observe.timeline import draw_step_timeline, write_chrome_trace

    if trace:
        print(f"Chrome trace of step {timeline['step']} (open in https://ui.perfetto.dev): "
              f"{write_chrome_trace(timeline, trace)}")
    if png:
        print(f"timeline PNG of step {timeline['step']}: {draw_step_timeline(timeline, png)}")


# A refused input: the other ranks wait this long for rank 0 to print why and exit, since
# torchrun stops the job at the first rank to exit, before a slower rank 0 has spoken
PEER_REPORT_WAIT_S = 30.0


class BadInput(Exception):
    """The rank's own check of every input found problems (the same `plait train` runs)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("cannot start training:\n" + "\n".join(f"  - {p}" for p in problems))


class _Run:
    """What a stop or a failure reports: steps done, where the metrics went."""

    def __init__(self, rank: int, total_steps: int):
        self.rank, self.total_steps, self.steps_done = rank, total_steps, 0
        self.metrics_out: str | None = None  # --metrics-out (rank 0)
        self.metrics: PartialFile | None = None
        # a resume into the same --metrics-out: the earlier run's rows, of which those
        # before the first row this run writes are kept (the rest it trains again)
        self.earlier: list[dict] = []
        self.sinks: MetricSinks | None = None  # --tensorboard, --wandb (plait/train/sinks.py)
        self.stop = StopRequest()  # --checkpoint-on-stop: the signal, for the boundary
        self.watchdog: Watchdog | None = None  # a failure prints every rank's flight recorder

    def open_outputs(self, args: argparse.Namespace, cfg: Config, layout: str,
                     elastic: ElasticState | None) -> None:
        """Rank 0's: the metrics file (streamed to NAME.partial, renamed to NAME only when
        the run completes; an earlier attempt's rows first) and the metric sinks."""
        self.metrics_out = args.metrics_out
        # a resume opens the file at its first row: one that fails before leaves the
        # earlier run's rows where they are
        if args.metrics_out and args.resume:
            self.earlier = PartialFile.rows_left(args.metrics_out)
        elif args.metrics_out:
            self.metrics = PartialFile(args.metrics_out)
        for row in elastic.rows if elastic and self.metrics_out else ():
            self._write(row)
        self.sinks = MetricSinks.from_args(args, cfg.to_dict(), layout)

    def _write(self, row: dict) -> None:
        """One line; the first is preceded by the earlier run's rows before its step."""
        if self.metrics is None:
            self.metrics = PartialFile(self.metrics_out)
        first = row.get("step", float("inf"))  # a summary first: every earlier row
        for old in self.earlier:
            if old["step"] < first:
                self.metrics.write_line(json.dumps(old))
        self.earlier = []
        self.metrics.write_line(json.dumps(row))

    def record(self, row: dict) -> None:
        """A step row or the summary: the JSON line and the sinks, from the same dict."""
        if self.metrics_out:
            self._write(row)
        if self.sinks is not None:
            (self.sinks.write_summary if row.get("summary") else self.sinks.write_row)(row)

    def close_sinks(self, finished: bool) -> None:
        if self.sinks is not None:
            self.sinks.close(failed=not finished)

    def kept_metrics(self) -> str:
        if self.metrics is None:
            return ""
        return f"; metrics so far kept in {self.metrics.abandon()}"


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # torchrun gone, even by SIGKILL: this rank goes too
    exit_with_parent()
    raise_on_stop_signals()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:  # a rank of `plait eval` (plait/cli/eval.py)
        from plait.cli.eval import rank_main

        return rank_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m plait.train")
    add_train_args(parser)
    # given by `plait train --max-restarts` to each attempt's ranks (plait/launch/elastic.py)
    parser.add_argument("--elastic-state", help=argparse.SUPPRESS)
    # given by `plait train --fault-tolerance` to each replica's ranks (plait/launch/replicas.py)
    parser.add_argument(REPLICA_FLAG, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    run = _Run(rank, 0)
    try:
        return _outcome(args, rank, world, run)
    except StopRequested as stop:  # a stop signal (torchrun ending the job) while this rank
        return 128 + stop.signum   # reported its own failure: that line is enough


def _outcome(args: argparse.Namespace, rank: int, world: int, run: _Run) -> int:
    """The rank's run and its one-line report of how it ended: the exit status."""
    try:
        return _run_rank(args, rank, world, run)
    except StopRequested as stop:
        if rank == 0:
            print(f"plait: {_who(args)}stopped by {signal_name(stop.signum)} "
                  f"{steps_done_text(run.steps_done, run.total_steps)}{run.kept_metrics()}",
                  file=sys.stderr)
        return 128 + stop.signum
    except StoppedAtBoundary as stop:
        if rank == 0:
            saved = (f"; final checkpoint {stop.checkpoint} (--resume continues at step "
                     f"{stop.steps_done})" if stop.checkpoint
                     else "; no step done since the start: nothing saved")
            print(f"plait: {_who(args)}stopped by {signal_name(stop.signum)} "
                  f"{steps_done_text(stop.steps_done, run.total_steps)}{saved}"
                  f"{run.kept_metrics()}", file=sys.stderr)
        return 128 + stop.signum
    except (BadInput, ConfigError, DataError, DeviceError) as e:
        if args.debug:
            traceback.print_exc()
        if rank == 0:
            print(f"plait: {e}", file=sys.stderr)
        else:  # every rank refuses alike; rank 0 says why, so it must end first
            with contextlib.suppress(StopRequested):
                time.sleep(PEER_REPORT_WAIT_S)
        return 2
    except Exception as e:
        # the agent's SIGTERM (a peer is gone) must not cut short what this rank says:
        # ignored process-wide (a mask would hold only in this thread, and a signal taken
        # by another thread still reaches the Python handler here)
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if args.debug:
            traceback.print_exc()
        when = (steps_done_text(run.steps_done, run.total_steps) if run.total_steps
                else "before training")
        print(f"plait: {_who(args)}rank {rank} failed {when}: {describe_error(e)}"
              f"{run.kept_metrics()}" + ("" if args.debug else " (rerun with --debug "
                                            "for the traceback)"), file=sys.stderr)
        if run.watchdog is not None:
            run.watchdog.report_failure()
        return 1


def _who(args: argparse.Namespace) -> str:
    """A fault-tolerant replica's rank 0 speaks for its replica, not for the job."""
    return f"replica {ReplicaArg.parse(args.replica).index}: " if args.replica else ""


def check_rank_inputs(args: argparse.Namespace, rank: int, world: int, local_rank: int,
                      local_world: int) -> Config:
    """Every input checked on every rank before any collective, as `plait train` checks
    them before launching: under a user's own `torchrun -m plait.train` too. The checks
    are deterministic, so every rank refuses alike (exit 2) and none waits for a peer;
    only rank 0 prepares the default corpus. The host-memory check counts this machine's
    ranks (LOCAL_WORLD_SIZE of them, this one's node)."""
    found = train_inputs(args, world_size=world, local_rank=local_rank,
                         prepare_default=rank == 0)
    if not found.problems:
        first_local = rank - local_rank
        problem = host_memory_problem(found.cfg, range(first_local, first_local + local_world),
                                      found.device_type)
        found.problems += [problem] if problem else []
    if found.problems:
        raise BadInput(found.problems)
    assert found.cfg is not None
    return found.cfg


def _record_outcome(args: argparse.Namespace, run: _Run, result, elastic, lead: bool,
                    gauges: Gauges | None = None) -> None:
    """The summary row and what rank 0 prints and draws once training is done."""
    if elastic:
        result.summary.update(elastic.summary())
    run.record(result.summary)
    if lead and not args.quiet:
        print_summary(result.summary, result.metrics, gauges=gauges)
    if lead and result.pipeline:
        write_pipeline_outputs(result.pipeline)
    if lead and result.timeline:
        write_timeline_outputs(result.timeline, args.trace, args.timeline)
    elif lead and (args.trace or args.timeline):  # resumed at the last step
        print("plait: no step ran, so --trace/--timeline have nothing to draw",
              file=sys.stderr)


def step_gauges(cfg: Config, device: Device, world: int) -> Gauges:
    """The step log's memory and MFU: the planner's model FLOPs per token (the MFU
    numerator, plait/plan/compute.py) and the device's datasheet peak where known."""
    from plait.plan.compute import model_flops_per_token
    from plait.plan.hardware import gpu_by_device_name
    from plait.plan.shape import from_model_config

    gpu = gpu_by_device_name(torch.cuda.get_device_name(device.torch)) if device.is_cuda \
        else None
    return Gauges(model_flops_per_token(from_model_config(cfg.model, cfg.train.seq_len)),
                  world, gpu.peak_flops if gpu is not None else None, device.peak_memory)


def _tell_checkpoint_events(checkpoint: Checkpointing, quiet: bool) -> None:
    """Rank 0's lines: what preflight decided (always: it changes what the run does), and
    each resume and committed save as it happens (not with --quiet)."""
    for note in checkpoint.notes:
        print(f"plait: {note}", file=sys.stderr, flush=True)
    if not quiet:
        checkpoint.say = lambda line: print(line, flush=True)


def _say_start(cfg: Config, checkpoint: Checkpointing) -> None:
    """Rank 0's lines before the first step: the starting weights a run reads (not a
    resume's: the checkpoint says that), and a compiled run's slow first step."""
    if cfg.train.init_from is not None and checkpoint.source() is None:
        from plait.checkpoint.init_from import describe_initial

        print(f"plait: starting weights from {describe_initial(cfg.train.init_from, cfg.model)}"
              "; the optimizer starts at step 0", flush=True)
    if cfg.train.compile:
        print(compile_note(cfg.train.compile_backend), flush=True)


def _run_rank(args: argparse.Namespace, rank: int, world: int, run: _Run) -> int:
    with plait_warnings(lead=rank == 0):
        return _train_rank(args, rank, world, run)


def _prepare_rank(args: argparse.Namespace, rank: int, world: int, run: _Run,
                  ft: ReplicaArg | None) -> tuple[Config, Device, Checkpointing, object]:
    """Every input checked (a fault-tolerant replica's against the whole job's layout),
    the device, the checkpoint's preflight, the process group, the data file."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cfg = check_rank_inputs(args, rank, world * (ft.count if ft else 1), local_rank,
                            int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    device = resolve_device(args.device, local_rank)
    device.activate()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:  # bad checkpoint flags or input: before any collective
        checkpoint = preflight(args, cfg)
    except CheckpointError as e:
        raise BadInput([str(e)]) from e
    if rank == 0:
        _tell_checkpoint_events(checkpoint, args.quiet)
    run.total_steps = cfg.train.steps
    data = resolve_data(cfg, args.data_dir) if rank == 0 or cfg.train.data else None
    if world > 1:  # the watchdog reports a hang before the group's own timeout
        init_rank_process_group(device.backend, datetime.timedelta(
            seconds=args.timeout + REPORT_MARGIN_S))
    if data is None:  # non-zero ranks wait for rank 0 to prepare the default corpus
        dist.barrier()
        data = resolve_data(cfg, args.data_dir)
    elif world > 1 and not cfg.train.data:
        dist.barrier()
    return cfg, device, checkpoint, data


def _train_rank(args: argparse.Namespace, rank: int, world: int, run: _Run) -> int:
    ft = ReplicaArg.parse(args.replica) if args.replica else None  # one replica's ranks
    cfg, device, checkpoint, data = _prepare_rank(args, rank, world, run, ft)
    run_cfg = replica_layout(cfg) if ft else cfg  # a replica trains its own layout
    mesh = ParallelMesh.build(run_cfg.parallel, device=device)
    replicas = ft.replicas(cfg, mesh, args.timeout) if ft else None
    store = store_client(args.timeout) if world > 1 else None
    watchdog = Watchdog(mesh.ledger, rank, world, store, args.timeout).start() if store else None
    run.watchdog = watchdog
    batches = slowed(GlobalBatches(TokenFile.open(data), cfg.train.seq_len,
                                   cfg.train.global_batch, cfg.train.seed,
                                   cfg.model.vocab_size),  # the test-only fault
                     ft.global_rank(rank, world) if ft else rank)
    held_out = TokenFile.open(cfg.train.eval_data) if cfg.train.eval_data else None
    lead = rank == 0 and ft is None  # fault-tolerant replicas: the launcher reports
    elastic = ElasticState(args.elastic_state) if args.elastic_state else None
    if lead:
        run.open_outputs(args, cfg, run_layout(cfg, mesh).split(" (")[0], elastic)
    finished = False
    try:
        gauges = step_gauges(cfg, device, world) if lead else None
        with progress_reporter(cfg.train.steps, enabled=lead and not args.quiet,
                               gauges=gauges, every=args.log_every) as show:
            def on_step(row: dict) -> None:
                run.steps_done = row["step"] + 1
                show(row)
                run.record(row)
                if elastic and lead:
                    elastic.log(row)
                if watchdog is not None:
                    watchdog.publish(row)
                if ft is not None and rank == 0:
                    ft.post_row(replicas, row)
                inject_fault(ft.global_rank(rank, world) if ft else rank, row["step"],
                             ft.generation if ft else elastic.attempt if elastic else 0,
                             lambda: comm.all_reduce(torch.zeros(1, device=device.torch),
                                                     mesh, "dp", tag="fault"))

            if lead and not args.quiet:
                _say_start(cfg, checkpoint)
            if args.checkpoint_on_stop:  # from here a signal waits for the step boundary
                raise_on_stop_signals(record=run.stop.request)
            try:
                result = train(run_cfg, mesh, batches,
                               TrainOptions(on_step=on_step, checkpoint=checkpoint,
                                            stop=run.stop if args.checkpoint_on_stop else None,
                                            timeline=bool(args.trace or args.timeline),
                                            replicas=replicas, held_out=held_out))
            except StoppedAtBoundary:
                finished = True  # every rank is at the same boundary: end together
                raise
        if ft is not None and rank == 0:
            ft.post_summary(replicas, result.summary)
        _record_outcome(args, run, result, elastic, lead, gauges)
        finished = True
    finally:
        if dist.is_initialized():
            if finished:  # no rank tears its connections down while a peer still talks
                comm.all_reduce(torch.zeros(1, device=device.torch), mesh, "world",
                                tag="shutdown")
            dist.destroy_process_group()
        if watchdog is not None:
            watchdog.stop()
        run.close_sinks(finished)
    if lead:
        written = run.metrics.finish() if run.metrics else None
        print(final_line(result.summary, result.metrics, written), flush=True)
    return 0


def run() -> None:
    """The process's whole life as a rank (`python -m plait.train`): main, then exit."""
    code = main()
    # Skip the interpreter's teardown of C++ statics: gloo's background threads were seen
    # to abort there ("terminate called without an active exception") after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
