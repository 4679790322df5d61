"""Regenerate every command output the docs show: the blocks README.md and docs/*.md mark
with the command that printed them.

A marked block, in the Markdown source:

    <!-- plait-output: plait plan --model llama3-8b --gpus 8 | head -n 4 -->
    ```text
    $ plait plan --model llama3-8b --gpus 8 | head -n 4
    ...what the command prints...
    ```
    <!-- /plait-output -->

The command is a `plait` command, optionally piped through filters that keep some of its
lines: `head -n N`, `tail -n N`, `grep -E PATTERN` (Python's `re`, searched in each
line), `grep -v -E PATTERN`. The block shows the command (after `$ `) and then what it
printed to stdout, trailing spaces dropped, at 80 terminal columns (the width plait's
plain tables take when stdout is not a terminal; `plait plan` prints at 160).

    .venv/bin/python tests/regen_docs.py            # rewrite every marked block
    .venv/bin/python tests/regen_docs.py --check    # print the stale ones, exit 1 if any
    .venv/bin/python tests/regen_docs.py docs/float8.md   # only these documents

tests/test_doc_outputs.py fails when a block differs from what its command prints now,
so a change to plait's output is a change to the docs in the same commit. Numbers the
docs quote from a command belong in such a block, not in prose.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COLUMNS = "80"
BLOCK = re.compile(r"<!-- plait-output: (?P<command>[^\n]+?) -->\n```text\n(?P<shown>.*?)"
                   r"^```\n<!-- /plait-output -->", re.S | re.M)
FILTERS = "head -n N, tail -n N, grep -E PATTERN, grep -v -E PATTERN"


class MarkError(ValueError):
    """A marked block's command that this tool cannot run."""


@dataclass(frozen=True)
class MarkedBlock:
    doc: str  # README.md, docs/deepseek.md, ...
    command: str  # as marked: `plait ...`, then `| filter` parts
    shown: str  # the fenced block's text now

    def argv(self) -> list[str]:
        """The plait command's arguments, after `plait`."""
        return split_pipeline(self.command)[0][1:]

    def is_slow(self) -> bool:
        """The slow tier's: a `plait plan` that searches every layout (seconds), and a
        `plait train` (a dry run forks a rank and reads the default corpus, which the
        first use prepares)."""
        argv = self.argv()
        search = argv[:1] == ["plan"] and "--layout" not in argv and "--help" not in argv
        return search or argv[:1] == ["train"]


def split_pipeline(command: str) -> list[list[str]]:
    """The command's words, cut at each `|`: the plait command, then each filter."""
    parts: list[list[str]] = [[]]
    for word in shlex.split(command):
        if word == "|":
            parts.append([])
        else:
            parts[-1].append(word)
    if parts[0][:1] != ["plait"] or any(not p for p in parts):
        raise MarkError(f"{command!r}: mark a `plait ...` command, optionally piped through "
                        f"{FILTERS}")
    return parts


def apply_filter(words: list[str], lines: list[str]) -> list[str]:
    """The lines a filter keeps."""
    match words:
        case ["head", "-n", n] if n.isdigit():
            return lines[:int(n)]
        case ["tail", "-n", n] if n.isdigit():
            return lines[len(lines) - int(n):] if int(n) else []
        case ["grep", "-E", pattern]:
            return [line for line in lines if re.search(pattern, line)]
        case ["grep", "-v", "-E", pattern]:
            return [line for line in lines if not re.search(pattern, line)]
    raise MarkError(f"filter {' '.join(words)!r}: use one of {FILTERS}")


def mark_problems(paths: list[Path]) -> list[str]:
    """What would stop a rewrite of `paths`, found before any command runs or any file is
    written: a missing document, a mark whose command or filters cannot run."""
    problems = []
    for path in paths:
        if not path.is_file():
            problems.append(f"{path}: no such document")
            continue
        for block in marked_blocks(path):
            try:
                for words in split_pipeline(block.command)[1:]:
                    if words[:1] == ["grep"]:
                        re.compile(words[-1])
                    apply_filter(words, [])
            except (MarkError, re.error, ValueError) as e:
                problems.append(f"{block.doc}: {e}")
    return problems


def plait_stdout(argv: list[str]) -> str:
    """What `plait ARGV` prints to stdout, run in this process in an empty temporary
    directory (a command that writes a file writes it there) at COLUMNS columns; a
    non-zero exit raises with its stderr."""
    from plait.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    here, columns = os.getcwd(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = COLUMNS
    try:
        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(list(argv))
    finally:
        os.chdir(here)
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    if code != 0:
        raise MarkError(f"plait {shlex.join(argv)} exited {code}: {err.getvalue().strip()}")
    return out.getvalue()


def render(command: str) -> str:
    """The block's text for `command`: the command after `$ `, then its kept lines."""
    parts = split_pipeline(command)
    lines = [line.rstrip() for line in plait_stdout(parts[0][1:]).splitlines()]
    for words in parts[1:]:
        lines = apply_filter(words, lines)
    return "\n".join([f"$ {command}", *lines]) + "\n"


def marked_blocks(path: Path) -> list[MarkedBlock]:
    doc = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    return [MarkedBlock(doc, m["command"], m["shown"]) for m in BLOCK.finditer(path.read_text())]


def regenerate(path: Path) -> list[str]:
    """Rewrite `path`'s marked blocks with what their commands print now; the commands
    whose block changed."""
    changed: list[str] = []

    def fresh(m: re.Match[str]) -> str:
        text = render(m["command"])
        if text != m["shown"]:
            changed.append(m["command"])
        return (f"<!-- plait-output: {m['command']} -->\n```text\n{text}```\n"
                "<!-- /plait-output -->")

    new = BLOCK.sub(fresh, path.read_text())
    if changed:
        path.write_text(new)
    return changed


def stale(block: MarkedBlock) -> str:
    """A diff of the block against its command's output now ('' when it is current)."""
    now = render(block.command)
    return "".join(difflib.unified_diff(block.shown.splitlines(True), now.splitlines(True),
                                        f"{block.doc} (as shown)", "now"))


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [Path(a).resolve() for a in argv if a != "--check"] or DOCS
    problems = mark_problems(paths)
    if problems:
        print("regen_docs: nothing rewritten:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return 2
    found = 0
    for path in paths:
        if check:
            for block in marked_blocks(path):
                diff = stale(block)
                found += bool(diff)
                print(diff, end="")
        else:
            for command in regenerate(path):
                found += 1
                print(f"{path.relative_to(ROOT)}: rewrote `{command}`")
    print(f"{found} block(s) {'stale' if check else 'rewritten'}", file=sys.stderr)
    return 1 if check and found else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
