"""The mutation check (`make mutants`, tests/mutants.py) can only prove something if every
test it names exists: a renamed parametrization turns a mutant into an exit-4 "BROKEN" run
that proves nothing. This collects every mutant's selection, in one pytest process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mutants import MUTANTS, ROOT


def _collect(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=",
         "-p", "no:cacheprovider", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow  # a pytest of its own collecting every mutant's tests
def test_every_mutant_names_a_bug_and_tests_that_exist():
    """One collection of every file the mutants name: each node id is collected, and each
    -k keyword selects a test of its files (the mutants' -k expressions are single words,
    matched as pytest matches a keyword: a substring of the test's name)."""
    assert len({m.name for m in MUTANTS}) == len(MUTANTS), "two mutants share a name"
    assert all(m.bug and m.tests for m in MUTANTS)
    files = sorted({t.split("::")[0] for m in MUTANTS for t in m.tests})
    assert all((ROOT / f).is_file() for f in files), [f for f in files
                                                      if not (ROOT / f).is_file()]
    got = _collect(files)
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]
    collected = {line.strip() for line in got.stdout.splitlines() if "::" in line}
    missing = [t for m in MUTANTS if m.k is None for t in m.tests if "::" in t
               and t not in collected and not any(c.startswith(t + "[") for c in collected)]
    assert not missing, f"mutant tests not collected: {missing}"
    for m in (m for m in MUTANTS if m.k is not None):
        assert m.k.isidentifier(), f"{m.name}: -k {m.k!r} is not a single keyword"
        selected = [c for c in collected if c.split("::")[0] in m.tests
                    and m.k.lower() in c.split("::", 1)[1].lower()]
        assert selected, f"{m.name}: -k {m.k!r} selects no test of {m.tests}"


def test_the_runner_calls_only_assertion_failures_caught(monkeypatch):
    """pytest's exit 4 (a test id not found) or a crashed rank is BROKEN, exit 0 NOT
    CAUGHT; only assertion failures count as CAUGHT."""
    import mutants
    from mutant_kit import Mutant

    m = Mutant("m", "a bug", lambda: None, ["tests/test_x.py::test_y"])
    cases = [((4, [], [], 0.0, "ERROR: not found: tests/test_x.py::test_y", None), "BROKEN"),
             ((0, [], [], 0.0, "", None), "NOT CAUGHT"),
             ((1, ["t"], ["plait.launch.forked.RankFailure: _rank on 2 ranks failed"], 0.0, "",
               None), "BROKEN"),
             ((1, ["t"], ["AssertionError: step 0: loss 1.0 vs reference 2.0"], 0.0, "", 4e6),
              "CAUGHT")]
    for result, status in cases:
        monkeypatch.setattr(mutants, "run_pytest", lambda *a, r=result: r)
        assert mutants.run_mutant(m, timeout=1).status == status, (result, status)
