"""Every `plait ...` command in README.md's and docs/*.md's code blocks, as a user would
type it, and the cheapest check that it would not exit 2 (tests/test_docs_commands.py).

A command is read as the shell would: continuation lines joined, the `# comment` dropped.
The docs' own notation is expanded: `...` (flags left to the reader) is dropped, an
optional `[--flag VALUE]` is kept (the fuller command is the stricter check), and
`a|b|c` stands for each of its alternatives, each checked.
"""

from __future__ import annotations

import argparse
import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class DocCommand:
    doc: str  # README.md, docs/pipeline.md, ...
    line: str  # as written (continuations joined)
    argv: tuple[str, ...]  # after `plait`, one expansion of the notation

    def __str__(self) -> str:
        return f"{self.doc}: plait {' '.join(self.argv)}"


def _lines(block: str) -> list[str]:
    """The block's lines, continuations joined."""
    out: list[str] = []
    pending = ""
    for raw in block.splitlines():
        text = pending + (" " if pending else "") + raw.strip()
        if text.endswith("\\"):
            pending = text[:-1].rstrip()
            continue
        pending = ""
        out.append(text)
    return out + ([pending] if pending else [])


def _strip_comment(line: str) -> str:
    """Drop `# ...` (a shell comment: after whitespace, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def _expand(words: list[str]) -> list[tuple[str, ...]]:
    """The notation expanded: `...` dropped, an optional group kept (unless it elides
    something: `[--layout ...]`), `a|b` as each of a and b."""
    kept: list[list[str]] = []
    group: list[list[str]] | None = None
    elided = False
    for w in words:
        if w.startswith("[") and group is None:
            group, elided, w = [], False, w[1:]
        closes = group is not None and w.endswith("]")
        w = w[:-1] if closes else w
        elided |= w == "..."
        if w and w != "...":
            (group if group is not None else kept).append(w.split("|") if "|" in w else [w])
        if closes:
            kept += [] if elided else group
            group = None
    return list(itertools.product(*kept))


def doc_commands() -> list[DocCommand]:
    """Every `plait` command of every code block, in document order, expanded."""
    found = []
    for path in DOCS:
        doc = path.relative_to(ROOT).as_posix()
        for block in FENCE.findall(path.read_text()):
            for line in _lines(block):
                line = _strip_comment(line).removeprefix("sudo ")
                if not line.startswith("plait "):
                    continue
                words = shlex.split(line)[1:]
                found += [DocCommand(doc, line, argv) for argv in _expand(words)]
    return found


def toml_example() -> str:
    """docs/usage.md's TOML file (the `run.toml` its `--config` commands name)."""
    text = (ROOT / "docs" / "usage.md").read_text()
    return re.search(r"^```toml\n(.*?)^```", text, re.S | re.M).group(1)


def train_problems(argv: list[str]) -> list[str]:
    """What `plait train ARGV` reports before it launches anything: its flags, the
    configuration and the layout against the world. Not checked: files other commands
    make (a checkpoint to resume, a token file, an `--init-from` model: the option is left
    out), the host's memory, hostnames."""
    from plait.cli.main import build_parser, dry_run_flag_problems
    from plait.config import ConfigError
    from plait.train.checks import flag_problems
    from plait.train.flags import config_from_args

    argv = _without(argv, "--init-from")
    args = build_parser().parse_args(["train", *argv])  # a bad flag: SystemExit(2)
    problems = flag_problems(args) + dry_run_flag_problems(args)
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        return problems + e.problems
    world = args.world_size if args.dry_run else (args.nproc or cfg.parallel.world_size)
    if args.nnodes:
        world *= args.nnodes
    return problems + cfg.validate(world_size=world)


def _without(argv: list[str], flag: str) -> list[str]:
    out = list(argv)
    while flag in out:
        i = out.index(flag)
        del out[i:i + 2]
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    """The command's flags through plait's own parser (a bad one: SystemExit(2))."""
    from plait.cli.main import build_parser

    return build_parser().parse_args(argv)
