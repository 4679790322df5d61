"""The metrics rows where users already look: TensorBoard and Weights & Biases.

`plait train --tensorboard DIR` and `--wandb PROJECT` hand rank 0's metrics rows, the
same dicts the `--metrics-out` JSON lines are written from, to these sinks, so a sink
cannot disagree with the JSON: every number of a step row (loss, grad norm, lr, tokens/s,
step time, bytes sent in total and per mesh dim, memory by category on the measured
step, MoE routing) becomes a scalar named by its path in the row (`loss`,
`comm_sent_bytes_by_dim/dp`, `memory/peak/activations`), at the row's step; the summary
line's numbers (tokens/s, the ledger per step, the pipeline's measured and simulated
bubble, overlap per dim) become `summary/...` scalars at the last step (TensorBoard) or
the run's summary (W&B). TensorBoard scalars are written as float64 tensors, so what
is read back equals the JSON. W&B runs offline by default (`--wandb-mode offline`: the
run is written under `--wandb-dir`, nothing goes to the network; `wandb sync` uploads it
later). Both packages are optional extras (`pip install 'plait[tensorboard]'`,
`'plait[wandb]'`); asking for a missing one is refused before any rank starts
(`sink_problems`, read by plait/train/checks.py).
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from plait.files import directory_problems

# sink flag -> (the package it needs, the extra that installs it)
PACKAGES = {"--tensorboard": ("tensorboard", "plait[tensorboard]"),
            "--wandb": ("wandb", "plait[wandb]")}
WANDB_MODES = ("offline", "online")
# characters W&B refuses in a project name
_WANDB_BAD = set('/\\#?%:')
# summary keys that are not numbers of the run (the configuration, the timeline's events)
_SUMMARY_SKIP = ("summary", "config", "pipeline_timeline")


def add_sink_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("metrics sinks (rank 0 writes; docs/metrics.md)")
    g.add_argument("--tensorboard", metavar="DIR", help="also write each step's metrics as "
                   "TensorBoard scalars under DIR (needs plait[tensorboard])")
    g.add_argument("--wandb", metavar="PROJECT", help="also log each step's metrics to a "
                   "Weights & Biases run of PROJECT, offline by default (needs plait[wandb])")
    g.add_argument("--wandb-dir", metavar="DIR", help="--wandb: where the run is written "
                   "(DIR/wandb/...; default the current directory)")
    g.add_argument("--wandb-mode", choices=WANDB_MODES, help="--wandb: offline (default: "
                   "nothing leaves the machine; `wandb sync` uploads later) or online")


def _missing(flag: str) -> str | None:
    package, extra = PACKAGES[flag]
    if importlib.util.find_spec(package) is not None:
        return None
    return (f"{flag} needs the {package} package, which is not installed: pip install "
            f"'{extra}' (or leave out {flag})")


def sink_problems(args: argparse.Namespace) -> list[str]:
    """The sink flags' problems, each naming the fix; nothing is created."""
    problems: list[str] = []
    board, project = getattr(args, "tensorboard", None), getattr(args, "wandb", None)
    if board is not None:
        problems += [m for m in [_missing("--tensorboard")] if m]
        problems += directory_problems("--tensorboard", board)
    if project is None:
        problems += [f"{flag} is for --wandb; add --wandb PROJECT or leave {flag} out"
                     for flag, v in (("--wandb-dir", getattr(args, "wandb_dir", None)),
                                     ("--wandb-mode", getattr(args, "wandb_mode", None)))
                     if v is not None]
        return problems
    if not project.strip():
        problems.append("--wandb is empty; give a project name")
    elif _WANDB_BAD & set(project) or len(project) > 128:
        problems.append(f"--wandb {project!r}: a W&B project name has at most 128 "
                        f"characters and none of {''.join(sorted(_WANDB_BAD))}")
    problems += [m for m in [_missing("--wandb")] if m]
    # the run's directory, by default the current one (W&B's own default)
    problems += directory_problems("--wandb-dir", getattr(args, "wandb_dir", None) or ".")
    return problems


def _leaves(value: Any, path: str) -> Iterator[tuple[str, float]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}/{k}" if path else str(k))
    elif isinstance(value, bool):
        yield path, float(value)
    elif isinstance(value, (int, float)):
        yield path, value


def step_scalars(row: dict) -> dict[str, float]:
    """Every number of a step row by its path (the step itself is the x axis)."""
    return dict(_leaves({k: v for k, v in row.items() if k != "step"}, ""))


def summary_scalars(summary: dict) -> dict[str, float]:
    """Every number of the summary line, under `summary/`."""
    return dict(_leaves({k: v for k, v in summary.items() if k not in _SUMMARY_SKIP},
                        "summary"))


class MetricSinks:
    """The sinks rank 0 writes: a TensorBoard event file and/or a W&B run."""

    def __init__(self, tensorboard: str | None = None, wandb_project: str | None = None,
                 wandb_dir: str | None = None, wandb_mode: str | None = None,
                 config: dict | None = None, name: str | None = None):
        self.board, self.run, self.last_step = None, None, 0
        if tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(log_dir=str(Path(tensorboard).expanduser()))
        if wandb_project is not None:
            try:
                self._open_wandb(wandb_project, wandb_dir, wandb_mode, config, name)
            except BaseException:  # no event file left open behind a failed start
                self.close(failed=True)
                raise

    def _open_wandb(self, project: str, wandb_dir: str | None, mode: str | None,
                    config: dict | None, name: str | None) -> None:
        import wandb

        where = Path(wandb_dir or ".").expanduser()
        where.mkdir(parents=True, exist_ok=True)
        # no console capture, no system-metrics sampler, no git or pip probing
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                  disable_git=True, save_code=False, x_save_requirements=False)
        self.run = wandb.init(project=project, dir=str(where), name=name,
                              mode=mode or "offline", config=config or {}, settings=settings)

    @classmethod
    def from_args(cls, args: argparse.Namespace, config: dict, name: str
                  ) -> MetricSinks | None:
        if args.tensorboard is None and args.wandb is None:
            return None
        return cls(args.tensorboard, args.wandb, args.wandb_dir, args.wandb_mode, config, name)

    def write_row(self, row: dict) -> None:
        """One step row, at its step."""
        step = int(row["step"])
        self.last_step = step
        values = step_scalars(row)
        if self.board is not None:
            for tag, v in values.items():
                self.board.add_scalar(tag, v, global_step=step, new_style=True,
                                      double_precision=True)
            self.board.flush()
        if self.run is not None:
            self.run.log(values, step=step)

    def write_summary(self, summary: dict) -> None:
        values = summary_scalars(summary)
        if self.board is not None:
            for tag, v in values.items():
                self.board.add_scalar(tag, v, global_step=self.last_step, new_style=True,
                                      double_precision=True)
            self.board.flush()
        if self.run is not None:
            self.run.summary.update(values)

    def close(self, failed: bool = False) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None
