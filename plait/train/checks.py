"""Every input of `plait train` checked at once, before any rank starts or any byte is
written: the flags that are not settings, the configuration, the device, the token file
and the output paths. `train_inputs` returns what it could build and every problem, each
naming the fix; the caller refuses the run when there is any.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from plait.config import Config, ConfigError
from plait.device import DeviceError, resolve_device
from plait.files import output_problems
from plait.train.data import DataError, TokenFile
from plait.train.flags import check_data, config_from_args, resolve_data
from plait.train.sinks import sink_problems

OUTPUT_FLAGS = ("metrics_out", "trace", "timeline")
MAX_LOCAL_RANKS = 256  # processes on one machine; past it a typo, not a plan


@dataclass
class TrainInputs:
    cfg: Config | None = None
    nproc: int | None = None
    data: Path | None = None
    device_type: str = "cpu"  # where the ranks compute: "cpu" or "cuda"
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def flag_problems(args: argparse.Namespace) -> list[str]:
    """The flags that are not configuration settings: counts and seconds."""
    problems = []
    nproc = getattr(args, "nproc", None)
    if nproc is not None and nproc < 1:
        problems.append(f"--nproc {nproc}: launch at least one rank (--nproc 1 or more), or "
                        "leave it out to launch the layout's world size")
    elif nproc is not None and nproc > MAX_LOCAL_RANKS:
        problems.append(f"--nproc {nproc}: plait train launches at most {MAX_LOCAL_RANKS} "
                        "ranks on one machine; use torchrun -m plait.train across nodes")
    problems += _stop_checkpoint_problems(args)
    problems += sink_problems(args)  # --tensorboard / --wandb: the package, the directory
    if getattr(args, "timeline", None) and importlib.util.find_spec("matplotlib") is None:
        problems.append("--timeline draws with matplotlib, which is not installed: pip "
                        "install 'plait[plot]' (or leave --timeline out; --trace needs nothing)")
    max_restarts = getattr(args, "max_restarts", None)
    if max_restarts is not None and max_restarts < 0:
        problems.append(f"--max-restarts {max_restarts}: must be >= 0 (0: no restarts)")
    elif max_restarts and not getattr(args, "fault_tolerance", None) and (
            not args.checkpoint_dir or not args.checkpoint_every):
        problems.append("--max-restarts resumes from the last checkpoint: give "
                        "--checkpoint-dir D and --checkpoint-every N too")
    problems += _fault_tolerance_flag_problems(args)
    log_every = getattr(args, "log_every", None)
    if log_every is not None and log_every < 1:
        problems.append(f"--log-every {log_every}: print a step line every N >= 1 steps, or "
                        "leave it out for about ten a run")
    timeout = args.timeout
    if not math.isfinite(timeout) or timeout <= 0:
        problems.append(f"--timeout {timeout}: seconds a collective may wait must be a "
                        "finite number > 0 (default 300)")
    return problems


def _fault_tolerance_flag_problems(args: argparse.Namespace) -> list[str]:
    """--fault-tolerance: the launcher writes --metrics-out and a line a step; what only a
    plain run's rank 0 writes is refused, not silently dropped."""
    if not getattr(args, "fault_tolerance", None):
        return []
    given = [f"--{name.replace('_', '-')}" for name in ("tensorboard", "wandb", "trace",
                                                         "timeline", "checkpoint_on_stop")
             if getattr(args, name, None)]
    return [f"{flag} with --fault-tolerance is not built (the launcher writes "
            "--metrics-out); leave it out" for flag in given]


def _stop_checkpoint_problems(args: argparse.Namespace) -> list[str]:
    """--checkpoint-on-stop needs a directory it will be able to write (nothing created)."""
    if not getattr(args, "checkpoint_on_stop", False):
        return []
    if not args.checkpoint_dir:
        return ["--checkpoint-on-stop saves into --checkpoint-dir; give --checkpoint-dir D"]
    d = Path(args.checkpoint_dir).expanduser()
    base = next((a for a in (d, *d.resolve().parents) if a.exists()), Path("/"))
    if not base.is_dir():
        return [f"--checkpoint-dir {d}: {base} is a file, not a directory; choose another"]
    if not os.access(base, os.W_OK | os.X_OK):
        return [f"--checkpoint-dir {d}: {base} is not writable; choose a directory you "
                "can write"]
    return []


def _input_paths(args: argparse.Namespace, data: Path | None) -> list[Path]:
    """The files this run reads; no output may name one of them."""
    inputs = [Path(args.config)] if args.config else []
    held_out = getattr(args, "eval_data", None)
    for token_file in (data, Path(held_out) if held_out else None):
        if token_file is not None:
            bin_path = token_file.with_suffix(".bin")
            inputs += [bin_path, bin_path.with_suffix(".json")]
    return inputs


def output_path_problems(args: argparse.Namespace, data: Path | None) -> list[str]:
    """Each output writable, none an input, no two the same file."""
    problems: list[str] = []
    inputs = _input_paths(args, data)
    seen: dict[Path, str] = {}
    for name in OUTPUT_FLAGS:
        out = getattr(args, name, None)
        if out is None:
            continue
        flag = "--" + name.replace("_", "-")
        problems += output_problems(flag, out, inputs)
        resolved = Path(out).expanduser().resolve()
        if resolved in seen:
            problems.append(f"{flag} and {seen[resolved]} both name {out}; give each its "
                            "own file")
        seen[resolved] = flag
    return problems


def train_inputs(args: argparse.Namespace, world_size: int | None = None,
                 local_rank: int | None = None, prepare_default: bool = True) -> TrainInputs:
    """Build and check everything a training run reads; `world_size`: the launcher's
    (torchrun's WORLD_SIZE), else --nproc or the layout's. `local_rank`: the one rank whose
    device to check (a rank of `torchrun -m plait.train`); by default every local rank of
    `plait train`. `prepare_default=False`: a missing default corpus is not prepared here
    (rank 0 prepares it; the others check it once it exists)."""
    found = TrainInputs(problems=flag_problems(args))
    try:
        found.cfg = config_from_args(args)
    except ConfigError as e:
        found.problems += e.problems
        data = Path(args.data) if getattr(args, "data", None) else None
        found.problems += output_path_problems(args, data)
        return found
    cfg = found.cfg
    nproc = getattr(args, "nproc", None)
    found.nproc = world_size or (nproc if nproc and nproc > 0 else cfg.parallel.world_size)
    config_problems = cfg.validate(world_size=found.nproc)
    found.problems += config_problems
    found.problems += init_problems(cfg)
    found.warnings = cfg.warnings()
    if cfg.train.init_from is not None and not cfg.train.data:
        found.warnings.append(f"--init-from {cfg.train.init_from} without --data: the default "
                              "corpus is tokenized by plait's own BPE, not the model's "
                              "tokenizer (plait data prepare --tokenizer hf:DIR)")
    try:  # every local rank has its device
        found.device_type = resolve_device(
            args.device, local_rank=found.nproc - 1 if local_rank is None else local_rank).type
    except DeviceError as e:
        found.problems.append(str(e))
    if cfg.train.data:
        found.data = Path(cfg.train.data)
    found.problems += output_path_problems(args, found.data)
    if found.data is None:  # the default corpus: prepared on first use, where it is allowed
        from plait.train.corpus import default_token_file

        target = default_token_file(Path(args.data_dir) if args.data_dir else None)
        if not target.is_file():
            found.problems += output_problems("--data-dir", target)
            if not prepare_default:
                return found
    if found.data is None and found.problems:
        return found  # the default corpus is prepared only for a run that will start
    try:
        if found.data is None:
            found.data = resolve_data(cfg, args.data_dir)
        if config_problems:  # the batch arithmetic needs a valid configuration
            TokenFile.open(found.data)
        else:
            check_data(cfg, found.data)
        found.problems += vocabulary_problems(cfg, found.data)
        found.warnings += vocabulary_notes(cfg, found.data)
    except DataError as e:
        found.problems.append(str(e))
    if cfg.train.eval_data is not None and not config_problems:
        from plait.train.held_out import held_out_problems

        found.problems += held_out_problems(cfg)
    return found


def init_problems(cfg: Config) -> list[str]:
    """--init-from: the weights are there and fit the model (headers, metadata only)."""
    if cfg.train.init_from is None:
        return []
    from plait.checkpoint.format import CheckpointError
    from plait.checkpoint.init_from import check

    try:
        check(cfg.train.init_from, cfg)
    except CheckpointError as e:
        return [f"--init-from: {e}"]
    return []


def vocabulary_problems(cfg: Config, data: Path) -> list[str]:
    """Data tokenized with a larger vocabulary than the model's is refused even where the
    windows read so far happen to fit: a later one would hold an id with no embedding."""
    vocab, mine = TokenFile.open(data).meta.get("vocab_size"), cfg.model.vocab_size
    if not isinstance(vocab, int) or vocab <= mine:
        return []
    if cfg.train.init_from is not None:  # the model's vocabulary is the source's
        return [f"{data}: tokenized with a vocabulary of {vocab}, larger than the model's "
                f"{mine} (--init-from {cfg.train.init_from}); prepare the data with the "
                "model's tokenizer (plait data prepare --tokenizer hf:DIR)"]
    return [f"{data}: tokenized with a vocabulary of {vocab}, larger than the model's "
            f"{mine}; use --set model.vocab_size={vocab}, or prepare the data with "
            f"--vocab-size {mine} or less"]


def vocabulary_notes(cfg: Config, data: Path) -> list[str]:
    """A smaller vocabulary trains, but part of the embedding and the head never does."""
    vocab, mine = TokenFile.open(data).meta.get("vocab_size"), cfg.model.vocab_size
    if not isinstance(vocab, int) or vocab >= mine:
        return []
    return [f"{data} was tokenized with a vocabulary of {vocab}, smaller than the model's "
            f"{mine}: {mine - vocab} embedding and output rows are never used; "
            f"--set model.vocab_size={vocab} matches it"]
