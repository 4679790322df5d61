"""The tables in docs/results/: each written by the benchmark that measures it.

A benchmark given `--write PATH` writes its results to PATH as markdown: the command
that regenerates the file (this process's own command line), when and on what machine
it ran, its tables, and what they show. Standard library only (simulate_scale.py runs
without torch). docs/results/README.md lists every file and its command.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def add_write_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--write", metavar="PATH",
                    help="also write the results as markdown to PATH "
                         "(docs/results/NAME.md; the file names this command)")


def command() -> str:
    """This benchmark's command line, as a user types it from the repository root."""
    return " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}",
                     *map(shlex.quote, sys.argv[1:])])


def machine() -> str:
    """The CPU model and count, e.g. 'AMD EPYC 7B13, 2 CPUs'."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def run_line(load_start: float | None = None) -> str:
    """When and where: the date now (UTC), the machine, the load average (1 minute) at
    the start (if given) and now. On a shared machine the load decides the numbers."""
    now = os.getloadavg()[0]
    load = (f"load average {load_start:.1f} at the start, {now:.1f} at the end"
            if load_start is not None else f"load average {now:.1f} at the end")
    return f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine()}; {load}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def goal_table(rows: Sequence[tuple[str, str, str, str]]) -> str:
    """The goals' table: (what, measured, goal, met?) per row; ratios are plait / peer
    and every goal is an upper bound."""
    return table(("what", "measured", "goal", "met?"), rows)


def render(title: str, sections: Sequence[str], shows: str, *, run: str,
           cmd: str) -> str:
    return "\n\n".join([
        f"# {title}",
        f"Regenerate: `{cmd}`",
        f"Run: {run}.",
        *sections,
        f"What it shows: {shows}",
    ]) + "\n"


def write(path: str | os.PathLike, title: str, sections: Sequence[str], shows: str, *,
          run: str | None = None, cmd: str | None = None) -> None:
    """Write the results file (to a temporary name, then renamed into place). `sections`
    are markdown blocks, each a table with a line above it saying what it holds; `shows`
    says what the numbers show, in words that stay true of any run."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render(title, sections, shows, run=run or run_line(), cmd=cmd or command()))
    tmp.replace(path)
    print(f"wrote {path}")
