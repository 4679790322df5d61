"""pytest plugin for the mutation check: `-p tests.mutant_plugin --mutant NAME`.

Applies the named mutant (tests/mutants.py, MUTANTS) in `pytest_configure`: before any
test module is imported (so `from plait... import name` in a test sees the patched
object) and before any test forks its ranks (run_ranks forks, so the ranks inherit the
patch). Processes a test launches (torchrun, its ranks, launchers) get it too: the
mutant's name goes in PLAIT_TEST_MUTANT and tests/mutant_site first on PYTHONPATH, whose
sitecustomize applies it as each interpreter starts. `--mutant none` (the default)
applies nothing: the control run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SITE = Path(__file__).resolve().parent / "mutant_site"


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
    # launched interpreters: tests/mutant_site/sitecustomize.py applies it at their start
    os.environ["PLAIT_TEST_MUTANT"] = name
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(SITE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def pytest_report_header(config):
    return f"mutant: {config.getoption('mutant')}"
