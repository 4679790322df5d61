"""Golden outputs: `plait plan --json` and `plait simulate --json` frozen before a refactor.

Each case runs the CLI in-process (`plait.cli.main(argv)`, stdout captured) and compares
the JSON it prints with tests/golden/<case>.json: strings, ints, bools and None exactly (a
type change is a difference too), floats with a relative tolerance of 1e-9. A failure
names the path of the first difference, e.g. `layouts[0].time_breakdown_s.compute`.

No key is dropped: neither output has a run-dependent field (no timings, dates or paths;
the search is deterministic), so `RUN_DEPENDENT` is empty. Should one appear, add exactly
its key there, with the reason.

Regenerate the golden files (only when an output is meant to change; say why in the
commit), from the repository root:

    .venv/bin/python tests/test_golden.py --update           # every case
    .venv/bin/python tests/test_golden.py --update sim_zb-v  # the named cases
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"
REL_TOL = 1e-9
RUN_DEPENDENT: frozenset[str] = frozenset()  # keys dropped before comparing: none today

PLAN = ["plan", "--model", "llama3-70b", "--gpu", "h100-sxm", "--gpus", "512",
        "--global-batch", "1024", "--json"]
CASES: dict[str, list[str]] = {
    # the search (65,040 layouts considered) and its top 5 with the explanation
    "plan_search": PLAN,
    # two single layouts through the simulator
    "plan_layout_interleaved": PLAN + ["--layout", "tp=8,pp=8,dp=8", "--microbatch", "1",
                                       "--schedule", "interleaved", "--virtual-stages", "2"],
    # (ZeRO-1: the runtime builds ZeRO 0-1 with a pipeline, and plan refuses what it does not)
    "plan_layout_zbv_zero1_full": PLAN + ["--layout", "tp=4,pp=4,dp=32", "--microbatch", "2",
                                          "--schedule", "zb-v", "--zero", "1",
                                          "--recompute", "full"],
    # the simulator: closed forms present (uniform durations) and absent (zb-v, uneven + p2p)
    "sim_1f1b": ["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8",
                 "--json"],
    "sim_interleaved": ["simulate", "--schedule", "interleaved", "--pp", "4",
                        "--microbatches", "8", "--json"],
    "sim_zb-v": ["simulate", "--schedule", "zb-v", "--pp", "4", "--microbatches", "8",
                 "--forward", "1.0", "--backward-input", "1.25", "--backward-weight", "0.75",
                 "--p2p", "0.05", "--json"],
}


def strip(doc):
    """`doc` without the RUN_DEPENDENT keys, at any depth."""
    if isinstance(doc, dict):
        return {k: strip(v) for k, v in doc.items() if k not in RUN_DEPENDENT}
    if isinstance(doc, list):
        return [strip(v) for v in doc]
    return doc


def first_difference(got, want, path: str = "") -> str | None:
    """Where `got` first differs from `want` (and how), or None when they agree."""
    where = path or "<root>"
    if isinstance(want, float) and isinstance(got, float):
        if math.isclose(got, want, rel_tol=REL_TOL, abs_tol=0.0) or got == want:
            return None
        return f"{where}: {got!r} != {want!r} (relative tolerance {REL_TOL})"
    if type(got) is not type(want):
        return f"{where}: type {type(got).__name__} != {type(want).__name__} ({got!r} vs {want!r})"
    if isinstance(want, dict):
        if list(got) != list(want):
            missing = [k for k in want if k not in got]
            extra = [k for k in got if k not in want]
            return (f"{where}: keys differ (missing {missing}, extra {extra})" if missing or extra
                    else f"{where}: key order {list(got)} != {list(want)}")
        for k in want:
            d = first_difference(got[k], want[k], f"{path}.{k}" if path else k)
            if d:
                return d
        return None
    if isinstance(want, list):
        if len(got) != len(want):
            return f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            d = first_difference(g, w, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if got == want else f"{where}: {got!r} != {want!r}"


def golden_file(name: str) -> Path:
    return GOLDEN / f"{name}.json"


@pytest.mark.parametrize("name", list(CASES))
def test_golden(name, capsys):
    from plait.cli.main import main

    argv = CASES[name]
    stored = json.loads(golden_file(name).read_text())
    assert stored["argv"] == argv, f"{name}: the case changed; regenerate (see the docstring)"
    capsys.readouterr()
    assert main(list(argv)) == 0
    got = strip(json.loads(capsys.readouterr().out))
    diff = first_difference(got, strip(stored["output"]))
    assert diff is None, f"{name} (plait {' '.join(argv)}): {diff}"


def test_comparer_reports_the_path():
    want = {"a": [1, {"b": 1.0, "c": "x"}], "d": 2}
    assert first_difference(want, want) is None
    assert first_difference({"a": [1, {"b": 1.0 + 1e-12, "c": "x"}], "d": 2}, want) is None
    assert first_difference({"a": [1, {"b": 1.001, "c": "x"}], "d": 2}, want).startswith("a[1].b:")
    assert first_difference({"a": [1, {"b": 1.0, "c": "y"}], "d": 2}, want).startswith("a[1].c:")
    assert "type float != int" in first_difference({"a": [1, {"b": 1.0, "c": "x"}], "d": 2.0},
                                                   want)
    assert "missing ['d']" in first_difference({"a": [1, {"b": 1.0, "c": "x"}]}, want)


def update(names: list[str]) -> None:
    # run as a script: import this checkout's plait, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from plait.cli.main import main

    GOLDEN.mkdir(exist_ok=True)
    for name in names or list(CASES):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(list(CASES[name]))
        if rc != 0:
            raise SystemExit(f"{name}: plait exited {rc}")
        doc = {"argv": CASES[name], "output": json.loads(buf.getvalue())}
        golden_file(name).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {golden_file(name)}")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--update"] or any(a not in CASES for a in sys.argv[2:]):
        raise SystemExit(f"usage: python tests/test_golden.py --update [{' | '.join(CASES)}]")
    update(sys.argv[2:])
