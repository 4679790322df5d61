"""The `plait` command: train | demo | data prepare | simulate | plan | report | checkpoint.

`plait train --nproc N ...` validates everything (configuration, data, vocabulary) in this
process, before any rank or collective exists, then launches N local ranks through
`torch.distributed.run` running `-m plait.train` with the same arguments: the entry a
cluster uses with `torchrun -m plait.train`. Environment variables are read here (the CLI)
and nowhere below it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from plait.checkpoint.cli import preflight as checkpoint_preflight
from plait.checkpoint.format import CheckpointError
from plait.config import ConfigError
from plait.device import DeviceError
from plait.elastic import run_elastic
from plait.launch import STOP_GRACE_S, TORCHRUN_COMMAND, LocalLaunch, launch_ranks, run_torchrun
from plait.multinode import NODE_FLAGS, add_node_args, node_spec, run_node
from plait.train.data import DataError
from plait.train.flags import add_train_args

# exit codes (README, "Exit codes"): 0 done, 1 the run failed, 2 bad input, 128 + signal
EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130
USER_ERRORS = (ConfigError, DataError, DeviceError)


def _fail(msg: str) -> int:
    print(f"plait: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    from plait.train.checks import train_inputs

    nodes, node_problems = node_spec(args, _layout_world(args))  # None: one node
    if nodes is not None and args.gpus_per_node is None:  # the mesh knows the nodes
        args.gpus_per_node = nodes.nproc
        argv = ["--gpus-per-node", str(nodes.nproc), *argv]
    found = train_inputs(args, world_size=nodes.world_size if nodes else None)
    found.problems = node_problems + found.problems
    if found.problems:
        return _fail("cannot start training:\n" + "\n".join(f"  - {p}" for p in found.problems))
    for w in found.warnings:
        print(f"plait: warning: {w}", file=sys.stderr)
    try:
        checkpoint_preflight(args, found.cfg)  # a resume's checkpoint: before any rank
    except CheckpointError as e:
        return _fail(str(e))
    for flag in ("--nproc", "--max-restarts", *NODE_FLAGS):  # the launcher's own flags
        argv = _strip_flag(argv, flag)
    rank_args = [*argv, "--data", str(found.data)]
    shim = [sys.executable, "-m", "plait.cli", TORCHRUN_COMMAND]
    extra = [f"--shutdown-timeout={int(STOP_GRACE_S) // 2}"]
    if nodes is not None:  # one launcher per node (plait/multinode.py)
        return run_node(nodes, rank_args, args.timeout, shim, extra)

    def launch_local(rank_args: list[str], env: dict[str, str] | None = None,
                     received: list[int] | None = None) -> int:
        # every listener on loopback (plait/launch.py); the store lives while the ranks run
        launch = LocalLaunch(found.nproc, rank_args, timeout_s=args.timeout, torchrun=shim,
                             extra=extra)
        return launch_ranks(launch.command, {**launch.env, **(env or {})}, received)

    if getattr(args, "max_restarts", None):  # relaunch after a rank dies, from the last checkpoint
        return run_elastic(args.max_restarts, args.checkpoint_dir, rank_args, launch_local)
    return launch_local(rank_args)


def _layout_world(args: argparse.Namespace) -> int | None:
    """The layout's world size, where the configuration loads (else validation says why)."""
    from plait.train.flags import config_from_args

    try:
        return config_from_args(args).parallel.world_size
    except ConfigError:
        return None


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
    argv = ["--model", "tiny", "--dp", str(args.nproc), "--global-batch", "16",
            "--seq-len", "128", "--steps", str(args.steps), "--lr", "3e-3",
            "--set", "train.warmup_steps=5", "--metrics-out", "runs/demo.jsonl"]
    if args.data_dir:
        argv += ["--data-dir", args.data_dir]
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    parser.add_argument("--nproc", type=int)
    train_args = parser.parse_args(argv + ["--nproc", str(args.nproc)])
    print(f"plait demo: tiny Llama-style model, data parallel on {args.nproc} CPU ranks, "
          f"{args.steps} steps; metrics in runs/demo.jsonl", flush=True)
    return cmd_train(train_args, argv)


def cmd_data(args: argparse.Namespace) -> int:
    from plait.train.corpus import DEFAULT_VOCAB, default_token_file, prepare, prepare_problems

    out = Path(args.out) if args.out else default_token_file(
        Path(args.data_dir) if args.data_dir else None)
    files = [Path(f) for f in args.files]
    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    problems = prepare_problems(out, files, tokenizer, args.vocab_size)
    if problems:
        return _fail("cannot prepare data:\n" + "\n".join(f"  - {p}" for p in problems))
    vocab = args.vocab_size or DEFAULT_VOCAB
    path = prepare(out, files=files or None, tokenizer_file=tokenizer, vocab_size=vocab)
    meta = json.loads(path.with_suffix(".json").read_text())
    if tokenizer is None and meta["vocab_size"] < vocab:
        print(f"plait: warning: the corpus supports only {meta['vocab_size']} tokens, not the "
              f"{vocab} asked for; the vocabulary is {meta['vocab_size']} (train with "
              f"--set model.vocab_size={meta['vocab_size']} or more)", file=sys.stderr)
    print(f"wrote {path}: {meta['num_tokens']:,} tokens, vocabulary {meta['vocab_size']}, "
          f"from {meta['files']} files ({meta['source']})")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plait")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plait", description=__doc__.splitlines()[0],
        epilog="exit status: 0 done, 1 the run failed, 2 bad input (nothing started, nothing "
        "written), 128 + N stopped by signal N (130 SIGINT, 143 SIGTERM, 129 SIGHUP)")
    parser.add_argument("--version", action="version", version=f"plait {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train on N local ranks (torch.distributed.run)",
                           description="Validate every input, then train on --nproc local "
                           "ranks. Settings: defaults, then --config, then flags, then --set.")
    add_train_args(train)
    train.add_argument("--nproc", type=int, metavar="N",
                       help="ranks to launch (default: the layout's dp*pp*cp*tp)")
    train.add_argument("--max-restarts", type=int, metavar="R",
                       help="when a rank dies, stop the others and start every rank again "
                       "from the last committed checkpoint, up to R times (needs "
                       "--checkpoint-dir and --checkpoint-every; plait/elastic.py)")
    add_node_args(train)

    demo = sub.add_parser("demo", help="prepare the default corpus, train tiny on 4 ranks")
    demo.add_argument("--nproc", type=int, default=4, metavar="N",
                      help="data-parallel ranks (default 4)")
    demo.add_argument("--steps", type=int, default=40, metavar="N", help="default 40")
    demo.add_argument("--data-dir", help="where the default corpus lives (~/.cache/plait)")

    data = sub.add_parser("data", help="data preparation")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="text files -> BPE tokenizer -> token file")
    prep.add_argument("files", nargs="*", help="text files (default: the Python stdlib)")
    prep.add_argument("--out", help="token file to write (.bin, with .json and "
                      ".tokenizer.json beside it); default: the default corpus")
    prep.add_argument("--data-dir", help="where the default corpus lives (~/.cache/plait)")
    prep.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    prep.add_argument("--vocab-size", type=int, metavar="N",
                      help="BPE vocabulary to train (default 2048)")

    # subcommands that live beside their subsystem register themselves
    from plait.checkpoint import cli as checkpoint_cli
    from plait.observe import report as report_cli
    from plait.parallel.pipeline import cli as simulate_cli
    from plait.plan import cli as plan_cli

    simulate_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    report_cli.add_parser(sub)
    checkpoint_cli.add_parser(sub)
    for p in [*sub.choices.values(), prep]:
        if p is not data and not any("--debug" in a.option_strings for a in p._actions):
            p.add_argument("--debug", action="store_true",
                           help="show Python tracebacks (by default an error is one line)")
    return parser


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    if args.command == "train":
        return cmd_train(args, argv[argv.index("train") + 1:])
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "data":
        return cmd_data(args)
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0, 1 failed, 2 bad input, 130 interrupted; no traceback without --debug."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    try:
        return _dispatch(args, argv)
    except KeyboardInterrupt:
        print("plait: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except USER_ERRORS as e:
        if debug:
            traceback.print_exc()
        return _fail(str(e))
    except Exception as e:  # a bug, or the machine (disk full, ...): one line, or --debug
        if debug:
            raise
        print(f"plait: {args.command} failed: {type(e).__name__}: {e} (rerun with --debug "
              "for the traceback)", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    if sys.argv[1:2] == [TORCHRUN_COMMAND]:  # the launcher's own child (plait/launch.py)
        code = run_torchrun(sys.argv[2:])
    else:
        code = main()
    # Nothing is left to clean up: skip the interpreter's teardown of torch, which takes
    # seconds on a loaded machine, so that a stopped run ends when its ranks have.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
