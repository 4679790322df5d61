"""`plait eval --init-from hf:DIR|dcp:DIR|CHECKPOINT --data FILE --seq-len S
[--eval-sequences N] [layout flags] [--metrics-out F]` and `plait export --from SRC --to
hf:OUT|dcp:OUT` (the CLI layer:
tests/test_layering.py).

Every input is checked in this process before any rank starts (exit 2, nothing written).
One rank evaluates in this process; a layout of more ranks is launched like `plait
train` (torch.distributed.run, `-m plait.train eval ...`, every listener on loopback),
and `rank_main` is what each of those ranks runs. Rank 0 prints `loss X perplexity Y`
and, with --metrics-out, writes the result as JSON (atomically).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

from plait.checkpoint.format import CheckpointError
from plait.cli_parser import copy_flags
from plait.config import ConfigError
from plait.device import CHOICES as DEVICE_CHOICES
from plait.device import DeviceError, resolve_device
from plait.dims import DIMENSIONS
from plait.files import output_problems, write_text_atomic
from plait.launch.local import (
    STOP_GRACE_S,
    TORCHRUN_COMMAND,
    LocalLaunch,
    StopRequested,
    describe_error,
    init_rank_process_group,
    launch_ranks,
)
from plait.mesh import ParallelMesh
from plait.train.data import DataError, TokenFile
from plait.train.flags import add_config_args, config_from_args

USER_ERRORS = (ConfigError, DataError, DeviceError, CheckpointError)
ZERO_STRATEGY = "plait.parallel.zero"  # a record of ZeRO's (how it shards): not evaluation's


# the configuration flags an evaluation reads: the layout and the batch shape; not the
# training ones (steps, lr, ZeRO and its replica groups, recompute, ...). The model is
# --init-from's: --model is accepted unlisted and checked against it (a DCP checkpoint
# that records none takes --model, --config and --set)
EVAL_CONFIG_FLAGS = ("--config", "--set", "--data", "--init-from", "--seq-len",
                     "--global-batch", "--micro-batch-size", "--microbatches",
                     "--virtual-stages", "--schedule", "--gpus-per-node", "--precision", "--sp",
                     *(f"--{d.name.replace('_', '-')}" for d in DIMENSIONS
                       if d.strategy != ZERO_STRATEGY),
                     *(s.flag for d in DIMENSIONS for s in d.settings))


def add_eval_args(p: argparse.ArgumentParser) -> None:
    copy_flags(p, add_config_args, EVAL_CONFIG_FLAGS, hidden=("--model",), helps={
        "--data": "token file (.bin) to evaluate on (required; plait data prepare makes one)",
        "--init-from": "the model to evaluate (required): hf:DIR, dcp:DIR or a plait "
        "checkpoint (it defines the model: a --model given beside it is only checked "
        "against it)"})
    p.add_argument("--eval-sequences", type=int, metavar="N",
                   help="windows of seq_len + 1 tokens to evaluate, from the file's start "
                   "(default: every whole batch of --global-batch windows)")
    p.add_argument("--metrics-out", help="write the result as JSON here (atomically)")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="ranks to launch (default: the layout's world size)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait before the job fails (default 300)")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="where each rank computes (as plait train)")


def add_parsers(sub: Any) -> None:
    ev = sub.add_parser("eval", help="mean token cross-entropy and perplexity of a model",
                        description="The mean token cross-entropy and perplexity of a model "
                        "(--init-from hf:DIR, dcp:DIR or a plait checkpoint) on the first "
                        "windows of a token file (--data), on any layout: one rank in this "
                        "process, more launched like plait train.")
    add_eval_args(ev)
    ev.set_defaults(func=None)
    ex = sub.add_parser("export", help="a model as a Hugging Face directory or a DCP "
                        "checkpoint with torchtitan's names")
    ex.add_argument("--from", dest="source", required=True, metavar="CHECKPOINT|hf:DIR|dcp:DIR",
                    help="a plait checkpoint (or a directory of them: the newest), hf:DIR, or "
                    "dcp:DIR written by plait export")
    ex.add_argument("--to", dest="target", required=True, metavar="hf:OUT|dcp:OUT",
                    help="the directory to create (absent or empty, unless --force): hf: "
                    "for transformers, dcp: for torch.distributed.checkpoint (torchtitan)")
    ex.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="dtype of the exported weights (default fp32)")
    ex.add_argument("--force", action="store_true", help="replace an --to directory that "
                    "holds files (by default plait refuses to)")
    ex.add_argument("--dcp-names", choices=("2026", "2025"), metavar="2026|2025",
                    help="torchtitan's naming for --to dcp: (default 2026, today's: "
                    "attention.qkv_linear.wq, lm_head; 2025: attention.wq, output)")
    ex.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from plait.checkpoint.interop import export

    try:
        out, n = export(args.source, args.target, args.dtype, args.force, args.dcp_names)
    except CheckpointError as e:
        print(f"plait: {e}", file=sys.stderr)
        return 2
    kind = args.target.split(":", 1)[0]
    names = f", torchtitan's {args.dcp_names or '2026'} names" if kind == "dcp" else ""
    print(f"wrote {kind}:{out}: {n} tensors, {args.dtype}{names}")
    return 0


def eval_inputs(args: argparse.Namespace) -> tuple[Any, int, list[str]]:
    """(config, world size, problems): every input of `plait eval`, checked at once."""
    from plait.train.checks import init_problems
    from plait.train.evaluate import eval_problems

    model_problems = model_flag_problems(args)
    if model_problems:
        return None, 0, model_problems
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        return None, 0, e.problems
    world = args.nproc or cfg.parallel.world_size
    problems = cfg.validate(world_size=world)
    if args.nproc is not None and args.nproc < 1:
        problems.append(f"--nproc {args.nproc}: launch at least one rank")
    if cfg.train.init_from is None:
        problems.append("--init-from hf:DIR|dcp:DIR|CHECKPOINT: name the model to evaluate")
    problems += init_problems(cfg)
    inputs = []
    if not cfg.train.data:
        problems.append("--data FILE.bin: name the token file to evaluate on")
    else:
        try:
            data = TokenFile.open(cfg.train.data)
            inputs = [data.path, data.path.with_suffix(".json")]
            if not problems:
                problems += eval_problems(cfg, data, args.eval_sequences)
        except DataError as e:
            problems.append(str(e))
    if args.metrics_out:
        problems += output_problems("--metrics-out", args.metrics_out, inputs)
    try:
        resolve_device(args.device, local_rank=max(world, 1) - 1)
    except DeviceError as e:
        problems.append(str(e))
    return cfg, world, problems


def model_flag_problems(args: argparse.Namespace) -> list[str]:
    """--model beside --init-from: the model to evaluate is the source's. A preset that
    is that model is accepted (and dropped: the source names it); another is refused,
    saying so. Unreadable sources and unknown presets are left to the later checks."""
    from plait.checkpoint.init_from import initial_model
    from plait.model.presets import PRESETS

    if args.model is None or args.init_from is None or args.model not in PRESETS:
        return []
    try:
        held = initial_model(args.init_from)
    except CheckpointError:
        return []
    if held is None:  # a DCP checkpoint that records no model: --model names it
        return []
    preset = PRESETS[args.model]
    if preset == held:
        args.model = None
        return []
    differ = [f"{f}={getattr(held, f)} (--model {args.model}: {getattr(preset, f)})"
              for f in preset.__dataclass_fields__ if getattr(held, f) != getattr(preset, f)]
    return [f"--model {args.model}: the model comes from --init-from, and "
            f"{args.init_from} holds another one ({', '.join(differ[:3])}"
            f"{', ...' if len(differ) > 3 else ''}); leave out --model"]


def cmd_eval(args: argparse.Namespace, argv: list[str]) -> int:
    cfg, world, problems = eval_inputs(args)
    if problems:
        print("plait: cannot evaluate:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return 2
    _say_naming(cfg)
    if world == 1:  # one rank: no launcher, no process group
        return _evaluate_and_report(args, cfg, resolve_device(args.device, 0))
    rank_args = ["eval", *_without(argv, "--nproc")]
    if args.model is None:  # a --model that matched the source: the ranks take the source's
        rank_args = _without(rank_args, "--model")
    launch = LocalLaunch(world, rank_args, timeout_s=args.timeout,
                         torchrun=[sys.executable, "-m", "plait.cli", TORCHRUN_COMMAND],
                         extra=[f"--shutdown-timeout={int(STOP_GRACE_S) // 2}"])
    return launch_ranks(launch.command, launch.env)


def _say_naming(cfg: Any) -> None:
    """A DCP source's naming, torchtitan's 2026 or 2025: which one was read is worth a line."""
    from plait.checkpoint import dcp

    directory = dcp.dcp_dir(cfg.train.init_from)
    if directory is not None:
        print(f"plait: reading {dcp.describe_source(directory, cfg.model)}", file=sys.stderr,
              flush=True)


def _without(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip or a == flag or a.startswith(flag + "="):
            skip = a == flag
            continue
        out.append(a)
    return out


def _evaluate_and_report(args: argparse.Namespace, cfg: Any, device: Any) -> int:
    from plait.train.evaluate import evaluate

    mesh = ParallelMesh.build(cfg.parallel, device=device)
    result = evaluate(cfg, mesh, TokenFile.open(cfg.train.data), args.eval_sequences)
    if mesh.rank == 0:
        if args.metrics_out:
            write_text_atomic(args.metrics_out, json.dumps(result) + "\n")
        print(f"loss {result['loss']:.6f} perplexity {result['perplexity']:.4f}", flush=True)
    return 0


def rank_main(argv: list[str]) -> int:
    """One rank of `plait eval` (python -m plait.train eval ...)."""
    parser = argparse.ArgumentParser(prog="python -m plait.train eval")
    add_eval_args(parser)
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        device = resolve_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
        device.activate()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cfg = config_from_args(args).check(world_size=world)
        if world > 1:
            init_rank_process_group(device.backend, datetime.timedelta(seconds=args.timeout))
        try:
            return _evaluate_and_report(args, cfg, device)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except StopRequested as stop:
        return 128 + stop.signum
    except USER_ERRORS as e:
        if rank == 0:
            print(f"plait: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if args.debug:
            traceback.print_exc()
        print(f"plait: eval rank {rank} failed: {describe_error(e)}", file=sys.stderr)
        return 1
