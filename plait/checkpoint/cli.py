"""`plait checkpoint inspect D` and `plait checkpoint consolidate D --out F`, and the train
flags that save and resume (--checkpoint-dir, --checkpoint-every, --keep, --resume).

`preflight` is what `plait train` runs before launching any rank: the flags' problems and,
when resuming, that a committed checkpoint exists and is of this model. Errors are
`CheckpointError`s with the fix; nothing here reads the environment.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from plait.config import Config
from plait.files import FORCE_HELP, artifact_problems

from . import Checkpointing
from .export import DTYPES, consolidate, inspect_checkpoint
from .format import CheckpointError, read_metadata
from .reader import CheckpointWarning, candidates, check_compatible


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """The train flags (plait/train/flags.py adds them to `plait train` and the rank entry)."""
    g = p.add_argument_group("checkpoints (docs/checkpoint.md)")
    g.add_argument("--checkpoint-dir", help="save checkpoints under this directory")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="save after every N steps and after the last (default: never)")
    g.add_argument("--keep", type=int, metavar="K",
                   help="keep the newest K committed checkpoints (default: all)")
    g.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints on a background thread from a host copy while "
                   "training goes on (committed one step later)")
    g.add_argument("--resume", nargs="?", const="latest", metavar="PATH",
                   help="resume: alone, from the newest complete checkpoint in "
                   "--checkpoint-dir; or from PATH (a checkpoint, or a directory of them)")


def from_args(args: argparse.Namespace) -> Checkpointing:
    """A directory given saves at least the final state (--checkpoint-every or not)."""
    return Checkpointing(dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
                         every=args.checkpoint_every or 0, keep=args.keep,
                         final=bool(args.checkpoint_dir), resume=args.resume,
                         background=args.async_checkpoint)


def _nothing_yet(src: Path, ck: Checkpointing) -> bool:
    """Whether `src` is a checkpoint root that holds nothing yet: missing (where it is
    --checkpoint-dir, so not a mistyped checkpoint), or a directory with no entries but
    hidden files and a dead first save's `step-N.tmp-*`. One launch command then serves
    the first start and every restart (torchtitan's rule)."""
    if not src.exists():
        return ck.dir is not None and src.resolve() == Path(ck.dir).resolve()
    return src.is_dir() and all(p.name.startswith(".") or ".tmp-" in p.name
                                for p in src.iterdir())


def preflight(args: argparse.Namespace, cfg: Config) -> Checkpointing:
    """The checkpoint flags checked before any rank starts (CheckpointError on a problem).
    `notes`: what the caller should tell the user (a resume with nothing to resume from
    starts fresh; a directory without --checkpoint-every gets the final state only)."""
    ck = from_args(args)
    problems = ck.problems()
    if problems:
        raise CheckpointError("; ".join(problems))
    src = ck.source()
    if src is not None and _nothing_yet(src, ck):
        ck.notes.append(f"--resume: no checkpoint in {src} yet; starting from step 0")
        ck.resume = None
    if ck.dir is not None and not ck.every:
        ck.notes.append(f"--checkpoint-dir without --checkpoint-every: only the final state "
                        f"(after step {cfg.train.steps}) is saved in {ck.dir}")
    if ck.dir is not None:
        try:  # the first save would find out after a step; find out now
            ck.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"--checkpoint-dir {ck.dir}: cannot create it "
                                  f"({e.strerror or e})") from e
        if not os.access(ck.dir, os.W_OK | os.X_OK):
            raise CheckpointError(f"--checkpoint-dir {ck.dir}: not writable")
    src = ck.source()
    if src is not None:
        path = candidates(src)[0][0]
        with warnings.catch_warnings():  # settings that differ: the resume itself says so
            warnings.simplefilter("ignore", CheckpointWarning)
            check_compatible(read_metadata(path), cfg, path)
    return ck


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "checkpoint", help="inspect or consolidate checkpoints",
        description="`plait checkpoint inspect D`: a checkpoint's step, layout, tensors and "
        "bytes per rank, and whether it is complete; `plait checkpoint consolidate D --out "
        "F`: its full model as one safetensors file. Saving and resuming are plait train's "
        "flags (--checkpoint-dir, --checkpoint-every, --keep, --resume).")
    sub = p.add_subparsers(dest="checkpoint_command", required=True)
    ins = sub.add_parser("inspect", help="step, layout, tensors, bytes per rank, complete?")
    ins.add_argument("path", help="a checkpoint, or a directory of them (the newest "
                     "committed is shown)")
    ins.add_argument("--no-verify", action="store_true",
                     help="skip reading every block to check its checksum")
    con = sub.add_parser("consolidate", help="the full model as one safetensors file")
    con.add_argument("path", help="a checkpoint, or a directory of them (the newest)")
    con.add_argument("--out", required=True, help="the .safetensors file to write")
    con.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                     help="dtype of the exported weights (default fp32: the masters)")
    con.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        if args.checkpoint_command == "inspect":
            text, sound = inspect_checkpoint(Path(args.path), check=not args.no_verify)
            print(text)
            return 0 if sound else 1  # a script must not take a corrupt one for good
        out = Path(args.out).expanduser()
        problems = artifact_problems("--out", out, [args.path], args.force)
        if problems:
            raise CheckpointError("; ".join(problems))
        out.parent.mkdir(parents=True, exist_ok=True)  # as every other output does
        path, n = consolidate(Path(args.path), out, args.dtype)
        print(f"wrote {path}: {n} tensors, {args.dtype}")
        return 0
    except CheckpointError as e:
        print(f"plait: {e}", file=sys.stderr)
        return 2
