"""The `plait` parsers' shared behaviour: a mistake is one line, with the closest name.

argparse answers a mistyped flag (`plait train --setps 5`) or a bad choice (`--schedule
zbv`) with the whole usage (two dozen lines for `plait train`) and then the error. Here
the error is one line, naming the nearest flag, command or choice where one is close
(`did you mean --steps?`); `--help` still prints the usage in full. Every subcommand's
parser is this class (argparse gives subparsers their parent's class).

`copy_flags` lets a subcommand take some of another's flags (plait eval, plait report:
the configuration flags, not the training ones) with the same help.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import re
import sys
from collections.abc import Callable, Iterable

_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


class PlaitParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line; `argv` (set by plait.cli.main before
    parsing) lets the top-level parser find the subcommand an unknown flag was given to."""

    argv: list[str] = []

    def error(self, message: str):  # argparse's hook: must not return
        if message.startswith("unrecognized arguments:"):
            print(self._unknown(message), file=sys.stderr)
        else:
            print(f"{self.prog}: {message}{self._hint(message)}", file=sys.stderr)
        self.exit(2)

    def _hint(self, message: str) -> str:
        choice = _CHOICE.search(message)
        if choice:
            names = [c.strip().strip("'") for c in choice.group(2).split(",")]
            close = difflib.get_close_matches(choice.group(1), names, n=1, cutoff=0.5)
            return f"; did you mean {close[0]}?" if close else ""
        if "required: command" in message:
            return " (plait --help lists the commands)"
        return ""

    def _unknown(self, message: str) -> str:
        """Flags no parser took (argparse leaves them to the top-level parser): named with
        the subcommand they were given to, and its closest flag."""
        parser, prog = self._parser_of(self.argv)
        unknown = message.split(":", 1)[1].strip()
        flag = next((w.split("=")[0] for w in unknown.split() if w.startswith("-")), None)
        close = difflib.get_close_matches(flag, _flags(parser), n=1, cutoff=0.6) \
            if flag else []
        said = f"; did you mean {close[0]}?" if close else ""
        return f"{prog}: unrecognized arguments: {unknown}{said} ({prog} --help lists them)"

    def _parser_of(self, argv: list[str]) -> tuple[argparse.ArgumentParser, str]:
        """The (sub)parser the words of `argv` select, and its name as typed."""
        parser, prog = self, self.prog
        for word in argv:
            subs = _subcommands(parser)
            if word in subs:
                parser, prog = subs[word], f"{prog} {word}"
        return parser, prog


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps no public list of them
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


def copy_flags(p: argparse.ArgumentParser, adder: Callable[[argparse.ArgumentParser], None],
               keep: Iterable[str], hidden: Iterable[str] = (),
               helps: dict[str, str] | None = None) -> None:
    """Add to `p` the flags named in `keep` of those `adder` adds, with their help (or
    `helps`' for the flags named there); the `hidden` ones are accepted but not listed in
    --help (a flag in both is listed). One definition of each flag stays where `adder`
    lives."""
    scratch = argparse.ArgumentParser(add_help=False)
    adder(scratch)
    keep, hidden, helps = set(keep), set(hidden), helps or {}
    for action in scratch._actions:
        names = set(action.option_strings)
        if not names & (keep | hidden):
            continue
        action = copy.copy(action)
        shown = names & keep
        if not shown:
            action.help = argparse.SUPPRESS
        elif shown & helps.keys():
            action.help = helps[next(iter(shown & helps.keys()))]
        p._add_action(action)  # the action as built by `adder`, choices and type included
