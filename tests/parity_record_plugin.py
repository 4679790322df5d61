"""pytest plugin that records every parity comparison's errors: `-p tests.parity_record_plugin
--parity-record FILE` (tests/measure_tolerances.py runs it).

Wraps `plait.testing.parity_errors` in `pytest_configure` (before any test forks its ranks
or calls `assert_parity`, which looks the function up in its module at each call): each
call appends one JSON line to FILE, with the test's id, the tolerance class and each check's
largest error and where it was seen, before `assert_parity` compares them with the bounds.
Lines are short single writes in append mode, so the xdist workers can share FILE.
"""

from __future__ import annotations

import json
import os


def pytest_addoption(parser):
    parser.addoption("--parity-record", default=None,
                     help="append every parity comparison's errors to this JSON-lines file")


def pytest_configure(config):
    path = config.getoption("parity_record")
    if path is None:
        return
    from plait import testing  # noqa: PLC0415 - only when recording is asked for

    measure = testing.parity_errors

    def recorded(run, ref, precision="fp64", init=None):
        errors = measure(run, ref, precision, init)
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
        isa = os.environ.get("ATEN_CPU_CAPABILITY") or "native"
        line = json.dumps({"test": test, "precision": precision, "isa": isa,
                           "errors": {k: [v, where] for k, (v, where) in errors.items()}})
        with open(path, "a") as f:
            f.write(line + "\n")
        return errors

    testing.parity_errors = recorded
