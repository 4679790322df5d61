"""Re-measure the parity tolerances: every test that calls `assert_parity`, run once with
every comparison's errors recorded (tests/parity_record_plugin.py), the worst error of each
tolerance class and check, and the table in docs/parity.md rewritten from them.

    .venv/bin/python tests/measure_tolerances.py           # the suite's parity tests (~5 min)
    .venv/bin/python tests/measure_tolerances.py --from runs.jsonl   # table from a record
    .venv/bin/python tests/measure_tolerances.py --keep after.jsonl --same-as before.jsonl

`--same-as`: a refactor's proof that nothing changed in behaviour: every comparison's
errors (each test, tolerance class and check) equal to the last digit to those of an
earlier record (made with `--keep` on the earlier commit); exit 1 otherwise.

A bound must sit between the worst error measured over the layouts it covers and 3x that
error (tests/test_parity_tolerances.py holds plait.testing.PARITY_TOLERANCES to the table);
the script prints every bound outside that band and exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from plait.testing import PARITY_TOLERANCES  # noqa: E402

DOC = ROOT / "docs" / "parity.md"
BEGIN, END = "<!-- tolerances:begin -->", "<!-- tolerances:end -->"
MAX_HEADROOM = 3.0


def parity_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "assert_parity(" in p.read_text())


def record(path: Path, files: list[str]) -> int:
    cmd = [sys.executable, "-m", "pytest", *files, "-n", "2", "--dist", "loadfile", "-q",
           "-p", "tests.parity_record_plugin", "--parity-record", str(path),
           "-p", "no:cacheprovider"]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode


def worst_errors(lines: list[dict]) -> dict[tuple[str, str], tuple[float, str, int]]:
    """(class, check) -> (worst error, the test and place it was seen, comparisons)."""
    out: dict[tuple[str, str], tuple[float, str, int]] = {}
    for rec in lines:
        for key, (err, where) in rec["errors"].items():
            k = (rec["precision"], key)
            best, at, n = out.get(k, (-1.0, "", 0))
            if err > best:
                best, at = err, f"{rec['test'].removeprefix('tests/')} ({where})"
            out[k] = (best, at, n + 1)
    return out


def table(worst: dict[tuple[str, str], tuple[float, str, int]]) -> tuple[str, list[str]]:
    rows = ["| class | check | bound | worst measured | bound / worst | comparisons | "
            "worst seen in |", "|---|---|---|---|---|---|---|"]
    problems = []
    for precision, tol in PARITY_TOLERANCES.items():
        for key, bound in tol.items():
            if bound is None:
                continue
            err, where, n = worst.get((precision, key), (None, "not measured", 0))
            if err is None:
                problems.append(f"{precision} {key}: no comparison measured it")
                rows.append(f"| {precision} | {key} | {bound:.1e} | - | - | 0 | - |")
                continue
            ratio = bound / err if err > 0 else (1.0 if bound == 0 else float("inf"))
            if not 1.0 <= ratio <= MAX_HEADROOM:
                problems.append(f"{precision} {key}: bound {bound:.1e}, worst {err:.2e} "
                                f"({ratio:.2f}x)")
            rows.append(f"| {precision} | {key} | {bound:.1e} | {err:.2e} | {ratio:.2f} | "
                        f"{n} | {where.replace('|', '/')} |")
    return "\n".join(rows), problems


def errors_by_comparison(lines: list[dict]) -> dict[tuple[str, str], list[str]]:
    """(test, class) -> each of its records' errors by check, canonical and sorted."""
    out: dict[tuple[str, str], list[str]] = {}
    for rec in lines:
        errors = {k: err for k, (err, _) in rec["errors"].items()}
        out.setdefault((rec["test"], rec["precision"]), []).append(
            json.dumps(errors, sort_keys=True))
    return {k: sorted(v) for k, v in out.items()}


def same_as(before: list[dict], after: list[dict]) -> list[str]:
    """Where `after`'s comparisons differ from `before`'s (missing ones included)."""
    a, b = errors_by_comparison(before), errors_by_comparison(after)
    diffs = [f"{k[0]} [{k[1]}]: " + ("only before" if k not in b else "only after"
                                     if k not in a else "errors differ")
             for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    print(f"{len(set(a) | set(b)) - len(diffs)} of {len(set(a) | set(b))} comparisons "
          "carry the same errors")
    return diffs


def rewrite_doc(text: str) -> None:
    doc = DOC.read_text()
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="source", type=Path,
                    help="build the table from this record instead of running the tests")
    ap.add_argument("--keep", type=Path, help="keep the record at this path")
    ap.add_argument("--no-write", action="store_true", help="print only; leave the doc")
    ap.add_argument("--same-as", type=Path, metavar="BEFORE.jsonl",
                    help="also check every comparison's errors equal this earlier record's")
    args = ap.parse_args(argv)
    if args.source is None:
        with tempfile.TemporaryDirectory() as tmp:
            path = args.keep or Path(tmp) / "parity.jsonl"
            path.unlink(missing_ok=True)
            rc = record(path, parity_test_files())
            lines = [json.loads(x) for x in path.read_text().splitlines()]
        if rc != 0:
            print(f"note: pytest exited {rc} (a bound the run exceeded is listed below)")
    else:
        lines = [json.loads(x) for x in args.source.read_text().splitlines()]
    text, problems = table(worst_errors(lines))
    print(text)
    if not args.no_write:
        rewrite_doc(text)
        print(f"\nwrote {DOC.relative_to(ROOT)}")
    for p in problems:
        print(f"outside [1, {MAX_HEADROOM:g}] x worst: {p}")
    changed = []
    if args.same_as is not None:
        before = [json.loads(x) for x in args.same_as.read_text().splitlines()]
        changed = same_as(before, lines)
        for c in changed:
            print(f"changed: {c}")
    return 1 if problems or changed else 0


if __name__ == "__main__":
    sys.exit(main())
