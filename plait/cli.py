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
import subprocess
import sys
from pathlib import Path

from plait.checkpoint.cli import preflight as checkpoint_preflight
from plait.checkpoint.format import CheckpointError
from plait.config import ConfigError
from plait.device import DeviceError, resolve_device
from plait.launch import LocalLaunch
from plait.train.data import DataError
from plait.train.flags import (
    add_train_args,
    check_data,
    config_from_args,
    resolve_data,
)


def _fail(msg: str) -> int:
    print(f"plait: {msg}", file=sys.stderr)
    return 2


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        cfg = config_from_args(args)
        nproc = args.nproc or cfg.parallel.world_size
        cfg.check(world_size=nproc)
        for w in cfg.warnings():
            print(f"plait: warning: {w}", file=sys.stderr)
        resolve_device(args.device, local_rank=nproc - 1)  # every local rank has its device
        data = resolve_data(cfg, args.data_dir)
        check_data(cfg, data)
        checkpoint_preflight(args, cfg)  # flags, and a resume's checkpoint: before any rank
    except (ConfigError, DataError, DeviceError, CheckpointError) as e:
        return _fail(str(e))
    for flag in ("metrics_out", "trace", "timeline"):
        out = getattr(args, flag, None)
        if out and not Path(out).resolve().parent.is_dir():
            return _fail(f"--{flag.replace('_', '-')} {out}: directory does not exist")
    rank_args = _strip_flag(argv, "--nproc") + ["--data", str(data)]
    launch = LocalLaunch(nproc, rank_args, timeout_s=args.timeout)  # loopback only
    return subprocess.call(launch.command, env=launch.env)


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
    Path("runs").mkdir(exist_ok=True)
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
    from plait.train.corpus import DEFAULT_VOCAB, default_token_file, prepare

    out = Path(args.out) if args.out else default_token_file(
        Path(args.data_dir) if args.data_dir else None)
    try:
        path = prepare(out, files=[Path(f) for f in args.files] or None,
                       tokenizer_file=Path(args.tokenizer) if args.tokenizer else None,
                       vocab_size=args.vocab_size or DEFAULT_VOCAB)
    except DataError as e:
        return _fail(str(e))
    meta = json.loads(path.with_suffix(".json").read_text())
    print(f"wrote {path}: {meta['num_tokens']:,} tokens, vocabulary {meta['vocab_size']}, "
          f"from {meta['files']} files ({meta['source']})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plait", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train on N local ranks (torch.distributed.run)")
    add_train_args(train)
    train.add_argument("--nproc", type=int, help="ranks to launch (default: the layout's)")

    demo = sub.add_parser("demo", help="prepare the default corpus, train tiny on 4 ranks")
    demo.add_argument("--nproc", type=int, default=4)
    demo.add_argument("--steps", type=int, default=40)
    demo.add_argument("--data-dir")

    data = sub.add_parser("data", help="data preparation")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="text files -> BPE tokenizer -> token file")
    prep.add_argument("files", nargs="*", help="text files (default: the Python stdlib)")
    prep.add_argument("--out", help="token file to write (.bin); default: the default corpus")
    prep.add_argument("--data-dir")
    prep.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    prep.add_argument("--vocab-size", type=int)

    # subcommands that live beside their subsystem register themselves
    from plait.checkpoint import cli as checkpoint_cli
    from plait.observe import report as report_cli
    from plait.parallel.pipeline import cli as simulate_cli
    from plait.plan import cli as plan_cli

    simulate_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    report_cli.add_parser(sub)
    checkpoint_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return cmd_train(args, argv[1:])
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "data":
        return cmd_data(args)
    if hasattr(args, "func"):
        return args.func(args)
    return _fail(f"unknown command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
