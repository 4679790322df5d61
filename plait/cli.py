"""The `plait` command: train | demo | data prepare | simulate | plan | report.

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
import subprocess
import sys
from pathlib import Path

from plait.config import Config, ConfigError, load_config
from plait.parallel.pipeline.registry import SCHEDULE_NAMES
from plait.train.data import DataError

# flag -> config key (None value = flag not given)
TRAIN_FLAGS = {
    "model": "model_name", "steps": "train.steps", "seed": "train.seed",
    "global_batch": "train.global_batch", "seq_len": "train.seq_len",
    "micro_batch_size": "train.micro_batch_size", "lr": "train.lr",
    "precision": "train.precision", "recompute": "train.recompute", "data": "train.data",
    "dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp",
    "ep": "parallel.ep", "zero": "parallel.zero", "schedule": "parallel.schedule",
    "microbatches": "parallel.microbatches", "virtual_stages": "parallel.virtual_stages",
    "data_parallel": "parallel.data_parallel", "gpus_per_node": "parallel.gpus_per_node",
    "sp": "parallel.sp",
}


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with [model], [parallel], [train] tables")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any setting, e.g. --set train.warmup_steps=5")
    p.add_argument("--model", help="model preset (tiny, small, llama3-8b, ...)")
    p.add_argument("--data", help="token file (.bin); default: the embedded corpus")
    p.add_argument("--data-dir", help="where the default corpus lives (~/.cache/plait)")
    for name in ("steps", "seed", "global-batch", "seq-len", "micro-batch-size", "dp", "tp",
                 "pp", "cp", "ep", "zero", "microbatches", "virtual-stages", "gpus-per-node"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--schedule", choices=SCHEDULE_NAMES)
    p.add_argument("--precision", choices=("fp32", "bf16"))
    p.add_argument("--recompute", choices=("none", "full"))
    p.add_argument("--data-parallel", choices=("naive", "bucketed"))
    p.add_argument("--sp", action="store_true", default=None,
                   help="sequence parallel: split norms and residual over tp")
    p.add_argument("--metrics-out", help="JSON lines: one per step, then a summary")
    p.add_argument("--trace", help="pp > 1: Chrome trace (Perfetto) of the last step's "
                   "measured pipeline timeline, a row per rank")
    p.add_argument("--timeline", help="pp > 1: PNG of the last step's measured timeline")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait before the job fails (default 300)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary table")


def config_from_args(args: argparse.Namespace) -> Config:
    overrides = {key: getattr(args, flag) for flag, key in TRAIN_FLAGS.items()}
    return load_config(args.config, overrides=overrides, sets=args.set)


def _fail(msg: str) -> int:
    print(f"plait: {msg}", file=sys.stderr)
    return 2


def resolve_data(cfg: Config, data_dir: str | None) -> Path:
    """The token file to train on; the default corpus is prepared on first use."""
    from plait.train.corpus import default_token_file, prepare

    if cfg.train.data:
        return Path(cfg.train.data)
    path = default_token_file(Path(data_dir) if data_dir else None)
    if not path.is_file() or not path.with_suffix(".json").is_file():
        print(f"plait: preparing the default corpus in {path.parent} (once)...", flush=True)
        prepare(path)
    return path


def check_data(cfg: Config, path: Path) -> None:
    from plait.train.data import GlobalBatches, TokenFile

    GlobalBatches(TokenFile.open(path), cfg.train.seq_len, cfg.train.global_batch,
                  cfg.train.seed, cfg.model.vocab_size)


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        cfg = config_from_args(args)
        nproc = args.nproc or cfg.parallel.world_size
        cfg.check(world_size=nproc)
        for w in cfg.warnings():
            print(f"plait: warning: {w}", file=sys.stderr)
        data = resolve_data(cfg, args.data_dir)
        check_data(cfg, data)
    except (ConfigError, DataError) as e:
        return _fail(str(e))
    for flag in ("metrics_out", "trace", "timeline"):
        out = getattr(args, flag, None)
        if out and not Path(out).resolve().parent.is_dir():
            return _fail(f"--{flag.replace('_', '-')} {out}: directory does not exist")
    rank_args = _strip_flag(argv, "--nproc") + ["--data", str(data)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "plait.train", *rank_args]
    env = dict(os.environ)
    # one intra-op thread per rank (docs/architecture.md, Facts)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)


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
    from plait.observe import report as report_cli
    from plait.parallel.pipeline import cli as simulate_cli
    from plait.plan import cli as plan_cli

    simulate_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    report_cli.add_parser(sub)
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
