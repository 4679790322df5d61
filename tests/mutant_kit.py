"""The mutation check's vocabulary: a `Mutant` (a bug modelled as a monkeypatch of plait, and
the tests that must catch it) and `_Namespace` (a module stand-in with some names replaced).
tests/mutants.py runs them; the patches live in tests/mutants.py and tests/mutants_*.py by
topic."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Mutant:
    name: str
    bug: str  # what real bug it models
    apply: Callable[[], None]  # monkeypatches plait in the current process
    tests: list[str]  # pytest node ids (or files), run in this order; -x stops at the first
    k: str | None = None  # optional -k expression over `tests`


class _Namespace:
    """A stand-in for a module object (e.g. `F` in one module) with some names replaced."""

    def __init__(self, base, **over):
        self._base, self._over = base, over

    def __getattr__(self, name):
        if name in self._over:
            return self._over[name]
        return getattr(self._base, name)
