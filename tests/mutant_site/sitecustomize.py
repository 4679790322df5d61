"""Applies the mutation check's mutant in a launched interpreter: tests/mutant_plugin.py
puts this folder first on PYTHONPATH and names the mutant in PLAIT_TEST_MUTANT, so every
process a mutated test starts (torchrun, its ranks, a node's launcher) runs with the same
bug as the test process itself; the process-tree tests are then mutation targets like the
rest. Python imports `sitecustomize` at start-up from the path (the `site` module)."""

import os
import sys

_NAME = os.environ.get("PLAIT_TEST_MUTANT", "none")
if _NAME != "none":
    _ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, _ROOT)
    from tests.mutants import MUTANTS  # noqa: E402

    {m.name: m for m in MUTANTS}[_NAME].apply()
