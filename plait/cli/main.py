"""The `plait` command: train | demo | data prepare | simulate | plan | report | checkpoint
| eval | export | calibrate | cluster.

`plait train --nproc N ...` validates everything (configuration, data, vocabulary) in this
process, before any rank or collective exists, then launches N local ranks through
`torch.distributed.run` running `-m plait.train` with the same arguments: the entry a
cluster uses with `torchrun -m plait.train`. Environment variables are read here (the CLI)
and nowhere below it.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait.train.checks import TrainInputs

# exit codes (README, "Exit codes"): 0 done, 1 the run failed, 2 bad input, 128 + signal
EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130
# the user's mistakes, by (module, class): the modules that define them import torch, so
# `plait simulate` / `plait plan` (which never raise them) do not import them; a class
# counts once its module is loaded (it cannot have been raised before)
USER_ERROR_CLASSES = (("plait.config", "ConfigError"), ("plait.train.data", "DataError"),
                      ("plait.device", "DeviceError"))
# subcommands that need no torch: `plait simulate ...` / `plait plan ...` build only their
# own parser, so that they start in a fraction of a second
LIGHT_COMMANDS = ("simulate", "plan")


def user_errors() -> tuple[type[Exception], ...]:
    """The exception classes that are the user's mistake, of the modules loaded so far."""
    return tuple(getattr(sys.modules[mod], name) for mod, name in USER_ERROR_CLASSES
                 if mod in sys.modules)


def _fail(msg: str) -> int:
    print(f"plait: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    from plait.checkpoint.cli import preflight as checkpoint_preflight
    from plait.checkpoint.format import CheckpointError
    from plait.launch.elastic import run_elastic
    from plait.launch.local import STOP_GRACE_S, TORCHRUN_COMMAND, LocalLaunch, launch_ranks
    from plait.launch.nodes import NODE_FLAGS, node_spec, run_node
    from plait.launch.nodes_elastic import run_elastic_nodes
    from plait.plan.host_memory import host_memory_problem
    from plait.train.checks import train_inputs

    dry = args.dry_run
    problems = dry_run_flag_problems(args)
    nodes, node_problems = (None, []) if dry else node_spec(args, _layout_world(args))
    if nodes is not None and args.gpus_per_node is None:  # the mesh knows the nodes
        args.gpus_per_node = nodes.nproc
        argv = ["--gpus-per-node", str(nodes.nproc), *argv]
    world = args.world_size if dry else (nodes.world_size if nodes else None)
    found = train_inputs(args, world_size=world, local_rank=0 if dry else None)
    found.problems = problems + node_problems + found.problems
    if dry:  # the ranks to build, against the world (the layout's, when not given)
        from plait.observe.dry_run import parse_ranks

        dry_ranks, rank_problems = parse_ranks(args.rank, args.world_size or found.nproc)
        found.problems += rank_problems
    if not found.problems:  # model states in this machine's memory, before any rank
        at_once = [[r] for r in dry_ranks] if dry else [range(found.nproc)]  # dry: one by one
        problem = next(filter(None, (host_memory_problem(found.cfg, ranks, found.device_type)
                                     for ranks in at_once)), None)
        found.problems += [problem] if problem else []
    if found.problems:
        return _fail("cannot start training:\n" + "\n".join(f"  - {p}" for p in found.problems))
    for w in found.warnings:
        print(f"plait: warning: {w}", file=sys.stderr)
    if dry:
        return run_dry(args, found, dry_ranks)
    try:
        checkpoint_preflight(args, found.cfg)  # a resume's checkpoint: before any rank
    except CheckpointError as e:
        return _fail(str(e))
    for flag in ("--nproc", "--max-restarts", *NODE_FLAGS):  # the launcher's own flags
        argv = _strip_flag(argv, flag)
    rank_args = [*argv, "--data", str(found.data)]
    shim = [sys.executable, "-m", "plait.cli", TORCHRUN_COMMAND]
    extra = [f"--shutdown-timeout={int(STOP_GRACE_S) // 2}"]
    if found.cfg.parallel.fault_tolerance:  # a launch per replica (plait/launch/replicas.py)
        from plait.launch.replicas import node_problems, run_replicas

        bad = node_problems(nodes, found.cfg.parallel.dp_replicate) if nodes else []
        if bad:
            return _fail("cannot start training:\n" + "\n".join(f"  - {p}" for p in bad))
        return run_replicas(found.cfg.parallel.dp_replicate, found.nproc, rank_args,
                            args.timeout, shim, extra, args.max_restarts, args.metrics_out,
                            args.quiet, found.cfg.train.steps, nodes)
    if nodes is not None and getattr(args, "max_restarts", None):  # restarts together
        return run_elastic_nodes(nodes, args.max_restarts, args.checkpoint_dir, rank_args,
                                 args.timeout, shim, extra)
    if nodes is not None:  # one launcher per node (plait/launch/nodes.py)
        return run_node(nodes, rank_args, args.timeout, shim, extra)

    def launch_local(rank_args: list[str], env: dict[str, str] | None = None,
                     received: list[int] | None = None) -> int:
        # every listener on loopback (plait/launch/local.py); the store lives while the ranks run
        launch = LocalLaunch(found.nproc, rank_args, timeout_s=args.timeout, torchrun=shim,
                             extra=extra)
        return launch_ranks(launch.command, {**launch.env, **(env or {})}, received)

    if getattr(args, "max_restarts", None):  # relaunch after a rank dies, from the last checkpoint
        return run_elastic(args.max_restarts, args.checkpoint_dir, rank_args, launch_local)
    return launch_local(rank_args)


def _layout_world(args: argparse.Namespace) -> int | None:
    """The layout's world size, where the configuration loads (else validation says why)."""
    from plait.config import ConfigError
    from plait.train.flags import config_from_args

    try:
        return config_from_args(args).parallel.world_size
    except ConfigError:
        return None


def dry_run_flag_problems(args: argparse.Namespace) -> list[str]:
    """--dry-run's flags: one process, no launch, nothing but the metrics file written."""
    if not args.dry_run:
        return [f"{flag} is for a dry run; add --dry-run (or leave {flag} out)"
                for flag, value in (("--world-size", args.world_size), ("--rank", args.rank))
                if value is not None]
    problems = []
    world = args.world_size
    if world is not None and world < 1:
        problems.append(f"--world-size {world}: a layout has at least one rank")
    for flag, value in (("--nproc", args.nproc), ("--checkpoint-dir", args.checkpoint_dir),
                        ("--resume", args.resume), ("--trace", args.trace),
                        ("--timeline", args.timeline), ("--tensorboard", args.tensorboard),
                        ("--wandb", args.wandb), ("--eval-every", args.eval_every),
                        ("--checkpoint-on-stop", args.checkpoint_on_stop or None)):
        if value is not None:
            problems.append(f"--dry-run runs one rank in this process and saves nothing; "
                            f"leave out {flag}")
    return problems


def run_dry(args: argparse.Namespace, found: TrainInputs, ranks: list[int]) -> int:
    """Ranks of the layout on torch's fake process group (plait/observe/dry_run.py): each
    one's measured memory and collectives beside the planner's prediction. One rank runs
    in this process; several run one after the other, each in a process of its own."""
    from plait.device import resolve_device
    from plait.files import write_text_atomic
    from plait.observe.dry_run import dry_run, dry_run_ranks, dry_run_table
    from plait.train.data import GlobalBatches, TokenFile

    cfg, device = found.cfg, resolve_device(args.device, 0)
    world = args.world_size or found.nproc
    if len(ranks) == 1:
        batches = GlobalBatches(TokenFile.open(found.data), cfg.train.seq_len,
                                cfg.train.global_batch, cfg.train.seed, cfg.model.vocab_size)
        outs = [dry_run(cfg, world, ranks[0], batches, device)]
    else:
        # forked, one thread each (a spawned child re-imports torch: seconds per rank;
        # benchmarks/dry_run.py gives a large layout's ranks every core)
        outs = dry_run_ranks(cfg, world, ranks, found.data, device)
    print("\n".join(dry_run_table(out) for out in outs), flush=True)
    if args.metrics_out:  # one rank: its result; several: the list of them
        doc = outs[0] if len(outs) == 1 else outs
        path = write_text_atomic(args.metrics_out, json.dumps(doc) + "\n")
        print(f"dry run result in {path}")
    return 0


def _strip_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


def cmd_demo(args: argparse.Namespace) -> int:
    from plait.train.flags import add_train_args

    argv = ["--model", "tiny", "--dp", str(args.nproc), "--global-batch", "16",
            "--seq-len", "128", "--steps", str(args.steps), "--lr", "3e-3",
            "--set", "train.warmup_steps=5", "--metrics-out", "runs/demo.jsonl"]
    if args.data_dir:
        argv += ["--data-dir", args.data_dir]
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    parser.add_argument("--nproc", type=int)
    parser.set_defaults(dry_run=False, world_size=None, rank=None)
    train_args = parser.parse_args(argv + ["--nproc", str(args.nproc)])
    print(f"plait demo: tiny Llama-style model, data parallel on {args.nproc} CPU ranks, "
          f"{args.steps} steps; metrics in runs/demo.jsonl", flush=True)
    return cmd_train(train_args, argv)


def cmd_data(args: argparse.Namespace) -> int:
    from plait.train.corpus import (
        DEFAULT_VOCAB,
        default_token_file,
        hf_tokenizer,
        prepare,
        prepare_problems,
    )

    out = Path(args.out) if args.out else default_token_file(
        Path(args.data_dir) if args.data_dir else None)
    files = [Path(f) for f in args.files]
    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    hf_dir = None
    if args.tokenizer and args.tokenizer.startswith("hf:"):  # a Hugging Face model's
        hf_dir = Path(args.tokenizer[3:]).expanduser()
        tokenizer = hf_dir / "tokenizer.json"
    problems = prepare_problems(out, files, tokenizer, args.vocab_size, args.text_field, hf_dir,
                                args.force)
    if problems:
        return _fail("cannot prepare data:\n" + "\n".join(f"  - {p}" for p in problems))
    vocab = args.vocab_size or DEFAULT_VOCAB
    eot = hf_tokenizer(hf_dir)[1] if hf_dir else None
    path = prepare(out, files=files or None, tokenizer_file=tokenizer, vocab_size=vocab,
                   text_field=args.text_field, eot_id=eot,
                   progress=lambda line: print(f"plait: prepare: {line}", file=sys.stderr))
    meta = json.loads(path.with_suffix(".json").read_text())
    if tokenizer is None and meta["vocab_size"] < vocab:
        print(f"plait: warning: the corpus supports only {meta['vocab_size']} tokens, not the "
              f"{vocab} asked for; the vocabulary is {meta['vocab_size']} (train with "
              f"--set model.vocab_size={meta['vocab_size']} or more)", file=sys.stderr)
    print(f"wrote {path}: {meta['num_tokens']:,} tokens, vocabulary {meta['vocab_size']}, "
          f"from {meta['files']} files ({meta['source']})")
    return 0


class _VersionAction(argparse.Action):
    """--version, looked up only when asked (importlib.metadata costs 0.1 s at start-up)."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(message=f"plait {_version()}\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plait")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole `plait` parser; with `only` (one of LIGHT_COMMANDS), just that command's,
    which imports neither torch nor the other subsystems."""
    from plait.cli_parser import PlaitParser

    parser = PlaitParser(
        prog="plait", description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog="exit status: 0 done, 1 the run failed, 2 bad input (nothing started, nothing "
        "written), 128 + N stopped by signal N (130 SIGINT, 143 SIGTERM, 129 SIGHUP)")
    parser.add_argument("--version", action=_VersionAction, nargs=0,
                        help="show program's version number and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    if only == "simulate":
        from plait.schedule import cli as simulate_cli

        simulate_cli.add_parser(sub)
    elif only == "plan":
        from plait.plan import cli as plan_cli

        plan_cli.add_parser(sub)
    else:
        _add_all_commands(sub)
    for name, p in sub.choices.items():
        if name != "data" and not any("--debug" in a.option_strings for a in p._actions):
            p.add_argument("--debug", action="store_true",
                           help="show Python tracebacks (by default an error is one line)")
    return parser


def _add_all_commands(sub) -> None:
    from plait.launch.nodes import add_node_args
    from plait.train.flags import DATA_DIR_HELP, add_train_args

    train = sub.add_parser("train", help="train on N local ranks (torch.distributed.run)",
                           description="Validate every input, then train on --nproc local "
                           "ranks. Settings: defaults, then --config, then flags, then --set.")
    add_train_args(train)
    train.add_argument("--nproc", type=int, metavar="N",
                       help="ranks to launch (default: the layout's world size)")
    dry = train.add_argument_group("dry run (docs/dry_run.md)")
    dry.add_argument("--dry-run", action="store_true",
                     help="build and train one rank of the layout in this process on torch's "
                     "fake process group (no communication): its memory by category and its "
                     "collectives beside the planner's prediction")
    dry.add_argument("--world-size", type=int, metavar="N",
                     help="--dry-run: ranks of the layout (default: its world size)")
    dry.add_argument("--rank", metavar="R[,R...]", help="--dry-run: the rank(s) to build: "
                     "numbers, first, last (default 0; --rank first,last: the two ends of "
                     "the pipeline, one after the other)")
    train.add_argument("--max-restarts", type=int, metavar="R",
                       help="when a rank dies, stop the others and start every rank again "
                       "from the last committed checkpoint, up to R times (needs "
                       "--checkpoint-dir and --checkpoint-every; plait/launch/elastic.py); "
                       "with --fault-tolerance: replacement replicas started, at most R "
                       "(default 2 x dp_replicate)")
    add_node_args(train)

    demo = sub.add_parser("demo", help="prepare the default corpus, train tiny on 4 ranks")
    demo.add_argument("--nproc", type=int, default=4, metavar="N",
                      help="data-parallel ranks (default 4)")
    demo.add_argument("--steps", type=int, default=40, metavar="N", help="default 40")
    demo.add_argument("--data-dir", help=DATA_DIR_HELP)

    data = sub.add_parser("data", help="data preparation")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="text files -> BPE tokenizer -> token file")
    prep.add_argument("files", nargs="*", help="text, .jsonl or .parquet files (default: the "
                      "Python stdlib)")
    prep.add_argument("--out", help="token file to write (.bin, with .json and "
                      ".tokenizer.json beside it); default: the default corpus")
    prep.add_argument("--data-dir", help=DATA_DIR_HELP)
    prep.add_argument("--tokenizer", help="use this tokenizer.json instead of training one, "
                      "or hf:DIR: a Hugging Face model's (DIR/tokenizer.json)")
    prep.add_argument("--text-field", default="text", metavar="NAME",
                      help=".jsonl / .parquet inputs: the field holding each document's text "
                      "(default text)")
    prep.add_argument("--vocab-size", type=int, metavar="N",
                      help="BPE vocabulary to train (default 2048)")
    prep.add_argument("--force", action="store_true", help="replace an existing token file "
                      "and the files beside it (by default plait refuses to)")

    # subcommands that live beside their subsystem register themselves
    from plait.calibrate import machine as calibrate_cli
    from plait.checkpoint import cli as checkpoint_cli
    from plait.cli import eval as eval_cli
    from plait.launch import cluster as cluster_cli
    from plait.observe import report as report_cli
    from plait.plan import cli as plan_cli
    from plait.schedule import cli as simulate_cli

    simulate_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    report_cli.add_parser(sub)
    checkpoint_cli.add_parser(sub)
    eval_cli.add_parsers(sub)  # plait eval, plait export (docs/huggingface.md)
    calibrate_cli.add_parser(sub)  # plait calibrate (docs/planner_cpu.md)
    cluster_cli.add_parser(sub)  # plait cluster (docs/multi_node.md, emulated nodes)
    prep.add_argument("--debug", action="store_true",  # `data` itself takes none
                      help="show Python tracebacks (by default an error is one line)")


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    if args.command == "train":
        return cmd_train(args, argv[argv.index("train") + 1:])
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "data":
        return cmd_data(args)
    if args.command == "eval":
        from plait.cli.eval import cmd_eval

        return cmd_eval(args, argv[argv.index("eval") + 1:])
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0, 1 failed, 2 bad input, 130 interrupted; no traceback without --debug."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv and argv[0] in LIGHT_COMMANDS else None)
    parser.argv = argv  # an unknown flag's error names the closest of its subcommand's
    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False)
    try:
        return _dispatch(args, argv)
    except KeyboardInterrupt:
        print("plait: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except user_errors() as e:
        if debug:
            traceback.print_exc()
        return _fail(str(e))
    except Exception as e:  # a bug, or the machine (disk full, ...): one line, or --debug
        if debug:
            raise
        print(f"plait: {args.command} failed: {type(e).__name__}: {e} (rerun with --debug "
              "for the traceback)", file=sys.stderr)
        return EXIT_FAILED

