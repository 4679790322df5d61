"""pytest plugin for the mutation check: `-p tests.mutant_plugin --mutant NAME`.

Applies the named mutant (tests/mutants.py, MUTANTS) in `pytest_configure`: before any
test module is imported (so `from plait... import name` in a test sees the patched
object) and before any test forks its ranks (run_ranks forks, so the ranks inherit the
patch). `--mutant none` (the default) applies nothing: the control run.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption("--mutant", default="none",
                     help="name of the mutant in tests/mutants.py to apply ('none': control)")


def pytest_configure(config):
    name = config.getoption("mutant")
    if name == "none":
        return
    from tests.mutants import MUTANTS  # noqa: PLC0415 - only when a mutant is asked for

    by_name = {m.name: m for m in MUTANTS}
    if name not in by_name:
        raise pytest.UsageError(f"--mutant {name!r}: unknown; known: {', '.join(by_name)}")
    by_name[name].apply()


def pytest_report_header(config):
    return f"mutant: {config.getoption('mutant')}"
